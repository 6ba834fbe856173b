"""The wheel holds only what users run (issue 35): the test tooling (the fake Slurm, the chaos
campaign, the S3 server, the local cluster's Slurm build, state and node loss) is the repository's
top-level ``testkit/``, which setup.py leaves out. Two checks: the package list setup.py hands to
setuptools, and a wheel really built from a copy of the sources (a few seconds)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
TESTKIT = REPO / "testkit"
# What a build reads: setup.py's package_dir maps conf/ and sbatch_templates/ into the package;
# testkit/ is copied too, so that the wheel is seen to leave it out even when it is there.
SOURCES = ["setup.py", "pyproject.toml", "README.md", "slurmkit", "conf", "sbatch_templates",
           "testkit"]


def _tooling_names() -> set[str]:
    """The modules and packages at testkit/'s top (fakeslurm, chaos, s3server, slurm_build, ...):
    no part of a shipped path may be named like one."""
    names = {"testing", "testkit"}
    names.update(p.parent.name for p in TESTKIT.glob("*/__init__.py"))
    names.update(p.stem for p in TESTKIT.glob("*.py") if p.stem != "__init__")
    return names


def _setup_kwargs(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Run setup.py with setuptools.setup replaced by a recorder: what it would package."""
    import setuptools

    seen: dict[str, Any] = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kw: seen.update(kw))
    monkeypatch.chdir(REPO)  # find_packages() looks in the current directory, as a build does
    code = compile((REPO / "setup.py").read_text(), str(REPO / "setup.py"), "exec")
    exec(code, {"__name__": "__main__", "__file__": str(REPO / "setup.py")})
    return seen


def test_the_test_tooling_lives_outside_the_package() -> None:
    assert (TESTKIT / "fakeslurm" / "__init__.py").is_file()
    assert (TESTKIT / "chaos" / "__init__.py").is_file()
    assert list((REPO / "slurmkit" / "testing").glob("**/*.py")) == []


def test_setup_packages_slurmkit_only_and_no_test_tooling(monkeypatch: pytest.MonkeyPatch) -> None:
    packages = _setup_kwargs(monkeypatch)["packages"]
    assert "slurmkit" in packages and "slurmkit.slurm" in packages
    assert [p for p in packages if p != "slurmkit" and not p.startswith("slurmkit.")] == []
    tooling = _tooling_names()
    assert [p for p in packages if set(p.split(".")) & tooling] == []


def test_a_built_wheel_holds_no_test_tooling(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for name in SOURCES:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(path, src / name)
    out = tmp_path / "wheel"
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PYTHONWARNINGS": "ignore"}
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                          "--no-build-isolation", "--no-index", "-w", str(out), str(src)],
                         capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    [wheel] = list(out.glob("slurmkit-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "slurmkit/slurm/client.py" in names and "slurmkit/topology/fake/__init__.py" in names
    assert {n.split("/")[0] for n in names} == {"slurmkit", wheel.name.split("-py")[0] + ".dist-info"}
    tooling = _tooling_names()
    shipped = [n for n in names if {Path(part).stem for part in n.split("/")} & tooling]
    assert shipped == []
