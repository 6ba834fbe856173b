"""Requeue without bad nodes when Slurm may have requeued first (node 0 lost without --no-kill
races Slurm's NODE_FAIL requeue) and when the requeue comes back pending at once: on the fake
controller through the client the supervisor is given, with a recorded clock."""

from __future__ import annotations

from pathlib import Path

from tests.unit.supervise.test_slurm_client import Time, _client, _running_job
from slurmkit.supervise.exits.requeue import release_when_pending, requeue_now
from testkit.fakeslurm import FakeSlurm


def _helper(argv: list[str], env: object) -> bool:
    return True


def test_a_job_slurm_requeued_already_is_not_requeued_again(tmp_path: Path) -> None:
    fake = FakeSlurm()
    job_id = _running_job(fake, tmp_path)
    fake.run(["scontrol", "requeue", job_id])  # Slurm's own requeue: the job is at restart 1
    fake.start(job_id, ["node3", "node4"])  # and already runs its next attempt
    requeue_now(_client(fake, Time()), job_id, ("node1",), env={"SLURM_JOB_ID": job_id, "SLURM_RESTART_COUNT": "0"},
                run_dir=str(tmp_path), start_helper=_helper)
    assert fake.jobs[job_id].state == "RUNNING" and fake.jobs[job_id].restarts == 1  # not killed
    assert not [c for c in fake.calls if c[:2] == ["scontrol", "requeuehold"]]


def test_a_requeue_that_fails_because_slurm_was_first_is_not_an_error(tmp_path: Path) -> None:
    fake = FakeSlurm()
    job_id = _running_job(fake, tmp_path)
    client = _client(fake, Time())
    real_job = client.job
    looks: list[int] = []

    def job_seen_before_slurms_requeue(jid: str):  # noqa: ANN202 - JobInfo
        looks.append(1)
        info = real_job(jid)
        if len(looks) == 1:  # Slurm's NODE_FAIL requeue lands right after this look
            fake.run(["scontrol", "requeue", job_id])
        return info

    client.job = job_seen_before_slurms_requeue  # type: ignore[method-assign]
    requeue_now(client, job_id, ("node1",), env={"SLURM_JOB_ID": job_id}, run_dir=str(tmp_path),
                start_helper=_helper)
    assert fake.jobs[job_id].state == "PENDING" and fake.jobs[job_id].restarts == 1 and len(looks) == 2


def test_the_same_attempt_is_requeued(tmp_path: Path) -> None:
    fake = FakeSlurm()
    job_id = _running_job(fake, tmp_path)
    fake.run(["scontrol", "requeue", job_id])
    fake.start(job_id, ["node1", "node2"])  # attempt 1 runs: it may requeue itself
    requeue_now(_client(fake, Time()), job_id, (), env={"SLURM_JOB_ID": job_id, "SLURM_RESTART_COUNT": "1"},
                run_dir=str(tmp_path), start_helper=_helper)
    assert fake.jobs[job_id].state == "PENDING" and fake.jobs[job_id].restarts == 2
    assert fake.calls[-1] == ["scontrol", "requeue", job_id]  # nothing to exclude: no hold


def test_the_helper_excludes_then_lifts_the_hold(tmp_path: Path) -> None:
    fake, t = FakeSlurm(), Time()
    job_id = _running_job(fake, tmp_path)
    fake.run(["scontrol", "requeuehold", job_id])
    assert release_when_pending(_client(fake, t), job_id, ["node1"], clock=t.clock, sleep=t.sleep)
    job = fake.jobs[job_id]
    assert job.exc_nodes == ["node1"] and not job.held
    updates = [c for c in fake.calls if c[:2] in (["scontrol", "update"], ["scontrol", "release"])]
    assert updates[0][2:] == [f"jobid={job_id}", "ExcNodeList=node1"]  # excluded before it may start
    assert ["scontrol", "release", job_id] in updates[1:]


def test_a_held_job_is_released_even_when_the_exclusion_fails(tmp_path: Path) -> None:
    fake, t = FakeSlurm(), Time()
    job_id = _running_job(fake, tmp_path)
    fake.run(["scontrol", "requeuehold", job_id])
    client = _client(fake, t)

    def refuse(jid: str, nodes: list[str]) -> list[str]:
        raise RuntimeError("scontrol update refused")

    client.update_exclude = refuse  # type: ignore[method-assign]
    try:
        release_when_pending(client, job_id, ["node1"], clock=t.clock, sleep=t.sleep)
    except RuntimeError:
        pass
    assert not fake.jobs[job_id].held  # never stuck pending on a hold nobody lifts
