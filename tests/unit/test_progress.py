"""``submit.wait=true``'s live progress: follows a real (local) job process until it ends, then
prints the run's summary table, the one ``python -m slurmkit.supervise`` prints."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

from rich.console import Console

from slurmkit.progress import follow_progress
from tests.unit.watch_runs import FakeRun

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

JOB = """
import sys
from tests.unit.watch_runs import FakeRun
run = FakeRun(sys.argv[1], steps=8)
run.allocation(job_id=sys.argv[2])
run.start_generation()
for s in range(1, 9):
    run.step(s, 3.0 - s * 0.25)
    if s == 4:
        run.checkpoint(4)
run.finish(8)
"""


def test_progress_follows_a_local_job_to_its_summary(tmp_path: Path) -> None:
    run_dir = str(tmp_path / "r")
    FakeRun(run_dir, steps=8)  # the frozen config (8 steps) as submit writes it
    proc = subprocess.Popen([sys.executable, "-c", JOB, run_dir, "0"], cwd=REPO,
                            stdin=subprocess.DEVNULL)
    FakeRun(run_dir, steps=8).submitted(job_id=str(proc.pid), executor="local")
    console = Console(file=io.StringIO(), width=160)
    try:
        left = follow_progress(run_dir, str(proc.pid), "local", {}, console, 0, poll_s=0.02,
                               max_poll_s=0.05)
    finally:
        assert proc.wait() == 0
    out = console.file.getvalue()  # type: ignore[attr-defined]
    assert left == 0
    assert "8/8" in out and "loss 1.0000" in out  # the bar's last state: all steps, last loss
    assert "goodput" in out and "completed" in out and "final step" in out  # the summary table


def test_a_local_job_whose_processes_are_gone_reads_ended_not_gone() -> None:
    from slurmkit.jobstates import GONE
    from slurmkit.progress import _description

    assert _description("completed", GONE) == "ended / completed"
    assert _description("training", "RUNNING") == "running / training"
