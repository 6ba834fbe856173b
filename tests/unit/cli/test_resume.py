"""``slurmkit resume`` refuses what it must not resume, saying what to do instead; a run that
stopped is resumed (tests/integration/test_watch_cli.py: cancel --checkpoint, then resume)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from slurmkit.cli import resume
from slurmkit.errors import ConfigError
from slurmkit.jobstates import JobPoller
from tests.unit.watch_runs import FakeRun


def _poller(alive: bool) -> JobPoller:
    return JobPoller(None, pid_alive=lambda pid: alive)


def _run(tmp_path: Path, end: str | None) -> FakeRun:
    run = FakeRun(str(tmp_path / "r"))
    run.submitted(job_id="4321", executor="local")
    run.allocation(job_id="4321")
    if end:
        run.agent.append("end", status=end, exit_code=0)
    return run


def test_a_stopped_run_is_resumable(tmp_path: Path) -> None:
    assert resume.check_resumable(_run(tmp_path, "cancelled").run_dir, _poller(False)) == "4321"


def test_a_run_whose_job_still_runs_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as exc:
        resume.check_resumable(_run(tmp_path, None).run_dir, _poller(True))
    assert "RUNNING" in str(exc.value) and "slurmkit cancel --checkpoint" in str(exc.value)


def test_a_completed_run_is_refused(tmp_path: Path) -> None:
    run = _run(tmp_path, None)
    run.finish(60)
    with pytest.raises(ConfigError) as exc:
        resume.check_resumable(run.run_dir, _poller(False))
    assert "completed" in str(exc.value) and "train.steps" in str(exc.value)


def test_no_run_directory(tmp_path: Path, capsys) -> None:
    assert resume.main([str(tmp_path)], env={"PATH": ""}) == 2
    assert "no run directory" in capsys.readouterr().err
