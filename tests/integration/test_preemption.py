"""A real preemption on the local cluster (tools/local-cluster configures preempt/partition_prio,
PreemptMode=REQUEUE, GraceTime=60 on the default partition and a higher-tier partition "urgent").

An exclusive job in "urgent" needs every node while a slurmkit job trains: Slurm sends the job's
steps SIGTERM. The ranks save a stop checkpoint (on the shared tier) and exit 95 well inside
GraceTime, and a job that ends inside GraceTime is not requeued by Slurm (seen here: it ended
COMPLETED, the run lost for good). So node 0 asks Slurm whether the SIGTERM was a preemption it
would requeue and requeues the job itself. The urgent job runs, then the slurmkit job resumes
from its stop checkpoint and ends bit-exact with the uninterrupted run (``reference``:
tests/integration/conftest.py); nothing is recorded as a failure.
"""

from __future__ import annotations

import subprocess
import time

import pytest

from tests.integration.faults import (
    COMMON, diagnose, events, final, finish, mark_fault, submit, wait_for_step,
)
from tests.integration.helpers import slurm_env

pytestmark = [pytest.mark.integration, pytest.mark.slurm_version]  # CI: on 22.05 and 24.11
URGENT = "urgent"  # tools/local-cluster's preempting partition


@pytest.fixture(scope="module")
def env(cluster_env) -> dict[str, str]:
    return slurm_env(cluster_env)


def _preemptor(env: dict[str, str], cwd: str) -> str:
    """An exclusive job on every node of the urgent partition: it must preempt to run."""
    res = subprocess.run(["sbatch", "--parsable", "-p", URGENT, "--exclusive", "-N", "4",
                          "-o", "/dev/null", "--wrap", "sleep 3"], env=env, cwd=cwd,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return res.stdout.strip().split(";")[0]


def test_a_preempted_job_checkpoints_requeues_itself_and_resumes_bit_exact(
        env, reference, tmp_path) -> None:
    args = [*(a for a in COMMON if not a.startswith("supervisor.heartbeat_timeout_s=")),
            "supervisor.heartbeat_timeout_s=30", "job.name=preempted"]
    job, run_dir = submit(args, env, str(tmp_path))
    step = wait_for_step(run_dir, 0, 5, timeout_s=300)
    mark_fault(run_dir, "preemption", step=step)
    urgent = _preemptor(env, str(tmp_path))
    deadline = time.monotonic() + 120
    while not events(run_dir, "requeue"):
        assert time.monotonic() < deadline, f"no requeue after the preemption\n{diagnose(run_dir, job, env)}"
        time.sleep(0.5)
    assert finish(urgent, env, timeout_s=300) == "COMPLETED"
    state = finish(job, env, timeout_s=600, run_dir=run_dir)
    assert state == "COMPLETED", f"job {job} ended {state}\n{diagnose(run_dir, job, env)}"
    assert final(run_dir)["param_sha256"] == reference, "resumed run diverged"

    (saved,) = events(run_dir, "checkpointed_on_signal")
    assert saved["signal"] == "preemption", saved
    (stopped,) = events(run_dir, "train_stopped")
    (requeue,) = events(run_dir, "requeue")
    assert "preempted" in requeue["reason"] and "PreemptMode=REQUEUE" in requeue["reason"], requeue
    restored = events(run_dir, "ckpt_restored")
    assert restored and restored[0]["step"] == stopped["step"], (restored, stopped)
    assert not events(run_dir, "failure"), events(run_dir, "failure")
    (prev,) = events(run_dir, "previous_attempt")
    assert prev["attempt"] == f"{job}-0" and prev["handled_by"] == "slurmkit", prev
