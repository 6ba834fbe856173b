"""The unit tests' tree mirrors the packages, so a change and its tests sit side by side.

``tests/unit/<package>/`` holds the tests of ``slurmkit/<package>/`` (a deeper folder mirrors a
deeper package), ``tests/unit/testkit/`` those of ``testkit/`` (``tests/unit/testkit/chaos/`` for
``testkit/chaos/``), and the top of ``tests/unit/`` those of slurmkit's top-level modules and of
the package as a whole (the import contract, the wheel's contents). The one folder that names no
package is ``tests/unit/hostile/``: the untrusted-input suites, whose rows (docs/security.md)
cross packages. docs/layers.md ("Where the tests are") says the same to the reader.

Read from the file system, nothing imported. A failure names each misplaced file or folder and
where it belongs: a folder that mirrors no package, a folder without ``__init__.py`` (the suite
imports ``tests.unit.<package>.test_<module>``; without it two folders' ``test_cli.py`` would
collide), a test of a package left at the top under its old flat name (``test_store_tier.py``),
or one that kept its package's prefix inside the package's folder (``store/test_store_tier.py``).
"""

from __future__ import annotations

from pathlib import Path

UNIT = Path(__file__).resolve().parent  # tests/unit
REPO = UNIT.parents[1]
# The one folder of tests/unit that mirrors no package: suites of untrusted input across packages.
HOSTILE = "hostile"


def _is_package(path: Path) -> bool:
    return (path / "__init__.py").is_file()


def _subpackages(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if p.is_dir() and _is_package(p))


def _folders(unit: Path) -> list[tuple[str, ...]]:
    """Each folder of ``unit`` (itself included) that holds a Python file, as path parts."""
    found = set()
    for path in unit.rglob("*.py"):
        parts = path.parent.relative_to(unit).parts
        if not any(p == "__pycache__" or p.startswith(".") for p in parts):
            found.add(parts)
    return sorted(found)


def mirrors(parts: tuple[str, ...], repo: Path) -> bool:
    """Whether the unit-test folder ``tests/unit/<parts>`` stands for a package (or is hostile/)."""
    if not parts or parts == (HOSTILE,):
        return True
    if parts[0] == "testkit":
        return _is_package(repo.joinpath(*parts))
    return _is_package(repo.joinpath("slurmkit", *parts))


def _home(stem: str, repo: Path) -> tuple[str, str] | None:
    """For a top-level test whose name starts with a package's (or a testkit module's) name: that
    source and the path in tests/unit/ the test belongs at."""
    name = stem[len("test_"):]
    testkit = repo / "testkit"
    sources = {p: (f"slurmkit/{p}/", f"{p}/") for p in _subpackages(repo / "slurmkit")}
    sources.update({p: (f"testkit/{p}/", f"testkit/{p}/") for p in _subpackages(testkit)})
    modules = {p.stem for p in testkit.glob("*.py") if p.stem != "__init__"}
    for prefix in sorted([*sources, *modules], key=len, reverse=True):
        if name != prefix and not name.startswith(prefix + "_"):
            continue
        if prefix in modules:  # tests/unit/testkit/ mirrors testkit/ whose module names it keeps
            return f"testkit/{prefix}.py", f"testkit/{stem}.py"
        source, folder = sources[prefix]
        rest = name[len(prefix) + 1:]
        return source, folder + (f"test_{rest}.py" if rest else "test_<module>.py")
    return None


def misplaced(unit: Path, repo: Path) -> list[str]:
    """Every way the tree under ``unit`` leaves the mirror of slurmkit/ and testkit/."""
    problems = []
    for parts in _folders(unit):
        where = "/".join(("tests/unit", *parts)) + "/"
        if not mirrors(parts, repo):
            target = "/".join(parts if parts[0] == "testkit" else ("slurmkit", *parts)) + "/"
            problems.append(f"{where} names no package ({target} is none): move its files into the "
                            f"folder of the package they test (one of "
                            f"{', '.join(_subpackages(repo / 'slurmkit'))}, testkit, {HOSTILE})")
        if parts and not _is_package(unit.joinpath(*parts)):
            problems.append(f"{where} has no __init__.py (the suite imports its tests as "
                            f"tests.unit.{'.'.join(parts)}.<module>)")
    for path in sorted(unit.rglob("test_*.py")):
        parts = path.parent.relative_to(unit).parts
        if any(p == "__pycache__" or p.startswith(".") for p in parts):
            continue
        if not parts:
            home = _home(path.stem, repo)
            if home is not None:
                problems.append(f"tests/unit/{path.name} is named for {home[0]}: move it to "
                                f"tests/unit/{home[1]}")
        elif parts[-1] != HOSTILE and path.stem.startswith(f"test_{parts[-1]}_"):
            short = "test_" + path.stem[len(f"test_{parts[-1]}_"):] + ".py"
            problems.append(f"tests/unit/{'/'.join(parts)}/{path.name} repeats its folder's name: "
                            f"call it {short}")
    return problems


