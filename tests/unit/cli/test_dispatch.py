"""The `slurmkit VERB` dispatcher: the same module, argv and exit code as `python -m slurmkit.VERB`."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import runpy
import subprocess
import sys

import pytest

import slurmkit
from slurmkit import cli

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


def _py(*args: str, cwd: str = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=300)


@pytest.fixture
def verb_dir(tmp_path, monkeypatch):
    """Extra verb modules in a directory appended to the slurmkit package's path."""
    monkeypatch.setattr(slurmkit, "__path__", [*slurmkit.__path__, str(tmp_path)])
    return tmp_path


def test_help_lists_every_verb_on_one_line() -> None:
    res = _py("-m", "slurmkit", "--help")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    for verb in ("submit", "status", "runs", "logs", "cancel", "report", "plan", "topo", "store",
                 "supervise"):
        assert sum(1 for ln in lines if ln.split()[:1] == [verb]) == 1, (verb, res.stdout)


def test_no_verb_prints_usage_and_fails() -> None:
    res = _py("-m", "slurmkit")
    assert res.returncode == 2 and "usage: slurmkit VERB" in res.stderr


def test_verb_runs_as_main_with_verb_and_args_as_argv(verb_dir, monkeypatch, capsys) -> None:
    (verb_dir / "echoverb.py").write_text(
        "import json, sys\n"
        "if __name__ == '__main__':\n"
        "    print(json.dumps({'argv': sys.argv, 'name': __name__}))\n"
        "    sys.exit(7)\n")
    monkeypatch.setitem(cli.VERBS, "echoverb", ("slurmkit.echoverb", "test verb"))
    monkeypatch.setattr(sys, "argv", ["slurmkit", "echoverb", "x=[1,2]", "--flag"])
    with pytest.raises(SystemExit) as exc:
        cli.main()
    assert exc.value.code == 7
    seen = json.loads(capsys.readouterr().out)
    assert seen["name"] == "__main__" and seen["argv"][1:] == ["x=[1,2]", "--flag"]
    assert seen["argv"][0] == str(verb_dir / "echoverb.py")  # as `python -m` sets it


def test_a_verb_without_its_module_is_a_clear_error(verb_dir, monkeypatch, capsys) -> None:
    (verb_dir / "pkgverb").mkdir()
    (verb_dir / "pkgverb" / "__init__.py").write_text("")  # a package, but no __main__.py
    for verb, module in (("nosuchverb", "slurmkit.nosuchverb"), ("pkgverb", "slurmkit.pkgverb"),
                         ("nested", "slurmkit.nosuchpackage.nested")):
        monkeypatch.setitem(cli.VERBS, verb, (module, "not written yet"))
        assert cli.main([verb, "arg"]) == 2
        err = capsys.readouterr().err
        assert f"no module {module}" in err and "Traceback" not in err, err


def test_unknown_verb_names_the_verbs() -> None:
    res = _py("-m", "slurmkit", "sumbit", "+exp=tiny")
    assert res.returncode == 2 and "unknown verb 'sumbit'" in res.stderr and "submit" in res.stderr
    assert "Traceback" not in res.stderr


def test_same_output_and_exit_code_as_python_dash_m(tmp_path) -> None:
    # From a directory outside the checkout: the configs come with the package, not the cwd.
    args = ["+exp=tiny", "cluster=local"]
    direct = _py("-m", "slurmkit.plan", *args, cwd=str(tmp_path))
    via = _py("-m", "slurmkit", "plan", *args, cwd=str(tmp_path))
    assert direct.returncode == via.returncode == 0, (direct.stderr, via.stderr)
    assert via.stdout == direct.stdout and "fits" in via.stdout
    bad = _py("-m", "slurmkit", "plan", "+exp=tiny", "cluster=nowhere", cwd=str(tmp_path))
    assert bad.returncode == 2 and "cluster='nowhere'" in bad.stdout + bad.stderr


@pytest.mark.parametrize("args", [["--help"], ["runs", "--help"]])
def test_a_reader_that_went_away_is_a_quiet_exit(args) -> None:
    # `slurmkit runs | head`: the pipe's read end is closed before anything is written.
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        res = subprocess.run([sys.executable, "-m", "slurmkit", *args], cwd=REPO, stdout=write_end,
                             stderr=subprocess.PIPE, text=True, timeout=300)
    finally:
        os.close(write_end)
    assert "Traceback" not in res.stderr and "BrokenPipe" not in res.stderr, res.stderr
    assert res.returncode in (0, 141)  # argparse's help drops a failed write itself


def _help(run, capsys) -> str:
    """What ``run()`` prints for a verb's --help; it must exit 0 (argparse's help does)."""
    with pytest.raises(SystemExit) as exc:
        run()
    out = capsys.readouterr().out
    assert exc.value.code in (0, None), (exc.value.code, out)
    assert out.strip(), "no help printed"
    return out


# runpy runs a verb's module as __main__ beside the copy other tests imported, and warns so
@pytest.mark.filterwarnings("ignore:.*found in sys.modules after import of package:RuntimeWarning")
@pytest.mark.parametrize("verb", list(cli.VERBS))
def test_every_verb_has_its_module_and_its_python_dash_m_spelling(verb, monkeypatch, capsys) -> None:
    """The table and the `python -m slurmkit.VERB` modules cannot drift: each verb's module runs
    (`slurmkit VERB --help`, in this process), and `python -m slurmkit.VERB` runs the same one."""
    module = cli.VERBS[verb][0]
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    via_table = _help(lambda: cli.main([verb, "--help"]), capsys)

    spelling = f"slurmkit.{verb}"
    assert importlib.util.find_spec(spelling) is not None, f"python -m {spelling}: no such module"
    if module == spelling:  # a package of its own: python -m runs its __main__
        assert importlib.util.find_spec(f"{spelling}.__main__") is not None
    else:  # a module at the root that runs the verb's module and holds nothing else
        spec = importlib.util.find_spec(spelling)
        assert spec is not None and spec.origin is not None
        with open(spec.origin, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert imported == {module}, f"{spec.origin} must run {module}, it imports {imported}"
        defined = [node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Assign))]
        assert not defined, f"{spec.origin} is only the python -m spelling of {module}"
    monkeypatch.setattr(sys, "argv", ["python", "--help"])
    via_dash_m = _help(lambda: runpy.run_module(spelling, run_name="__main__", alter_sys=True), capsys)
    assert via_dash_m == via_table


def test_every_verb_module_is_in_the_table() -> None:
    """A module of slurmkit/cli/ that runs as __main__ is a verb: it is in VERBS."""
    here = os.path.dirname(cli.__file__)
    runnable = set()
    for name in sorted(os.listdir(here)):
        if name.endswith(".py") and name != "__init__.py":
            with open(os.path.join(here, name), encoding="utf-8") as f:
                if 'if __name__ == "__main__":' in f.read():
                    runnable.add(f"slurmkit.cli.{name[:-3]}")
    assert runnable and runnable <= {module for module, _ in cli.VERBS.values()}, runnable
