"""Node agents SIGKILLed on the real local cluster while their slurmd lives.

The node is healthy: Slurm still calls it MIXED/ALLOCATED. Node 0 finds the agent silent,
asks Slurm, and must keep the node (a ``node_kept`` record, never in an exclude list). It then
relaunches that node's agent inside the allocation (one more srun step, started by node 0's
agent: slurmkit.supervise.relaunch), which rejoins the next generation in its old slot: no
requeue, no new allocation, and the run resumes from the last checkpoint and ends bit-exact with
the uninterrupted run (``reference``: tests/integration/conftest.py). A chaos campaign found the
first wrong answer (``node_loss`` and a requeue that excluded the healthy node); the second was
a requeue of the whole job keeping the node (minutes in the queue for one lost process).
Node 0's agent, killed first in the same job, is answered by a requeue that keeps node 0.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from slurmkit.supervise.liveness import slurm_says_dead
from tests.integration.faults import COMMON, events, mark_fault, rank_pid, submit, wait_for_step, wait_while_running
from tests.integration.helpers import slurm_env
from tests.integration.test_faults import assert_recovered

pytestmark = pytest.mark.integration


def agent_pid(run_dir: str, rank: int) -> int:
    """The agent that started ``rank``: the rank's parent (the agent spawns its ranks itself)."""
    pid = rank_pid(run_dir, rank)
    with open(f"/proc/{pid}/stat") as f:
        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
    with open(f"/proc/{ppid}/cmdline", "rb") as f:
        cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
    assert "slurmkit" in cmd or "submitit" in cmd, f"rank {rank}'s parent {ppid} is not an agent: {cmd}"
    return ppid


def test_node0s_agent_sigkilled_requeues_keeping_its_node_then_another_agent_is_relaunched_in_the_allocation(
        cluster_env, reference, tmp_path) -> None:
    """Two agents SIGKILLed in one job, each while its node lives. First node 0's (it also holds
    the agents' store): the successor requeues keeping node 0 (its slurmd answers) and no rank of
    the killed agent outlives it (slurmkit.launch.tether); found by the 50-seed chaos campaign
    (seed 4): the node was excluded and one of its ranks was still running after the job had
    completed. Then, in the requeued job and past a newer checkpoint, node 1's agent: node 0
    keeps the node and relaunches its agent inside the allocation (generation 1, no second
    requeue). The run ends bit-exact with the uninterrupted one.

    Not the other order: a relaunched agent's srun runs inside node 0's agent's step, so losing
    node 0's agent after a relaunch ends the job before a survivor can hand it over (noted on
    issue 38)."""
    env = slurm_env(cluster_env)
    job, run_dir = submit([*COMMON, "job.name=f-agents"], env, str(tmp_path))
    step0 = wait_for_step(run_dir, 1, 13)
    (start,) = events(run_dir, "allocation_start")
    node0, node = str(start["nodes"][0]), str(start["nodes"][1])  # ranks 0-1, ranks 2-3
    orphans = [rank_pid(run_dir, r) for r in (0, 1)]
    pid0 = agent_pid(run_dir, 0)
    mark_fault(run_dir, "agent_sigkill", node=node0, step=step0)
    os.kill(pid0, signal.SIGKILL)
    for orphan in orphans:  # tied to their agent: the kernel ends them with it
        wait_gone(orphan)

    # The requeued job trains past the save of step 20: node 1's agent next (node 1 is the
    # second node of the new allocation too: it was kept, and Slurm orders nodes by name).
    starts = wait_while_running("the requeued job's start", lambda: (
        got if len(got := events(run_dir, "allocation_start")) >= 2 else None), job, run_dir, env, timeout_s=300)
    step = wait_for_step(run_dir, 3, 23)
    requeued = starts[1]
    node = str(requeued["nodes"][1])
    pid = agent_pid(run_dir, 2)
    mark_fault(run_dir, "agent_sigkill", node=node, step=step)
    second_kill = time.time()
    os.kill(pid, signal.SIGKILL)
    assert_recovered(run_dir, job, env, reference, step)

    # The first kill: node 0's loss recorded by a survivor, node 0 kept, a requeue keeping it.
    failures = events(run_dir, "failure")
    assert [(f["cls"], f["node"]) for f in failures] == [("node_loss", node0), ("node_loss", node)], failures
    assert "node 0" in failures[0]["evidence"], failures[0]
    kept = events(run_dir, "node_kept")
    assert [e["node"] for e in kept] == [node0, node], kept
    assert "its slurmd answers" in kept[0]["why"], kept
    assert [d["action"] for d in events(run_dir, "decision")] == ["requeue", "restart"]
    (decision,) = [e for e in events(run_dir, "decision") if e.get("action") == "requeue"]
    assert decision["exclude"] == [] and "requeue keeping it" in decision["reason"], decision
    assert not events(run_dir, "exclusion")
    assert len(events(run_dir, "allocation_start")) == 2

    # The second: node 1 kept, its agent relaunched in the allocation, a restart, no requeue.
    assert kept[1]["slurm_state"] and not slurm_says_dead(kept[1]["slurm_state"]), kept
    (relaunched,) = events(run_dir, "agent_relaunched")
    assert (relaunched["node"], relaunched["node_rank"], relaunched["generation"]) == (node, 1, 1), relaunched
    assert not events(run_dir, "agent_relaunch_failed")
    assert len(events(run_dir, "requeue")) == 1
    again = [e for e in events(run_dir, "ranks_started") if e["generation"] == 1 and e["t"] > second_kill]
    assert sorted(r for e in again for r in e["ranks"]) == [0, 1, 2, 3], again
    (mine,) = [e for e in again if e["node"] == node]
    assert mine["slot"] == 1 and mine["source"] == f"agent:{node}" and pid not in mine["pids"], mine
    # its own log, beside the node's first one (slurmkit logs --agent finds the newest)
    assert os.path.exists(relaunched["log"].replace("%j", requeued["job_id"])), relaunched["log"]
    restored = [e["t"] for e in events(run_dir, "ckpt_restored") if e["t"] > second_kill]
    print(f"\nagent SIGKILLed -> relaunched agent's first beat {relaunched['t'] - second_kill:.1f} s "
          f"(srun to beat {relaunched['first_beat_s']:.1f} s), -> ranks of generation 1 started "
          f"{mine['t'] - second_kill:.1f} s, -> checkpoint restored {min(restored) - second_kill:.1f} s")


def wait_gone(pid: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return
        except OSError:
            return
        time.sleep(0.05)
    raise AssertionError(f"rank pid {pid} outlived its SIGKILLed agent by {timeout_s:.0f} s")
