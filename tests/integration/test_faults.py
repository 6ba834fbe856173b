"""Fault injection on the real local cluster: real signals, real aborts, real slurmd deaths.

Each run must finish training, lose at most one checkpoint interval, and end with parameters
bit-for-bit equal to the same run without faults.
"""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from tests.integration.faults import (
    COMMON, INTERVAL, STEPS, diagnose, events, final, finish, mark_fault, rank_pid, submit, wait_for_step,
)
from tests.integration.helpers import slurm_env

pytestmark = pytest.mark.integration
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def env(cluster_env) -> dict[str, str]:
    return slurm_env(cluster_env)


@pytest.fixture(scope="module")
def reference(env, tmp_path_factory) -> str:
    """param_sha256 of the uninterrupted run."""
    d = tmp_path_factory.mktemp("ref")
    job, run_dir = submit([*COMMON, "job.name=reference"], env, str(d))
    assert finish(job, env) == "COMPLETED"
    out = final(run_dir)
    assert out["step"] == STEPS
    return str(out["param_sha256"])


def assert_recovered(run_dir: str, job: str, env, reference: str, fault_step: int) -> None:
    state = finish(job, env)
    assert state == "COMPLETED", f"job {job} ended {state}\n{diagnose(run_dir, job, env)}"
    assert final(run_dir)["param_sha256"] == reference, "resumed run diverged from the uninterrupted one"
    restored = [e["step"] for e in events(run_dir, "ckpt_restored")]
    assert restored, "no resume recorded in the ledger"
    assert max(restored) >= fault_step - INTERVAL, (restored, fault_step)


def test_sigkill_of_one_rank_restarts_in_the_allocation(env, reference, tmp_path) -> None:
    job, run_dir = submit([*COMMON, "job.name=f-kill"], env, str(tmp_path))
    step = wait_for_step(run_dir, 3, 13)
    mark_fault(run_dir, "sigkill", rank=3, step=step)
    os.kill(rank_pid(run_dir, 3), signal.SIGKILL)
    assert_recovered(run_dir, job, env, reference, step)
    (failure,) = events(run_dir, "failure")
    assert failure["cls"] == "rank_crash" and failure["rank"] == 3, failure
    assert [d["action"] for d in events(run_dir, "decision")] == ["restart"]


def test_sigstop_of_one_rank_is_a_hang(env, reference, tmp_path) -> None:
    job, run_dir = submit([*COMMON, "job.name=f-stop"], env, str(tmp_path))
    step = wait_for_step(run_dir, 1, 13)
    mark_fault(run_dir, "sigstop", rank=1, step=step)
    os.kill(rank_pid(run_dir, 1), signal.SIGSTOP)
    assert_recovered(run_dir, job, env, reference, step)
    (failure,) = events(run_dir, "failure")
    assert failure["cls"] == "hang" and failure["rank"] == 1, failure
    assert "stopped" in failure["evidence"]


def test_nccl_error_line_and_abort(env, reference, tmp_path) -> None:
    job, run_dir = submit([*COMMON, "job.name=f-nccl", "+job.env.SLURMKIT_FAULT=nccl_abort:2:15:once"],
                          env, str(tmp_path))
    assert_recovered(run_dir, job, env, reference, 15)
    (failure,) = events(run_dir, "failure")
    assert failure["cls"] == "nccl_error" and failure["rank"] == 2, failure
    assert "NCCL error" in failure["evidence"]


def test_raise_at_the_same_step_stops_with_93_and_no_requeue(env, tmp_path) -> None:
    job, run_dir = submit([*COMMON, "job.name=f-loop", "+job.env.SLURMKIT_FAULT=raise:1:15",
                           "supervisor.max_restarts_without_progress=2"], env, str(tmp_path))
    assert finish(job, env) == "FAILED"
    from slurmkit.slurm.client import SlurmClient
    from slurmkit.slurm.runner import SubprocessRunner

    rows = [r for r in SlurmClient(SubprocessRunner(env=env)).sacct(job) if not r.is_step]
    assert rows[-1].exit_code == 93, rows
    assert SlurmClient(SubprocessRunner(env=env)).job(job).restart_cnt == 0
    end = events(run_dir, "end")[-1]
    assert end["status"] == "stopped" and end["exit_code"] == 93 and "crash loop" in end["reason"]
    assert all(f["cls"] == "user_error" and f["rank"] == 1 for f in events(run_dir, "failure"))
    assert not os.path.exists(os.path.join(run_dir, "final.json"))


