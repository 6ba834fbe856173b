"""The supervisor's Slurm calls (node view, KillWait, requeue, release) go through the client it
is given: here a client on the fake controller, whose state and call log would not change if a
call built its own runner and went to the real CLI instead. Backoff on a busy controller comes
from slurmkit.slurm.retry, with a recorded sleep (no wall clock)."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

import slurmkit.slurm
from slurmkit.slurm.client import SlurmClient
from slurmkit.slurm.retry import RetryPolicy
from slurmkit.failures.classes import FailureClass
from slurmkit.supervise.exits.requeue import POLL_MAX_S, release_when_pending, requeue_now
from slurmkit.supervise.slurmview import DECISION_RETRY, kill_wait_warning, node_evidence
from testkit.fakeslurm import FakeSlurm

REPO = Path(__file__).resolve().parents[3]
IMPORTS_TESTING = re.compile(r"^\s*(from|import)\s+(slurmkit\.testing|testkit)\b", re.M)
SCRIPT = "#!/bin/bash\n#SBATCH --job-name=sup\n#SBATCH --nodes=2\n#SBATCH --requeue\nsrun true\n"


class Time:
    """A monotonic clock that moves only when slept on; records the sleeps."""

    def __init__(self) -> None:
        self.now = 500.0
        self.sleeps: list[float] = []
        self.on_sleep = lambda: None

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds
        self.on_sleep()


def _client(fake: FakeSlurm, t: Time) -> SlurmClient:
    return SlurmClient(fake, retry=RetryPolicy(sleep=t.sleep, jitter_s=0), clock=t.clock, sleep=t.sleep)


def _running_job(fake: FakeSlurm, tmp_path: Path) -> str:
    script = tmp_path / "job.sh"
    script.write_text(SCRIPT)
    job_id = fake.run(["sbatch", "--parsable", str(script)]).stdout.strip()
    fake.start(job_id, ["node1", "node2"])
    return job_id


# ------------------------------------------------------------------ the node view
def test_node_evidence_asks_the_given_client_for_the_lost_nodes_only() -> None:
    fake = FakeSlurm({"debug": "node[1-8]"})
    fake.fail_node("node3", reason="Not responding")
    ev = node_evidence(["node3", "node5"], _client(fake, Time()))
    assert fake.calls == [["scontrol", "show", "node", "-o", "node[3,5]"]]  # not the whole cluster
    by_node = {e.node: e for e in ev}
    assert set(by_node) == {"node3", "node5"}
    assert by_node["node3"].cls is FailureClass.NODE_LOSS and by_node["node3"].kind == "slurm"
    assert "state=DOWN" in by_node["node3"].detail and "reason=Not responding" in by_node["node3"].detail
    assert "state=IDLE" in by_node["node5"].detail


def test_node_evidence_retries_a_busy_controller_with_backoff() -> None:
    fake, t = FakeSlurm(), Time()
    fake.fail_node("node2")
    fake.fail_next(2, "Unable to contact slurm controller (connect failure)", command="scontrol")
    retry = RetryPolicy(max_attempts=3, max_delay_s=6, initial_wait_s=0.5, max_wait_s=2, jitter_s=0,
                        sleep=t.sleep)
    ev = node_evidence(["node2"], _client(fake, t), retry=retry)
    assert [e.node for e in ev] == ["node2"]
    assert len(fake.calls) == 3
    assert t.sleeps == [0.5, 1.0]  # exponential, from slurmkit.slurm.retry


def test_node_evidence_of_an_unreachable_controller_is_empty_within_the_decision_budget() -> None:
    fake, t = FakeSlurm(), Time()
    fake.controller_up = False
    retry = dataclasses.replace(DECISION_RETRY, sleep=t.sleep)
    assert node_evidence(["node1"], _client(fake, t), retry=retry) == []
    assert len(fake.calls) == DECISION_RETRY.max_attempts
    assert sum(t.sleeps) <= DECISION_RETRY.max_delay_s  # a decision waits seconds, not minutes


def test_kill_wait_warning_reads_the_given_controller() -> None:
    short = FakeSlurm(config={"KillWait": "10 sec"})
    msg = kill_wait_warning(30, _client(short, Time()))
    assert msg is not None and "KillWait is 10 s" in msg and "cluster.kill_wait_s=30" in msg
    assert short.calls == [["scontrol", "show", "config"]]
    assert kill_wait_warning(30, _client(FakeSlurm(config={"KillWait": "30 sec"}), Time())) is None


# ------------------------------------------------------------------ requeue and release
def test_requeue_goes_through_the_client_after_the_helper_detached(tmp_path: Path) -> None:
    fake = FakeSlurm()
    job_id = _running_job(fake, tmp_path)
    started: list[tuple[list[str], str]] = []

    def start_helper(argv: list[str], env: object) -> bool:
        started.append((argv, fake.jobs[job_id].state))  # the job must still be running then
        return True

    requeue_now(_client(fake, Time()), job_id, ("node2",), env={"SLURM_JOB_ID": job_id},
                run_dir=str(tmp_path), start_helper=start_helper)
    (argv, state_then), = started
    assert state_then == "RUNNING"
    assert argv[1:] == ["-m", "slurmkit.supervise.exits.requeue", "release", job_id,
                        str(tmp_path / "logs" / f"release_{job_id}.log"), "node2"]
    # Held: it cannot start again (on node2) before the helper has excluded node2.
    assert fake.calls[-1] == ["scontrol", "requeuehold", job_id]
    assert fake.jobs[job_id].state == "PENDING" and fake.jobs[job_id].restarts == 1
    assert fake.jobs[job_id].held


def test_requeue_of_an_array_task_names_the_task(tmp_path: Path) -> None:
    fake = FakeSlurm()
    calls: list[list[str]] = []
    with pytest.raises(slurmkit.slurm.SlurmCommandError):  # the fake has no task 7_3
        requeue_now(_client(fake, Time()), "7", (),
                    env={"SLURM_JOB_ID": "7", "SLURM_ARRAY_JOB_ID": "7", "SLURM_ARRAY_TASK_ID": "3"},
                    run_dir=str(tmp_path), start_helper=lambda argv, env: calls.append(argv) or True)
    assert calls[0][4] == "7_3"
    assert ["scontrol", "requeue", "7_3"] in fake.calls


def test_release_waits_for_pending_with_backoff_then_excludes_and_releases(tmp_path: Path) -> None:
    fake, t = FakeSlurm(), Time()
    job_id = _running_job(fake, tmp_path)
    client = _client(fake, t)

    def requeue_late() -> None:  # the requeue lands ~3 s after the helper started polling
        if t.now >= 503 and fake.jobs[job_id].state == "RUNNING":
            fake.run(["scontrol", "requeue", job_id])

    t.on_sleep = requeue_late
    assert release_when_pending(client, job_id, ["node2"], clock=t.clock, sleep=t.sleep)
    job = fake.jobs[job_id]
    assert job.exc_nodes == ["node2"]
    assert job.eligible_time == pytest.approx(fake.clock(), abs=5)  # not requeue time + 121 s
    assert t.sleeps[:4] == [0.2, 0.4, 0.8, 1.6]  # polls back off
    assert ["scontrol", "update", f"jobid={job_id}", "StartTime=now"] in fake.calls


def test_release_lets_the_wall_clock_second_turn_over_before_the_job_may_start(tmp_path: Path) -> None:
    # slurmd refuses a launch whose credential is from the second the old one was revoked in.
    fake, t = FakeSlurm(), Time()
    job_id = _running_job(fake, tmp_path)
    fake.run(["scontrol", "requeue", job_id])  # already PENDING at the first poll
    release = ["scontrol", "update", f"jobid={job_id}", "StartTime=now"]
    released_before_the_wait: list[bool] = []
    t.on_sleep = lambda: released_before_the_wait.append(release in fake.calls)
    assert release_when_pending(_client(fake, t), job_id, [], clock=t.clock, sleep=t.sleep,
                                wall=lambda: 1_796_000_000.3 + (t.now - 500))
    assert t.sleeps == [pytest.approx(1.7)]  # to 2 s past the second the requeue was seen in
    assert released_before_the_wait == [False] and release in fake.calls


def test_release_polls_a_never_pending_job_at_most_every_few_seconds(tmp_path: Path) -> None:
    fake, t = FakeSlurm(), Time()
    job_id = _running_job(fake, tmp_path)
    fake.fail_next(3, command="scontrol")  # a busy controller on top: retried, never fatal
    assert not release_when_pending(_client(fake, t), job_id, [], timeout_s=180, clock=t.clock,
                                    sleep=t.sleep)
    polls = [c for c in fake.calls if c[:3] == ["scontrol", "show", "job"]]
    assert len(polls) < 50  # 180 s at POLL_MAX_S, not 900 polls at 0.2 s
    assert max(t.sleeps) <= POLL_MAX_S
    assert t.now - 500 >= 180


# ------------------------------------------------------------------ where the fake lives
def test_the_fake_is_not_part_of_the_slurm_package_and_no_product_module_imports_it() -> None:
    assert not hasattr(slurmkit.slurm, "FakeSlurm")
    # The test tooling is the repository's testkit/, outside the package (and the wheel).
    assert list((REPO / "slurmkit" / "testing").glob("**/*.py")) == []
    offenders = [str(p.relative_to(REPO)) for p in (REPO / "slurmkit").rglob("*.py")
                 if IMPORTS_TESTING.search(p.read_text())]
    assert offenders == []
    # Importing the public package does not drag the fake in either.
    code = ("import sys, slurmkit.slurm, slurmkit.supervise.exits.requeue; "
            "print('fakeslurm' in str(list(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
