"""``slurmkit status`` shows the newest failure with the failing rank's own line; the line comes
from the ledger, so it is shown escaped, never acted on by the terminal or read as markup."""

from __future__ import annotations

import io
from pathlib import Path

from rich.console import Console

from slurmkit.cli import status
from tests.unit.watch_runs import FakeRun, run_with_one_crash


def _status(run_dir: str) -> str:
    c = Console(file=io.StringIO(), width=400, force_terminal=False)
    assert status.main([run_dir], env={"PATH": ""}, console=c) == 0
    return c.file.getvalue()  # type: ignore[attr-defined]


def _crashed(tmp_path: Path, line: str) -> FakeRun:
    run = FakeRun(str(tmp_path / "r"))
    run.submitted()
    run.allocation()
    run.start_generation()
    run.agent.append("failure", generation=0, cls="user_error", rank=3, node="node2", evidence="returncode 2",
                     time_of_fault=run.clock(), ranks_affected=[3], slurm_view=[], line=line)
    return run


def test_the_newest_failure_and_its_line(tmp_path: Path) -> None:
    said = "python: can't open file '/x/train.py': [Errno 2] No such file or directory"
    out = _status(_crashed(tmp_path, said).run_dir)
    assert f"user_error, rank 3 on node2 (returncode 2): {said}" in out


def test_a_run_without_a_line_or_a_failure(tmp_path: Path) -> None:
    out = _status(run_with_one_crash(str(tmp_path / "a")).run_dir)
    assert "rank_crash, rank 1 on node1 (exit code 1)" in out
    run = FakeRun(str(tmp_path / "b"))
    run.submitted()
    assert "last failure" in (out := _status(run.run_dir)) and "none" in out


def test_hostile_lines_are_escaped_and_bounded(tmp_path: Path) -> None:
    line = "\x1b[2J\x1b]0;owned\x07[red]ValueError[/red]\r\u202e" + "x" * 100_000
    out = _status(_crashed(tmp_path, line).run_dir)
    assert "\x1b" not in out and "\x07" not in out and "\r" not in out and "\u202e" not in out
    assert "\\x1b[2J\\x1b]0;owned\\x07[red]ValueError[/red]\\x0d\\u202e" in out
    row = next(r for r in out.splitlines() if "last failure" in r)
    assert len(row) < 400 and row.rstrip(" │").endswith("...")
