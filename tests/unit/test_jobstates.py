"""Job states for the watch verbs: one batched squeue per poll, sacct once for a job that left
the queue, nothing at all for jobs known to be over; local jobs from the process table."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from slurmkit.jobstates import GONE, JobPoller, JobRef
from slurmkit.slurm.client import SlurmClient
from slurmkit.slurm.retry import RetryPolicy
from testkit.fakeslurm import FakeSlurm


def _submit(fake: FakeSlurm, tmp: Path, name: str) -> str:
    path = tmp / f"{name}.sh"
    path.write_text(f"#!/bin/bash\n#SBATCH -J {name}\n#SBATCH -N1\nsrun x\n")
    return fake.run(["sbatch", "--parsable", str(path)]).stdout.strip()


def _programs(fake: FakeSlurm, since: int) -> list[str]:
    return [c[0] for c in fake.calls[since:]]


def test_one_batched_query_per_poll_and_none_for_finished_jobs(tmp_path: Path) -> None:
    fake = FakeSlurm()
    ids = [_submit(fake, tmp_path, f"j{i}") for i in range(3)]
    fake.start(ids[0])
    fake.start(ids[1])
    client = SlurmClient(fake, retry=RetryPolicy(sleep=lambda s: None))
    poller = JobPoller(client)
    refs = [JobRef(i, "slurm") for i in ids]
    n = len(fake.calls)
    states = poller.poll(refs)
    assert [states[r].state for r in refs] == ["RUNNING", "RUNNING", "PENDING"]
    assert _programs(fake, n) == ["squeue"]  # one call for all three
    fake.finish(ids[0])
    fake.forget(ids[0])  # slurmctld purged it: only accounting knows it now
    n = len(fake.calls)
    states = poller.poll(refs)
    assert states[refs[0]].state == "COMPLETED" and states[refs[0]].over
    assert _programs(fake, n) == ["squeue", "sacct"]
    n = len(fake.calls)
    poller.poll(refs)
    assert _programs(fake, n) == ["squeue"]  # the finished job is not asked again
    assert "-j" in fake.calls[-1] and ids[0] not in fake.calls[-1][-1].split(",")
    for i in ids[1:]:
        if fake.jobs[i].state == "PENDING":
            fake.start(i)
        fake.finish(i, "FAILED", exit_code=1)
        fake.forget(i)
    poller.poll(refs)
    n = len(fake.calls)
    assert all(s.over for s in poller.poll(refs).values())
    assert fake.calls[n:] == []  # everything is over: no Slurm query at all


def test_transient_controller_errors_are_retried(tmp_path: Path) -> None:
    fake = FakeSlurm()
    job = _submit(fake, tmp_path, "busy")
    fake.fail_next(2, command="squeue")
    waits: list[float] = []
    poller = JobPoller(SlurmClient(fake, retry=RetryPolicy(sleep=waits.append)))
    assert poller.poll([JobRef(job, "slurm")])[JobRef(job, "slurm")].state == "PENDING"
    assert len(waits) == 2


def test_unreachable_slurm_shows_unknown(tmp_path: Path) -> None:
    fake = FakeSlurm()
    job = _submit(fake, tmp_path, "x")
    fake.controller_up = False
    poller = JobPoller(SlurmClient(fake, retry=RetryPolicy(max_attempts=1)))
    state = poller.poll([JobRef(job, "slurm")])[JobRef(job, "slurm")]
    assert state.state == "UNKNOWN" and not state.over
    assert JobPoller(None).poll([JobRef(job, "slurm")])[JobRef(job, "slurm")].state == "UNKNOWN"


def test_local_jobs_from_the_process_table() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                            stdin=subprocess.PIPE)
    ref = JobRef(str(proc.pid), "local")
    poller = JobPoller(None)
    assert poller.poll([ref])[ref].state == "RUNNING"
    assert proc.stdin is not None
    proc.stdin.close()  # the process ends; it stays a zombie until reaped: that is over too
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped
    assert poller.poll([ref])[ref].state == GONE
    proc.wait()
    assert poller.poll([ref])[ref].state == GONE


def test_folded_pending_array_tasks_are_unfolded() -> None:
    from slurmkit.jobstates import _row_ids

    # squeue prints pending tasks of an array folded, with the throttle (%K) inside the brackets.
    assert _row_ids("10_[1-3,5]") == ["10_1", "10_2", "10_3", "10_5"]
    assert _row_ids("10_[1-3%2]") == ["10_1", "10_2", "10_3"]
    assert _row_ids("10_4") == ["10_4"] and _row_ids("10_[x") == ["10_[x"]
