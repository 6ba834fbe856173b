"""The shared and object tiers keep advancing while Slurm moves the job's nodes (issue 10).

One real job on the local cluster (real slurmd, real SeaweedFS): 2 training nodes and a spare,
NVMe every save (every 2 steps), the shared tier and S3 every 2nd save.
  1. After a save, node rank 1 is killed with its NVMe (``tools/local-cluster kill-node``): the
     spare takes its slot inside the allocation; it never had the lost node's files. 10 more
     saves: both slower tiers advance past the loss (promotion follows the manifests, not a
     per-node queue that the spare lacks).
  2. The job is then requeued by Slurm onto other nodes: ``scontrol requeuehold`` (what a
     preemption with PreemptMode=REQUEUE or an admin does), node 0 excluded, released. The
     new allocation has another node 0 and another node set; it resumes and 10 more saves
     later both tiers hold the run's final step, deep-verified.
The promotion logic is tested with emulated nodes in test_store_promotion.py; this is the same
promise through the real launcher, agents, Slurm allocations and S3 credentials passed by sbatch.
"""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from typing import Any

import pytest

from slurmkit.supervise.exits.requeue import release_when_pending
from tests.integration.faults import (
    _client, diagnose, events, final, finish, kill_node, mark_fault, restore_node, submit,
)
from tests.integration.helpers import slurm_env

pytestmark = pytest.mark.integration
STEPS, INTERVAL = 76, 2  # 38 saves
MOVED_AFTER = 10  # saves after each node move that must reach both tiers


@pytest.fixture(scope="module")
def env(cluster_env) -> dict[str, str]:
    return slurm_env(cluster_env)


def _durable(run_dir: str, tier: str, after_t: float = 0.0) -> list[int]:
    """Steps rank 0 recorded durable on ``tier`` after time ``after_t``, in order."""
    return [int(e["step"]) for e in events(run_dir, "ckpt_durable")
            if e["tier"] == tier and float(e["t"]) > after_t]


def _wait(what: str, cond: Any, run_dir: str, job: str, env: dict[str, str],
          timeout_s: float = 300) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"{what} not within {timeout_s:.0f} s\n{diagnose(run_dir, job, env)}")


def _scontrol(env: dict[str, str], *args: str) -> None:
    res = subprocess.run(["scontrol", *args], env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, (args, res.stdout, res.stderr)


def _tier_newest(kind: str, uri: str, env: dict[str, str]) -> int | None:
    from slurmkit.store.catalog import check_step, read_latest
    from slurmkit.store.tier import make_tier

    tier = make_tier(kind, uri, env)
    step = read_latest(tier)
    assert step is not None and check_step(tier, step, deep=True).ok, (kind, uri, step)
    return step


@pytest.mark.timeout(1200)
def test_shared_and_object_tiers_advance_after_a_spare_and_a_requeue_onto_other_nodes(
        env, tmp_path) -> None:
    run_id = f"tiers-{uuid.uuid4().hex[:10]}"
    object_uri = f"s3://{env['SLURMKIT_S3_BUCKET']}/{run_id}"
    shared_dir = str(tmp_path / "shared")
    args = ["+exp=tiny", "model=micro", f"train.steps={STEPS}", f"train.ckpt_interval_steps={INTERVAL}",
            "train.micro_batch=1", "train.seq_len=32", "+job.env.SLURMKIT_STEP_DELAY_S=0.25",
            "supervisor.heartbeat_timeout_s=30", "supervisor.spare_nodes=1",
            "store=tiered", f"store.run_id={run_id}",
            "store.nvme_uri=$SLURMKIT_RUN_DIR/ckpt/nvme", f"store.lustre_uri={shared_dir}",
            f"store.object_uri={object_uri}", "store.lustre_every_saves=2",
            "store.object_every_saves=2", "store.object_every_min=0", "store.stagger_s=0",
            "job.name=tiers-advance"]
    job, run_dir = submit(args, env, str(tmp_path))

    # 1. a node lost after a save; the spare takes its slot in the allocation
    _wait("a save", lambda: events(run_dir, "ckpt_saved"), run_dir, job, env)
    (start,) = events(run_dir, "allocation_start")
    node0, lost = (str(n) for n in start["train_nodes"][:2])
    mark_fault(run_dir, "node_loss", node=lost)
    t_loss = time.time()
    try:
        kill_node(env, lost)
        restored = _wait("the spare's restore", lambda: [
            e for e in events(run_dir, "ckpt_restored") if float(e["t"]) > t_loss],
            run_dir, job, env)
        loss_step = int(restored[0]["step"])
        for tier in ("lustre", "object"):
            _wait(f"{MOVED_AFTER} saves past the loss on {tier}",
                  lambda t=tier: [s for s in _durable(run_dir, t, t_loss)
                                  if s >= loss_step + MOVED_AFTER * INTERVAL],
                  run_dir, job, env)
    finally:
        restore_node(env, lost)
    decisions = events(run_dir, "decision")
    assert decisions and decisions[0]["action"] == "replace_node", decisions
    assert not events(run_dir, "requeue"), "a spare was there: the allocation continues"

    # 2. Slurm requeues the job onto other nodes: node 0 excluded
    before_requeue = max(_durable(run_dir, "object"))
    t_requeue = time.time()
    _scontrol(env, "requeuehold", job)
    # once pending: node 0 excluded, eligible now (Slurm would hold it ~2 minutes), released;
    # the supervisor's own requeue does the same
    assert release_when_pending(_client(env), job, [node0], timeout_s=180)
    starts = _wait("the requeued allocation", lambda: events(run_dir, "allocation_start")[1:],
                   run_dir, job, env)
    assert node0 not in starts[0]["nodes"], (node0, starts[0])
    assert str(starts[0]["train_nodes"][0]) != node0, starts[0]
    state = finish(job, env, timeout_s=600, run_dir=run_dir)
    assert state == "COMPLETED", (state, diagnose(run_dir, job, env))
    assert final(run_dir)["step"] == STEPS

    # the next allocation says what ended the previous one, and how long the job waited
    (prev,) = events(run_dir, "previous_attempt")
    assert prev["attempt"] == f"{job}-0" and prev.get("queued_s") is not None, prev
    restored = [e for e in events(run_dir, "ckpt_restored") if float(e["t"]) > t_requeue]
    assert restored and int(restored[0]["step"]) >= before_requeue, (restored, before_requeue)
    resumed = int(restored[0]["step"])
    assert STEPS - resumed >= MOVED_AFTER * INTERVAL, (resumed, "too late a requeue to show it")
    for tier, uri, kind in (("lustre", shared_dir, "lustre"), ("object", object_uri, "object")):
        after = [s for s in _durable(run_dir, tier, t_requeue) if s > resumed]
        # advancing all along, not only the final step: at least half the saves promoted
        assert len(set(after)) >= MOVED_AFTER // 2, (tier, after)
        assert max(after) == STEPS, (tier, after)
        assert _tier_newest(kind, uri, env) == STEPS, tier
    stuck = [e for e in events(run_dir, "ckpt_failed") if not e.get("pending", True)]
    assert not stuck, stuck
