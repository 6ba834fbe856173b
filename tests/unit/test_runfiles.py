"""The run directory's names are spelled once, in slurmkit/runfiles.py (issue 35).

Read from the source with ast: a string constant equal to one of the names, passed to
os.path.join anywhere in slurmkit/ or testkit/ (or in a template's join), is a second spelling.
"""

from __future__ import annotations

import ast
from pathlib import Path

import slurmkit
from slurmkit import runfiles

ROOT = Path(slurmkit.__file__).resolve().parent.parent
NAMES = {v: k for k, v in vars(runfiles).items() if k.isupper() and isinstance(v, str)}


def _joins(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "join"
                and isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "path"):
            continue
        for arg in node.args:
            if isinstance(arg, ast.Constant) and arg.value in NAMES:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {arg.value!r} (runfiles.{NAMES[arg.value]})")
    return found


def test_names_are_distinct_and_plain() -> None:
    values = [v for k, v in vars(runfiles).items() if k.isupper()]
    assert len(values) == len(set(values)) == len(NAMES)
    assert all(v and "/" not in v and v not in (".", "..") for v in values)


def test_runfiles_imports_nothing() -> None:
    tree = ast.parse((ROOT / "slurmkit" / "runfiles.py").read_text(encoding="utf-8"))
    imports = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert all(isinstance(n, ast.ImportFrom) and n.module == "__future__" for n in imports)


def test_no_second_spelling_in_joins() -> None:
    found = [hit for top in ("slurmkit", "testkit") for path in sorted((ROOT / top).rglob("*.py"))
             if path.name != "runfiles.py" for hit in _joins(path)]
    assert not found, "join the names of slurmkit/runfiles.py instead:\n" + "\n".join(found)


def test_templates_join_the_names() -> None:
    for path in sorted((ROOT / "sbatch_templates").glob("*.j2")):
        text = path.read_text(encoding="utf-8")
        for name in (runfiles.CONFIG_NAME, runfiles.LOGS_DIR):
            assert f"/{name}" not in text, f"{path.name} spells {name!r}: use {{{{ {NAMES[name]} }}}}"
