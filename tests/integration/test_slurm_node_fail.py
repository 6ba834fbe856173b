"""A loss that Slurm handles alone, on the real local cluster: a one-node job loses its node.

Nothing of the job survives to act (node 0's agent, the batch script and every rank were on
it), so Slurm ends the run NODE_FAIL and, the job being --requeue, requeues it itself. The next
allocation's node 0 must tell the ledger what happened (slurmkit/supervise/exits/previous.py): the
previous attempt handled by Slurm, its state and node, a node_loss failure and Slurm's requeue
decision; and, where sacct has the FailedNode field (Slurm 23.02+: the 24.11 cluster; 22.05 has
none and refuses to be asked), the node Slurm blamed. Training then resumes from the last
checkpoint and completes.
"""

from __future__ import annotations

import math
import subprocess
import time

import pytest

from slurmkit.slurm.capabilities import read_run_dir_copy
from slurmkit.slurm.client import SlurmClient
from slurmkit.slurm.runner import SubprocessRunner
from tests.integration.faults import (
    COMMON, INTERVAL, STEPS, diagnose, events, final, finish, kill_node, mark_fault, restore_node, submit,
    wait_for_step,
)
from tests.integration.helpers import slurm_env, submitter_uid

pytestmark = [pytest.mark.integration, pytest.mark.slurm_version]  # CI: on 22.05 and 24.11


def release_when_requeued(job: str, env: dict[str, str], timeout_s: float = 180) -> None:
    """Once Slurm has requeued the job (pending again, restart count 1), start it now, as an
    admin may: Slurm holds a requeued job for the credential lifetime (AuthInfo cred_expire,
    120 s by default; previous_attempt's held_s shows it), which only makes this test longer."""
    client = SlurmClient(SubprocessRunner(env=env))
    deadline = time.monotonic() + timeout_s
    while True:
        info = client.job(job)
        if info.state == "PENDING" and info.restart_cnt >= 1:
            break
        assert time.monotonic() < deadline, f"Slurm did not requeue job {job} within {timeout_s:.0f} s: {info.state}"
        time.sleep(0.5)
    # As slurmkit's own release does (supervise/exits/requeue.py): the new launch credential must not
    # date from the second the old one was revoked in, so the wall clock turns over first.
    time.sleep(max(math.floor(time.time()) + 2 - time.time(), 0.0))
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=env, check=True,
                   capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def env(cluster_env) -> dict[str, str]:
    return slurm_env(cluster_env)


def test_a_one_node_job_whose_node_dies_is_requeued_by_slurm_and_the_next_allocation_says_so(env, tmp_path) -> None:
    job, run_dir = submit([*COMMON, "job.name=slurm-nodefail", "job.nodes=1"], env, str(tmp_path))
    step = wait_for_step(run_dir, 1, 13)
    (start,) = events(run_dir, "allocation_start")
    (lost,) = start["nodes"]
    mark_fault(run_dir, "node_loss", node=lost, step=step)
    try:
        kill_node(env, lost)
        release_when_requeued(job, env)
        # The node stays down until the job runs again elsewhere (brought back earlier, it takes
        # the job again); and until then sacct may still call the job NODE_FAIL (22.05).
        deadline = time.monotonic() + 180
        while len(events(run_dir, "allocation_start")) < 2:
            assert time.monotonic() < deadline, f"job {job} did not start again\n{diagnose(run_dir, job, env)}"
            time.sleep(0.5)
        state = finish(job, env, timeout_s=600, run_dir=run_dir)
    finally:
        restore_node(env, lost)
    story = diagnose(run_dir, job, env)
    assert state == "COMPLETED", f"job {job} ended {state}\n{story}"
    assert final(run_dir)["step"] == STEPS, story
    restored = [e["step"] for e in events(run_dir, "ckpt_restored")]
    assert restored and max(restored) >= step - INTERVAL, (restored, step)

    starts = events(run_dir, "allocation_start")
    assert [s["job_id"] for s in starts] == [job, job] and starts[1]["restart_count"] == 1, story
    assert not events(run_dir, "requeue") and not events(run_dir, "successor"), story  # no agent acted
    (prev,) = events(run_dir, "previous_attempt")
    assert (prev["attempt"], prev["handled_by"], prev["outcome"]) == (f"{job}-0", "slurm", "NODE_FAIL"), prev
    assert prev["nodes"] == [lost], prev
    caps = read_run_dir_copy(run_dir, uid=submitter_uid(env))
    assert caps is not None and caps.failed_node_field is not None, "the site probe left no capabilities"
    if caps.failed_node_field:  # Slurm 23.02+: accounting names the node it blamed
        assert prev.get("failed_node") == lost, prev
    else:
        assert "failed_node" not in prev, prev
    (failure,) = events(run_dir, "failure")
    assert failure["cls"] == "node_loss" and failure["node"] == lost, failure
    assert ("FailedNode" in failure["evidence"]) == bool(caps.failed_node_field), failure
    (decision,) = events(run_dir, "decision")
    assert decision["action"] == "requeue" and decision["reason"].startswith("by Slurm"), decision
    assert [e["status"] for e in events(run_dir, "end")] == ["completed"], story
