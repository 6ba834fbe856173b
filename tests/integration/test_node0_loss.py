"""Losing node 0 itself on the real local cluster: the node of rank 0, the agents' TCPStore,
node 0's agent (the decider), the batch script and every srun client of the job.
`tools/local-cluster kill-node` SIGKILLs its slurmd and every process of the job there.

A surviving agent (the successor) must record the failure and the decision and requeue the job
without node 0 within seconds; the requeued attempt resumes from the last checkpoint and ends
bit-exact with the uninterrupted run. With a spare the answer is the same requeue, not a
continuation on the spare: the batch script died with node 0, and Slurm keeps a --no-kill job
RUNNING without its batch host (shrunk to the survivors) until its time limit, so only a
requeue gives the job a batch script and an end again (docs/control-plane.md, "Losing node 0").

One run, with a spare: without one the survivors' answer is the same requeue by the same path (a
survivor decides node 0's loss as a requeue whatever spares the job holds: the successor path in
slurmkit.supervise.endings), so the spare run covers it and also shows that the spare is not
swapped in for slot 0.
"""

from __future__ import annotations

import os
import time

import pytest

from tests.integration.faults import (
    COMMON, INTERVAL, STEPS, diagnose, events, final, finish, kill_node, mark_fault, restore_node, submit,
    wait_for_step,
)
from tests.integration.helpers import slurm_env

pytestmark = pytest.mark.integration

#: COMMON with a heartbeat timeout that a loaded CI machine does not trip (a false hang would
#: add a failure of its own to the ledger); training itself is the same as test_faults'.
ARGS = [*(a for a in COMMON if not a.startswith("supervisor.heartbeat_timeout_s=")),
        "supervisor.heartbeat_timeout_s=30"]

#: From node 0's death to the successor's failure record, and to Slurm's requeue of the job.
#: The survivors notice after two liveness deadlines (seconds); Slurm itself would need
#: SlurmdTimeout and, with --no-kill, never requeue at all.
ACT_WITHIN_S = 60.0


@pytest.fixture(scope="module")
def env(cluster_env) -> dict[str, str]:
    return slurm_env(cluster_env)


def _wait_requeued(job: str, env, since: float, run_dir: str) -> tuple[float, str]:
    """Seconds from ``since`` until the run left ``job`` (handed to a successor job, or Slurm
    counts a requeue), and the job that carries it now: the first attempt does not sit RUNNING
    with nothing running (with --no-kill Slurm itself would leave it so)."""
    from slurmkit.slurm.client import SlurmClient
    from slurmkit.slurm.runner import SubprocessRunner
    from slurmkit.supervise.exits.successor import successor_of

    client = SlurmClient(SubprocessRunner(env=env))
    deadline = time.monotonic() + 3 * ACT_WITHIN_S
    while time.monotonic() < deadline:
        nxt = successor_of(run_dir, job)
        if nxt is not None:
            return time.time() - since, nxt
        if client.job(job).restart_cnt >= 1:
            return time.time() - since, job
        time.sleep(0.5)
    # The survivors' agent logs say what they saw (or did not) of node 0's end: a flake here
    # (once in five rehearsals, ci64) left nothing else to read.
    raise AssertionError(f"job {job} still in its first attempt {3 * ACT_WITHIN_S:.0f} s after node 0 died: "
                         f"{client.job(job)}\n{diagnose(run_dir, job, env)}\n{_store_processes()}")


def _store_processes() -> str:
    """The agents' store servers still alive on this machine (their comm names them)."""
    from slurmkit.launch.rendezvous import STORE_COMM

    alive = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().strip() == STORE_COMM:
                    with open(f"/proc/{pid}/stat") as g:
                        alive.append(f"pid {pid}: {g.read()[:120]}")
        except OSError:
            continue
    return "store servers alive: " + ("; ".join(alive) or "none")


def _wait_excluded(job: str, env, node: str) -> None:
    from slurmkit.slurm.client import SlurmClient
    from slurmkit.slurm.hostlist import expand_hostlist
    from slurmkit.slurm.runner import SubprocessRunner

    client = SlurmClient(SubprocessRunner(env=env))
    deadline = time.monotonic() + 3 * ACT_WITHIN_S
    while time.monotonic() < deadline:
        if node in expand_hostlist(client.job(job).exc_node_list or ""):
            return
        time.sleep(0.5)
    raise AssertionError(f"job {job} never excluded {node}: {client.job(job)}")


