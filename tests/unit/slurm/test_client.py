"""SlurmClient on FakeSlurm: every method, retries, waiting with an injected clock."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurmkit.errors import SubmissionError
from slurmkit.slurm import (
    RetryPolicy,
    SlurmClient,
    SlurmCommandError,
    SlurmJobStateError,
    SlurmWaitTimeout,
)
from testkit.fakeslurm import FakeSlurm

SCRIPT = """#!/bin/bash
#SBATCH --job-name=unit
#SBATCH --nodes=2
#SBATCH --requeue
srun hostname
"""


class FakeTime:
    """A clock that only moves when slept on; records the sleeps."""

    def __init__(self) -> None:
        self.now = 1_000.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "job.sh"
    path.write_text(SCRIPT)
    return str(path)


@pytest.fixture
def fake() -> FakeSlurm:
    return FakeSlurm({"debug": "node[1-4]", "gpu": "gpu[001-002]"})


def make_client(fake: FakeSlurm, t: FakeTime | None = None) -> SlurmClient:
    t = t or FakeTime()
    return SlurmClient(fake, retry=RetryPolicy(sleep=t.sleep), clock=t.clock, sleep=t.sleep)


def test_submit_returns_id_and_passes_args_and_env(fake: FakeSlurm, script: str) -> None:
    client = make_client(fake)
    job_id = client.submit(script, extra_args=["-p", "gpu", "--job-name=override"],
                           env={"SLURMKIT_RUN": "r1"})
    assert job_id == "1"
    assert fake.calls[-1] == ["sbatch", "--parsable", "-p", "gpu", "--job-name=override", script]
    assert fake.envs[-1] == {"SLURMKIT_RUN": "r1"}
    job = client.job(job_id)
    assert (job.name, job.partition, job.num_nodes, job.requeue) == ("override", "gpu", 2, True)


def test_submit_with_cluster_suffix(script: str) -> None:
    fake = FakeSlurm(cluster_name="hpc1")
    assert make_client(fake).submit(script) == "1"


def test_submit_unknown_partition_is_not_retried(fake: FakeSlurm, script: str) -> None:
    with pytest.raises(SubmissionError) as info:
        make_client(fake).submit(script, extra_args=["--partition=nope"])
    assert "Invalid partition name specified" in str(info.value)
    assert isinstance(info.value.__cause__, SlurmCommandError)
    assert len(fake.calls) == 1


def test_submit_not_delivered_is_retried_but_ambiguous_is_not(fake: FakeSlurm, script: str) -> None:
    client = make_client(fake)
    fake.fail_next(2, "sbatch: error: Batch job submission failed: Unable to contact slurm "
                      "controller (connect failure)")
    assert client.submit(script) == "1"
    assert len(fake.calls) == 3
    fake.fail_next(1, "sbatch: error: Socket timed out on send/recv operation")
    with pytest.raises(SubmissionError, match="may still have been queued"):
        client.submit(script)
    assert len(fake.calls) == 4


def test_queries_retry_transient_errors(fake: FakeSlurm, script: str) -> None:
    t = FakeTime()
    client = make_client(fake, t)
    job_id = client.submit(script)
    fake.fail_next(2)
    assert client.job(job_id).state == "PENDING"
    assert len(t.sleeps) == 2


def test_job_sacct_squeue(fake: FakeSlurm, script: str) -> None:
    client = make_client(fake)
    first, second = client.submit(script), client.submit(script)
    fake.start(first)
    rows = {r.job_id: r for r in client.squeue()}
    assert rows[first].state == "RUNNING" and rows[first].node_list == "node[1-2]"
    assert rows[second].state == "PENDING" and rows[second].reason is None
    assert [r.job_id for r in client.squeue(job_ids=[second])] == [second]
    assert client.squeue(job_ids=[]) == []
    assert client.squeue(job_ids=["999"]) == []  # "Invalid job id" means: not queued
    assert client.squeue(user="root")
    fake.finish(first, "FAILED", exit_code=3)
    main, batch, step = client.sacct(first)
    assert (main.state, main.exit_code, main.nodes) == ("FAILED", 3, ["node1", "node2"])
    assert (batch.step, step.step) == ("batch", "0")
    assert client.job(first).exit_code == 3


def test_cancel_and_signal(fake: FakeSlurm, script: str) -> None:
    client = make_client(fake)
    job_id = client.submit(script)
    fake.start(job_id)
    client.cancel(job_id, signal="USR1")
    assert fake.calls[-1] == ["scancel", "--signal=USR1", job_id]
    assert fake.jobs[job_id].signals == ["USR1"] and client.job(job_id).state == "RUNNING"
    client.cancel(job_id)
    assert client.job(job_id).state == "CANCELLED"
    assert client.sacct(job_id)[0].by_uid == 0


def test_requeue_then_release_now(fake: FakeSlurm, script: str) -> None:
    t = FakeTime()
    fake.clock = lambda: 1_700_000_000.0 + t.now
    client = make_client(fake, t)
    job_id = client.submit(script)
    fake.start(job_id)
    client.requeue(job_id)
    job = client.job(job_id)
    assert (job.state, job.reason, job.restart_cnt) == ("PENDING", "BeginTime", 1)
    assert job.eligible_time is not None and job.submit_time is not None
    t.now += 5
    client.release_now(job_id)
    released = client.job(job_id)
    assert released.eligible_time is not None and released.eligible_time < job.eligible_time
    assert fake.calls[-2] == ["scontrol", "update", f"jobid={job_id}", "StartTime=now"]
    dup = [r.state for r in client.sacct(job_id, duplicates=True) if not r.is_step]
    assert dup == ["REQUEUED", "PENDING"]


def test_requeue_hold_and_release(fake: FakeSlurm, script: str) -> None:
    client = make_client(fake)
    job_id = client.submit(script)
    fake.start(job_id)
    client.requeue(job_id, hold=True)
    assert fake.calls[-1] == ["scontrol", "requeuehold", job_id]
    assert client.job(job_id).held
    client.release(job_id)
    assert not client.job(job_id).held


def test_requeue_refused_for_pending_job_without_retry(fake: FakeSlurm, script: str) -> None:
    client = make_client(fake)
    job_id = client.submit(script)
    with pytest.raises(SlurmCommandError, match="presently disabled"):
        client.requeue(job_id)
    assert len(fake.calls) == 2


def test_update_exclude_merges(fake: FakeSlurm, script: str) -> None:
    client = make_client(fake)
    job_id = client.submit(script, extra_args=["--exclude=node4"])
    assert client.update_exclude(job_id, ["node2", "node[3-4]"]) == ["node2", "node3", "node4"]
    assert fake.calls[-1] == ["scontrol", "update", f"jobid={job_id}", "ExcNodeList=node[2-4]"]
    assert client.job(job_id).excluded_nodes == ["node2", "node3", "node4"]
    calls = len(fake.calls)
    assert client.update_exclude(job_id, ["node3"]) == ["node2", "node3", "node4"]
    assert len(fake.calls) == calls + 1  # nothing new: only the read, no update


def test_update_exclude_of_running_job_fails(fake: FakeSlurm, script: str) -> None:
    client = make_client(fake)
    job_id = client.submit(script)
    fake.start(job_id)
    with pytest.raises(SlurmCommandError, match="no longer pending"):
        client.update_exclude(job_id, ["node3"])


def test_nodes_partitions_config(fake: FakeSlurm) -> None:
    client = make_client(fake)
    fake.fail_node("node2")
    nodes = {n.name: n for n in client.nodes()}
    assert len(nodes) == 6 and nodes["node1"].gpus == 4
    assert (nodes["node2"].state, nodes["node2"].flags, nodes["node2"].usable) == (
        "DOWN", ("NOT_RESPONDING",), False)
    parts = {p.name: p for p in client.partitions()}
    assert parts["gpu"].node_names == ["gpu001", "gpu002"] and parts["debug"].default
    assert client.config()["KillWait"] == "30 sec"


def test_controller_reachable_tries_once(fake: FakeSlurm) -> None:
    client = make_client(fake)
    assert client.controller_reachable()
    fake.controller_up = False
    assert not client.controller_reachable()
    fake.controller_up = True
    fake.fail_next(3)
    assert not client.controller_reachable()
    assert len(fake.calls) == 3


def test_wait_for_state_polls_until_reached(fake: FakeSlurm, script: str) -> None:
    t = FakeTime()
    client = make_client(fake, t)
    job_id = client.submit(script)
    steps = iter([lambda: fake.start(job_id), lambda: fake.finish(job_id)])

    def sleep(seconds: float) -> None:
        t.sleep(seconds)
        next(steps)()

    assert client.wait_for_state(job_id, {"RUNNING"}, 60, sleep=sleep) == "RUNNING"
    assert client.wait_for_state(job_id, ["COMPLETED"], 60, poll_s=5, sleep=sleep) == "COMPLETED"
    assert t.sleeps == [1.0, 5.0]


def test_wait_for_state_times_out_on_clock(fake: FakeSlurm, script: str) -> None:
    t = FakeTime()
    client = make_client(fake, t)
    job_id = client.submit(script)
    with pytest.raises(SlurmWaitTimeout, match="still PENDING"):
        client.wait_for_state(job_id, {"RUNNING"}, timeout_s=10, poll_s=2)
    assert sum(t.sleeps) == 10


def test_wait_for_state_stops_at_other_terminal_state(fake: FakeSlurm, script: str) -> None:
    client = make_client(fake)
    job_id = client.submit(script)
    fake.start(job_id)
    fake.finish(job_id, "OUT_OF_MEMORY", exit_signal=125)
    with pytest.raises(SlurmJobStateError, match="OUT_OF_MEMORY"):
        client.wait_for_state(job_id, {"COMPLETED"}, 60)


def test_state_falls_back_to_sacct_once_controller_forgot(fake: FakeSlurm, script: str) -> None:
    client = make_client(fake)
    job_id = client.submit(script)
    fake.start(job_id)
    fake.finish(job_id, "TIMEOUT")
    fake.forget(job_id)
    with pytest.raises(SlurmCommandError, match="Invalid job id"):
        client.job(job_id)
    assert client.job_state(job_id) == "TIMEOUT"
    assert client.wait_for_state(job_id, {"TIMEOUT"}, 1) == "TIMEOUT"
    with pytest.raises(SlurmJobStateError):
        client.job_state("999")


def test_wait_for_state_backs_off_to_max_poll(fake: FakeSlurm, script: str) -> None:
    t = FakeTime()
    client = make_client(fake, t)
    job_id = client.submit(script)

    def sleep(seconds: float) -> None:
        t.sleep(seconds)
        if len(t.sleeps) == 8:
            fake.start(job_id)

    assert client.wait_for_state(job_id, {"RUNNING"}, 600, poll_s=1, max_poll_s=30,
                                 sleep=sleep) == "RUNNING"
    assert t.sleeps == [1, 2, 4, 8, 16, 30, 30, 30]


def test_wait_for_state_backoff_stops_at_the_deadline(fake: FakeSlurm, script: str) -> None:
    t = FakeTime()
    client = make_client(fake, t)
    job_id = client.submit(script)
    with pytest.raises(SlurmWaitTimeout, match="still PENDING after 20 s"):
        client.wait_for_state(job_id, {"RUNNING"}, 20, poll_s=1, max_poll_s=30)
    assert t.sleeps == [1, 2, 4, 8, 5]  # the last wait cut short at the deadline, not 16 s


def test_wait_for_state_without_max_poll_keeps_a_fixed_interval(fake: FakeSlurm, script: str) -> None:
    t = FakeTime()
    client = make_client(fake, t)
    job_id = client.submit(script)
    with pytest.raises(SlurmWaitTimeout):
        client.wait_for_state(job_id, {"RUNNING"}, 6, poll_s=1.5)
    assert t.sleeps == [1.5] * 4


@pytest.mark.parametrize("poll_s,max_poll_s", [(0, None), (-1, 5), (10, 5)])
def test_wait_for_state_refuses_nonsense_intervals(fake: FakeSlurm, script: str, poll_s: float,
                                                   max_poll_s: float | None) -> None:
    client = make_client(fake)
    job_id = client.submit(script)
    with pytest.raises(ValueError, match="Detected: poll_s="):
        client.wait_for_state(job_id, {"RUNNING"}, 6, poll_s=poll_s, max_poll_s=max_poll_s)


def test_one_factory_builds_every_client_of_the_real_slurm_cli() -> None:
    """Outside slurmkit/slurm/ no module builds its own runner of the real CLI: the timeout and
    retry policy of every Slurm call come from slurm_client (one source for the fact)."""
    import pathlib

    from slurmkit.slurm.client import COMMAND_TIMEOUT_S, INTERACTIVE_TIMEOUT_S, slurm_client

    root = pathlib.Path(__file__).resolve().parents[3] / "slurmkit"
    builders = [str(p.relative_to(root)) for p in root.rglob("*.py")
                if p.parent.name not in ("slurm", "fakeslurm") and "SubprocessRunner(" in p.read_text()]
    assert builders == [], builders
    assert slurm_client({}).timeout_s == COMMAND_TIMEOUT_S
    assert slurm_client({}, interactive=True).timeout_s == INTERACTIVE_TIMEOUT_S < COMMAND_TIMEOUT_S
    assert slurm_client({}, timeout_s=3.0).timeout_s == 3.0