def _kill_node(env, node: str) -> None:
    subprocess.run([os.path.join(REPO, "tools", "local-cluster"), "kill-node", node], check=True,
                   env=env, capture_output=True, timeout=60)


def _restore_node(env, node: str) -> None:
    """Bring the node back for the next tests: restart its slurmd, wait until Slurm takes it."""
    from slurmkit.slurm.client import SlurmClient
    from slurmkit.slurm.runner import SubprocessRunner

    subprocess.run([os.path.join(REPO, "tools", "local-cluster"), "start-node", node], check=True,
                   env=env, capture_output=True, timeout=60)
    client = SlurmClient(SubprocessRunner(env=env))
    import time

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        info = {n.name: n for n in client.nodes()}[node]
        if info.state.startswith(("IDLE", "MIX", "ALLOC")) and "*" not in info.state:
            return
        if "DOWN" in info.state or "DRAIN" in info.state:
            subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], env=env,
                           capture_output=True, timeout=30)
        time.sleep(1)
    raise AssertionError(f"{node} did not come back")


def _lose_second_node_and_recover(env, reference: str, job: str, run_dir: str) -> str:
    """Kill the node of ranks 2-3 (slurmd and its processes) mid-run; the run must recover."""
    step = wait_for_step(run_dir, 3, 13)
    (start,) = events(run_dir, "allocation_start")
    lost = str(start["train_nodes"][1])
    mark_fault(run_dir, "node_loss", node=lost, step=step)
    try:
        _kill_node(env, lost)
        assert_recovered(run_dir, job, env, reference, step)
    finally:
        _restore_node(env, lost)
    return lost


def test_node_loss_with_a_spare_continues_on_the_spare(env, reference, tmp_path) -> None:
    job, run_dir = submit([*COMMON, "job.name=f-spare", "supervisor.spare_nodes=1"], env, str(tmp_path))
    lost = _lose_second_node_and_recover(env, reference, job, run_dir)
    failures = events(run_dir, "failure")
    assert failures[0]["cls"] == "node_loss" and failures[0]["node"] == lost, failures
    assert events(run_dir, "decision")[0]["action"] == "replace_node"
    assert not events(run_dir, "requeue")
    started = events(run_dir, "ranks_started")
    assert started[-1]["node"] != lost and lost not in {e["node"] for e in started if e["generation"] == 1}


def test_node_loss_without_a_spare_requeues_without_the_node(env, reference, tmp_path) -> None:
    job, run_dir = submit([*COMMON, "job.name=f-requeue"], env, str(tmp_path))
    lost = _lose_second_node_and_recover(env, reference, job, run_dir)
    assert events(run_dir, "failure")[0]["cls"] == "node_loss"
    (requeue,) = events(run_dir, "requeue")
    assert requeue["exclude"] == [lost]
    starts = events(run_dir, "allocation_start")
    assert len(starts) == 2 and lost not in starts[1]["nodes"]
    # Released at once, not after Slurm's ~120 s requeue hold.
    assert starts[1]["t"] - requeue["t"] < 60, starts[1]["t"] - requeue["t"]


def test_time_limit_warning_checkpoints_and_requeues(env, reference, tmp_path) -> None:
    """A 2-minute limit with a 60 s warning against ~70 s of training: the real signal path."""
    args = [a for a in COMMON if "STEP_DELAY" not in a]
    job, run_dir = submit([*args, "job.name=f-time", "job.time=00:02:00", "job.signal_lead_s=60",
                           "+job.env.SLURMKIT_STEP_DELAY_S=1.5"], env, str(tmp_path))
    state = finish(job, env, timeout_s=600)
    assert state == "COMPLETED", state
    assert final(run_dir)["param_sha256"] == reference
    saved = events(run_dir, "checkpointed_on_signal")
    assert saved and saved[0]["signal"] == "time_limit", saved
    requeues = events(run_dir, "requeue")
    assert requeues and "time limit" in requeues[0]["reason"]
    # Nothing was lost: the requeued run resumed from the step saved on the warning.
    restored = [e["step"] for e in events(run_dir, "ckpt_restored")]
    assert restored[0] == saved[0]["step"], (restored, saved)
    assert not events(run_dir, "failure")
