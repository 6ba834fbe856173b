"""The run's status in the summary (the report's and `python -m slurmkit.supervise`'s): the last
`end`, unless `slurmkit resume` submitted the run again after it."""

from __future__ import annotations

from pathlib import Path

from slurmkit.ledger.ledger import read_ledger
from slurmkit.ledger.summary import summarize
from tests.unit.watch_runs import FakeRun


def test_a_resumed_run_is_running_again_until_its_next_end(tmp_path: Path) -> None:
    run = FakeRun(str(tmp_path / "r"))
    run.submitted()
    run.agent.append("end", status="stopped", exit_code=93, reason="crash loop")
    events = lambda: list(read_ledger(str(tmp_path / "r" / "ledger.jsonl")))  # noqa: E731
    assert summarize(events()).status == "stopped"
    run.clock.tick(5)
    run.submit.append("submitted", job_id="4243", executor="slurm", resumes="4242")
    assert summarize(events()).status == "running"
    run.clock.tick(5)
    run.agent.append("end", status="completed", exit_code=0)
    assert summarize(events()).status == "completed"
