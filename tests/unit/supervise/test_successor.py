"""The requeue as a successor job (slurmkit.supervise.exits.successor) on the fake controller: what is
submitted, with which options and environment, and that a failure leaves nothing behind. The
real handover (a node lost, the successor excluding it) is in
tests/integration/test_unprivileged_user.py::test_an_ordinary_users_run_loses_a_node_and_completes_in_a_successor_job."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slurmkit.supervise.exits.successor import (
    PREDECESSOR_ATTEMPT_ENV, PREDECESSOR_ENV, SuccessorUnavailable, submit_successor, successor_env, successor_of,
)
from testkit.fakeslurm import FakeSlurm
from tests.unit.supervise.test_slurm_client import Time, _client

SCRIPT = ("#!/bin/bash\n#SBATCH --dependency=singleton\n#SBATCH --job-name=sup\n#SBATCH --nodes=2\n"
          "#SBATCH --requeue\n#SBATCH --exclude=node7\nsrun true\n")
ENV = {"PATH": "/usr/bin", "SLURM_CONF": "/etc/slurm/slurm.conf", "SLURM_JOB_ID": "1", "SLURM_PROCID": "0",
       "SLURM_RESTART_COUNT": "2", "SLURMKIT_NODE_RANK": "0", "CUDA_VISIBLE_DEVICES": "0",
       "SUBMITIT_EXECUTOR": "slurm", "HOME": "/home/u"}


def _submitit_run(fake: FakeSlurm, tmp_path: Path) -> tuple[str, Path]:
    sub = tmp_path / "submitit"
    sub.mkdir()
    script = sub / "tmp.sh"
    script.write_text(SCRIPT)
    job_id = fake.run(["sbatch", "--parsable", str(script)]).stdout.strip()
    script.rename(sub / f"{job_id}_submission.sh")
    (sub / f"{job_id}_submitted.pkl").write_bytes(b"pickled function")
    fake.start(job_id, ["node1", "node2"])
    return job_id, sub


def test_the_successor_is_this_jobs_script_held_after_it_excluding_the_nodes_then_released(tmp_path: Path) -> None:
    fake = FakeSlurm({"debug": "node[1-8]"})
    job_id, sub = _submitit_run(fake, tmp_path)
    client = _client(fake, Time())
    new = submit_successor(client, job_id, ("node2",), env={**ENV, "SLURM_JOB_ID": job_id},
                           run_dir=str(tmp_path), sbatch=client, attempt=f"{job_id}-0")
    job, succ = fake.jobs[job_id], fake.jobs[new]
    assert new != job_id and not job.requeue  # Slurm will not bring the old job back itself
    assert succ.sbatch_args[:2] == ["--parsable", "--hold"]
    assert f"--dependency=afterany:{job_id},singleton" in succ.sbatch_args  # never beside the old job
    assert sorted(succ.exc_nodes) == ["node2", "node7"]  # the script's own exclusion kept
    assert succ.command == str(sub / f"{job_id}_submission.sh")
    assert not succ.held  # released once the pickle was there
    assert (sub / f"{new}_submitted.pkl").read_bytes() == b"pickled function"
    assert (sub / f"{new}_submitted.pkl").stat().st_mode & 0o777 == 0o600  # whatever the umask
    assert succ.env[PREDECESSOR_ENV] == job_id
    assert succ.env[PREDECESSOR_ATTEMPT_ENV] == f"{job_id}-0"  # its previous_attempt reads that one
    order = [c[:2] for c in fake.calls if c[0] in ("sbatch", "scontrol")]
    assert order.index(["scontrol", "release"]) > order.index(["sbatch", "--parsable"], 1)


def test_the_successor_runs_without_this_jobs_own_variables() -> None:
    env = successor_env(ENV)
    assert env == {"PATH": "/usr/bin", "SLURM_CONF": "/etc/slurm/slurm.conf", "HOME": "/home/u"}


def test_a_refused_sbatch_leaves_nothing_and_says_why(tmp_path: Path) -> None:
    fake = FakeSlurm({"debug": "node[1-8]"})
    job_id, sub = _submitit_run(fake, tmp_path)
    refusing = FakeSlurm({"other": "node[1-8]"})  # its sbatch knows no such partition... nor any job
    refusing.partitions.clear()
    with pytest.raises(SuccessorUnavailable, match="sbatch refused the successor: .*No partition"):
        submit_successor(_client(fake, Time()), job_id, ("node2",), env=ENV, run_dir=str(tmp_path),
                         sbatch=_client(refusing, Time()))
    assert sorted(p.name for p in sub.iterdir()) == [f"{job_id}_submission.sh", f"{job_id}_submitted.pkl"]
    assert list(fake.jobs) == [job_id]


def test_a_failed_release_cancels_the_successor_and_removes_its_pickle(tmp_path: Path) -> None:
    fake = FakeSlurm({"debug": "node[1-8]"})
    job_id, sub = _submitit_run(fake, tmp_path)
    client = _client(fake, Time())

    def refuse(jid: str) -> None:
        from slurmkit.slurm.errors import SlurmCommandError

        raise SlurmCommandError(["scontrol", "release", jid], 1, "", "Access/permission denied")

    client.release = refuse  # type: ignore[method-assign]
    with pytest.raises(SuccessorUnavailable, match="could not be prepared"):
        submit_successor(client, job_id, ("node2",), env=ENV, run_dir=str(tmp_path), sbatch=client)
    (new,) = [j for j in fake.jobs if j != job_id]
    assert fake.jobs[new].state == "CANCELLED"
    assert not (sub / f"{new}_submitted.pkl").exists() and not (sub / f"{new}_submission.sh").exists()


def test_a_successor_hands_over_again_with_its_own_script(tmp_path: Path) -> None:
    # a run requeued twice (a second time-limit warning, a second lost node): the first
    # successor's own handover needs a script under its id; without it, it fell back to the
    # in-place requeue and Slurm's 121 s hold (seen in the chaos campaign: held_s=121)
    fake = FakeSlurm({"debug": "node[1-8]"})
    job_id, sub = _submitit_run(fake, tmp_path)
    client = _client(fake, Time())
    first = submit_successor(client, job_id, ("node2",), env=ENV, run_dir=str(tmp_path), sbatch=client)
    assert (sub / f"{first}_submission.sh").read_text() == SCRIPT
    fake.finish(job_id)
    fake.start(first, ["node1", "node3"])
    second = submit_successor(client, first, ("node3",), env={**ENV, "SLURM_JOB_ID": first},
                              run_dir=str(tmp_path), sbatch=client)
    assert second not in (job_id, first)
    assert fake.jobs[second].command == str(sub / f"{first}_submission.sh")
    assert f"--dependency=afterany:{first},singleton" in fake.jobs[second].sbatch_args
    assert sorted(fake.jobs[second].exc_nodes) == ["node2", "node3", "node7"]  # every exclusion carried
    assert (sub / f"{second}_submitted.pkl").read_bytes() == b"pickled function"


def test_an_array_task_and_a_run_without_its_script_have_no_successor(tmp_path: Path) -> None:
    fake = FakeSlurm({"debug": "node[1-8]"})
    client = _client(fake, Time())
    with pytest.raises(SuccessorUnavailable, match="array task"):
        submit_successor(client, "5", (), env={"SLURM_ARRAY_TASK_ID": "3"}, run_dir=str(tmp_path))
    with pytest.raises(SuccessorUnavailable, match="no batch script"):
        submit_successor(client, "5", (), env={}, run_dir=str(tmp_path))
    assert fake.calls == []


def test_the_run_is_followed_to_the_newest_successor(tmp_path: Path) -> None:
    lines = [{"event": "submitted", "job_id": "4", "t": 1}, {"event": "successor", "job_id": "9", "predecessor": "4", "t": 2},
             {"event": "successor", "job_id": "$(rm)", "predecessor": "9", "t": 3},
             {"event": "successor", "job_id": "12", "predecessor": "9", "t": 4}]
    (tmp_path / "ledger.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines) + "{not json\n")
    assert successor_of(str(tmp_path), "4") == "9"
    assert successor_of(str(tmp_path), "9") == "12"  # an id that is not a job id is never followed
    assert successor_of(str(tmp_path), "12") is None
