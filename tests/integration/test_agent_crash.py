"""The node agent of node 1 SIGKILLed on the real local cluster while its slurmd lives.

The node is healthy: Slurm still calls it MIXED/ALLOCATED. Node 0 finds the agent silent,
asks Slurm, and must keep the node (a ``node_kept`` record, never in an exclude list). It then
relaunches that node's agent inside the allocation (one more srun step, started by node 0's
agent: slurmkit.supervise.relaunch), which rejoins the next generation in its old slot: no
requeue, no new allocation, and the run resumes from the last checkpoint and ends bit-exact with
the uninterrupted run (``reference``: tests/integration/conftest.py). A chaos campaign found the
first wrong answer (``node_loss`` and a requeue that excluded the healthy node); the second was
a requeue of the whole job keeping the node (minutes in the queue for one lost process).
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from slurmkit.supervise.liveness import slurm_says_dead
from tests.integration.faults import COMMON, events, mark_fault, rank_pid, submit, wait_for_step
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


def test_sigkill_of_an_agent_on_a_healthy_node_relaunches_it_in_the_allocation(
        cluster_env, reference, tmp_path) -> None:
    env = slurm_env(cluster_env)
    job, run_dir = submit([*COMMON, "job.name=f-agent"], env, str(tmp_path))
    step = wait_for_step(run_dir, 3, 13)
    (start,) = events(run_dir, "allocation_start")
    node = str(start["nodes"][1])  # ranks 2 and 3
    pid = agent_pid(run_dir, 2)
    mark_fault(run_dir, "agent_sigkill", node=node, step=step)
    os.kill(pid, signal.SIGKILL)
    assert_recovered(run_dir, job, env, reference, step)
    failure = events(run_dir, "failure")[0]
    assert failure["cls"] == "node_loss" and failure["node"] == node, failure
    (kept,) = events(run_dir, "node_kept")
    assert kept["node"] == node and kept["slurm_state"] and not slurm_says_dead(kept["slurm_state"]), kept
    (relaunched,) = events(run_dir, "agent_relaunched")
    assert (relaunched["node"], relaunched["node_rank"], relaunched["generation"]) == (node, 1, 1), relaunched
    assert not events(run_dir, "agent_relaunch_failed")
    assert [d["action"] for d in events(run_dir, "decision")] == ["restart"]
    assert not events(run_dir, "requeue") and len(events(run_dir, "allocation_start")) == 1
    assert not events(run_dir, "exclusion")
    again = [e for e in events(run_dir, "ranks_started") if e["generation"] == 1]
    assert sorted(r for e in again for r in e["ranks"]) == [0, 1, 2, 3], again
    (mine,) = [e for e in again if e["node"] == node]
    assert mine["slot"] == 1 and mine["source"] == f"agent:{node}" and pid not in mine["pids"], mine
    # its own log, beside the node's first one (slurmkit logs --agent finds the newest)
    assert os.path.exists(relaunched["log"].replace("%j", job)), relaunched["log"]
    killed = events(run_dir, "fault_injected")[0]["t"]
    restored = [e["t"] for e in events(run_dir, "ckpt_restored")]
    print(f"\nagent SIGKILLed -> relaunched agent's first beat {relaunched['t'] - killed:.1f} s "
          f"(srun to beat {relaunched['first_beat_s']:.1f} s), -> ranks of generation 1 started "
          f"{mine['t'] - killed:.1f} s, -> checkpoint restored {min(restored) - killed:.1f} s")


def test_sigkill_of_node0s_agent_requeues_keeping_the_node_and_takes_its_ranks_along(
        cluster_env, reference, tmp_path) -> None:
    """Node 0's agent (it also holds the agents' store) SIGKILLed while its node lives: the
    successor requeues keeping the node (its slurmd answers) and no rank of the killed agent
    outlives it (slurmkit.launch.tether). Found by the 50-seed chaos campaign (seed 4): the node
    was excluded and one of its ranks was still running after the job had completed."""
    env = slurm_env(cluster_env)
    job, run_dir = submit([*COMMON, "job.name=f-agent0"], env, str(tmp_path))
    step = wait_for_step(run_dir, 1, 13)
    (start,) = events(run_dir, "allocation_start")
    node0 = str(start["nodes"][0])  # ranks 0 and 1
    orphans = [rank_pid(run_dir, r) for r in (0, 1)]
    pid = agent_pid(run_dir, 0)
    mark_fault(run_dir, "agent_sigkill", node=node0, step=step)
    os.kill(pid, signal.SIGKILL)
    for orphan in orphans:  # tied to their agent: the kernel ends them with it
        wait_gone(orphan)
    assert_recovered(run_dir, job, env, reference, step)
    (failure,) = [e for e in events(run_dir, "failure") if e["node"] == node0]
    assert failure["cls"] == "node_loss" and "node 0" in failure["evidence"], failure
    (kept,) = events(run_dir, "node_kept")
    assert kept["node"] == node0 and "its slurmd answers" in kept["why"], kept
    (decision,) = [e for e in events(run_dir, "decision") if e.get("action") == "requeue"]
    assert decision["exclude"] == [] and "requeue keeping it" in decision["reason"], decision
    assert not events(run_dir, "exclusion")
    assert len(events(run_dir, "allocation_start")) == 2


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
