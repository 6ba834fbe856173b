"""The `slurmkit VERB` dispatcher: the same module, argv and exit code as `python -m slurmkit.VERB`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import slurmkit
from slurmkit import cli

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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
    monkeypatch.setitem(cli.VERBS, "echoverb", "test verb")
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
    for verb in ("nosuchverb", "pkgverb"):
        monkeypatch.setitem(cli.VERBS, verb, "not written yet")
        assert cli.main([verb, "arg"]) == 2
        err = capsys.readouterr().err
        assert f"no module slurmkit.{verb}" in err and "Traceback" not in err, err


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