def _lose_node0_and_recover(env, reference: str, tmp_path, name: str, *extra: str) -> tuple[str, list[str], str]:
    # Not exclusive: a requeued exclusive job stayed PENDING (Resources) on idle nodes for minutes
    # (seen here at 17:01 and by the chaos campaign). kill-node hits other jobs on node 0 too.
    job, run_dir = submit([*ARGS, f"job.name={name}", *extra], env, str(tmp_path))
    step = wait_for_step(run_dir, 0, 13, timeout_s=600)  # it may queue behind other jobs
    (start,) = events(run_dir, "allocation_start")
    nodes = [str(n) for n in start["nodes"]]
    node0 = nodes[0]
    mark_fault(run_dir, "node_loss", node=node0, step=step)
    killed_at = time.time()
    back = False
    try:
        kill_node(env, node0)
        requeued_after, carrier = _wait_requeued(job, env, killed_at, run_dir)
        # Node 0 comes back once the job excludes it: the next attempt must avoid an up node.
        _wait_excluded(carrier, env, node0)
        restore_node(env, node0)
        back = True
        state = finish(job, env, timeout_s=600, run_dir=run_dir)
        assert state == "COMPLETED", f"job {job} ended {state}\n{diagnose(run_dir, job, env)}"
    finally:
        if not back:
            restore_node(env, node0)
    assert requeued_after < ACT_WITHIN_S, f"the run left job {job} {requeued_after:.0f} s after node 0 died"
    # It went to a successor job (no helper outside the job) and the dead job was ended at once,
    # not left RUNNING without its batch host (--no-kill) or until SlurmdTimeout.
    assert carrier != job, "the successor requeued in place, not as a successor job"

    # The ledger: one successor recorded the loss, decided and requeued. Normally node rank 1;
    # each agent's stagger counts from its own notice of the loss, so on a loaded machine a
    # spare with no ranks to stop can notice a grace period earlier and act instead. What must
    # hold is that exactly one surviving agent acted, once.
    (failure,) = events(run_dir, "failure")
    assert failure["cls"] == "node_loss" and failure["node"] == node0, failure
    survivors = {f"agent:{n}": n for n in nodes[1:]}
    successor = failure["source"]
    assert successor in survivors and f"recorded by {survivors[successor]}" in failure["evidence"], failure
    assert failure["t"] - killed_at < ACT_WITHIN_S, "the successor took over a minute to record node 0's loss"
    (decision,) = events(run_dir, "decision")
    assert decision["source"] == successor and decision["action"] == "requeue", decision
    assert decision["exclude"] == [node0], decision
    (requeue,) = events(run_dir, "requeue")
    assert requeue["source"] == successor and requeue["exclude"] == [node0], requeue
    assert decision["t"] <= requeue["t"]

    # The requeued attempt: without node 0, resumed from the last checkpoint, bit-exact.
    starts = events(run_dir, "allocation_start")
    assert len(starts) == 2 and node0 not in starts[1]["nodes"], starts
    assert node0 not in {e["node"] for e in events(run_dir, "ranks_started") if e["t"] > requeue["t"]}
    restored = [e["step"] for e in events(run_dir, "ckpt_restored")]
    assert restored and max(restored) >= step - INTERVAL, (restored, step)
    assert final(run_dir)["step"] == STEPS
    assert final(run_dir)["param_sha256"] == reference, "resumed run diverged from the uninterrupted one"
    (end,) = events(run_dir, "end")
    assert end["status"] == "completed", end
    return node0, nodes, run_dir


def test_losing_node0_with_a_spare_requeues_without_it_and_resumes(env, reference, tmp_path) -> None:
    node0, nodes, run_dir = _lose_node0_and_recover(env, reference, tmp_path, "n0-spare",
                                                    "supervisor.spare_nodes=1")
    (first, second) = events(run_dir, "allocation_start")
    assert len(first["spares"]) == 1 and len(second["spares"]) == 1, (first, second)
    # The spare of the first attempt was not swapped in for slot 0: no replacement decision.
    assert not events(run_dir, "exclusion") or all(e["how"] == "requeue" for e in events(run_dir, "exclusion"))
