"""The end-of-wait summary (``submit.wait=true``) says why the newest failure happened, in the
failing rank's own words, escaped: the ledger is untrusted."""

from __future__ import annotations

import io
from pathlib import Path

from rich.console import Console

from slurmkit.jobstates import JobPoller
from slurmkit.progress import follow_progress
from tests.unit.watch_runs import FakeRun


def _waited(run: FakeRun) -> str:
    console = Console(file=io.StringIO(), width=400, force_terminal=False)
    poller = JobPoller(None, pid_alive=lambda pid: False)  # the local job is over already
    follow_progress(run.run_dir, "12345", "local", {}, console, poller=poller, sleep=lambda s: None)
    return console.file.getvalue()  # type: ignore[attr-defined]


def _run(tmp_path: Path, line: str | None) -> FakeRun:
    run = FakeRun(str(tmp_path / "r"))
    run.submitted(job_id="12345", executor="local")
    run.allocation()
    run.start_generation()
    extra = {} if line is None else {"line": line}
    run.agent.append("failure", generation=0, cls="user_error", rank=1, node="node1", evidence="returncode 2",
                     time_of_fault=run.clock(), ranks_affected=[1], slurm_view=[], **extra)
    run.agent.append("end", status="stopped", exit_code=93, generation=0)
    return run


def test_the_summary_ends_with_the_failing_line(tmp_path: Path) -> None:
    said = "python: can't open file '/x/train.py': [Errno 2] No such file or directory"
    out = _waited(_run(tmp_path, said))
    assert "goodput" in out  # the summary table, then the line under it
    assert f"last failure: user_error, rank 1 on node1 (returncode 2): {said}" in out


def test_without_a_line_the_evidence_is_shown(tmp_path: Path) -> None:
    assert "last failure: user_error, rank 1 on node1 (returncode 2)\n" in _waited(_run(tmp_path, None))


def test_a_run_without_failures_shows_none(tmp_path: Path) -> None:
    run = FakeRun(str(tmp_path / "r"))
    run.submitted(job_id="12345", executor="local")
    run.finish(0)
    assert "last failure" not in _waited(run)


def test_hostile_lines_are_escaped_and_bounded(tmp_path: Path) -> None:
    out = _waited(_run(tmp_path, "\x1b[31m\x1b]8;;http://x\x07[link]KeyError\x9b\r" + "w" * 50_000))
    assert "\x1b" not in out and "\x07" not in out and "\x9b" not in out and "\r" not in out
    row = next(r for r in out.splitlines() if r.startswith("last failure"))
    assert "\\x1b[31m\\x1b]8;;http://x\\x07[link]KeyError\\x9b\\x0d" in row
    assert len(row) <= len("last failure: ") + 300 and row.endswith("...")