def test_every_unit_test_sits_in_the_folder_of_the_package_it_tests() -> None:
    problems = misplaced(UNIT, REPO)
    assert not problems, ("the unit tests' tree no longer mirrors the packages (docs/layers.md, "
                          "'Where the tests are'):\n" + "\n".join(problems))


def _touch(root: Path, *paths: str) -> None:
    for rel in paths:
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")


def test_the_check_names_each_way_out_of_the_mirror(tmp_path: Path) -> None:
    """The rule itself on a small repository: a mirrored tree passes, and each misplacement fails
    with its path (the check must not pass everything because it reads nothing)."""
    _touch(tmp_path, "slurmkit/__init__.py", "slurmkit/store/__init__.py", "slurmkit/atomic.py",
           "slurmkit/supervise/__init__.py", "slurmkit/supervise/exits/__init__.py",
           "testkit/__init__.py", "testkit/chaos/__init__.py", "testkit/s3server.py")
    unit = tmp_path / "tests" / "unit"
    good = ["__init__.py", "test_atomic.py", "watch_runs.py", "store/__init__.py", "store/test_tier.py",
            "store/tier_suite.py", "supervise/__init__.py", "supervise/exits/__init__.py",
            "supervise/exits/test_requeue.py", "testkit/__init__.py", "testkit/test_s3server.py",
            "testkit/chaos/__init__.py", "testkit/chaos/test_plan.py", "hostile/__init__.py",
            "hostile/test_tiers.py"]
    _touch(unit, *good)
    assert misplaced(unit, tmp_path) == []

    _touch(unit, "stores/__init__.py", "stores/test_tier.py", "testkit/fake/__init__.py",
           "testkit/fake/test_jobs.py", "store/deep/test_x.py", "test_store_manifest.py",
           "test_chaos_plan.py", "test_s3server.py", "store/test_store_promote.py", "test_store.py")
    got = "\n".join(misplaced(unit, tmp_path))
    for fragment in ("tests/unit/stores/ names no package", "tests/unit/testkit/fake/ names no package",
                     "tests/unit/store/deep/ names no package",
                     "tests/unit/store/deep/ has no __init__.py",
                     "tests/unit/test_store_manifest.py is named for slurmkit/store/: move it to "
                     "tests/unit/store/test_manifest.py",
                     "tests/unit/test_chaos_plan.py is named for testkit/chaos/: move it to "
                     "tests/unit/testkit/chaos/test_plan.py",
                     "tests/unit/test_s3server.py is named for testkit/s3server.py: move it to "
                     "tests/unit/testkit/test_s3server.py",
                     "tests/unit/store/test_store_promote.py repeats its folder's name: call it "
                     "test_promote.py",
                     "tests/unit/test_store.py is named for slurmkit/store/: move it to "
                     "tests/unit/store/test_<module>.py"):
        assert fragment in got, (fragment, got)
    # Each line starts with what is misplaced: the bad ones, each once (a folder twice: no package,
    # no __init__.py), and none of the good files or folders.
    subjects = [line.split(" ")[0] for line in misplaced(unit, tmp_path)]
    assert sorted(subjects) == sorted([
        "tests/unit/stores/", "tests/unit/testkit/fake/", "tests/unit/store/deep/",
        "tests/unit/store/deep/", "tests/unit/test_store_manifest.py", "tests/unit/test_chaos_plan.py",
        "tests/unit/test_s3server.py", "tests/unit/store/test_store_promote.py",
        "tests/unit/test_store.py"]), got
