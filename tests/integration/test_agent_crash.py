"""The node agent of node 1 SIGKILLed on the real local cluster while its slurmd lives.

The node is healthy: Slurm still calls it MIXED/ALLOCATED. Node 0 finds the agent silent,
asks Slurm, and must keep the node (a ``node_kept`` record, never in a requeue's exclude list):
without a spare it requeues the job keeping every node, and the next allocation resumes from
the last checkpoint and ends bit-exact with the uninterrupted run (``reference``:
tests/integration/conftest.py). A chaos campaign found the old answer: ``node_loss`` and a
requeue that excluded the healthy node.
"""

from __future__ import annotations

import os
import signal

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


def test_sigkill_of_an_agent_on_a_healthy_node_keeps_the_node(cluster_env, reference, tmp_path) -> None:
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
    requeues = events(run_dir, "requeue")
    assert requeues, "the lost agent's generation must go on in a new allocation (no spare)"
    assert all(node not in r["exclude"] for r in requeues), requeues
    assert all(node not in e["nodes"] for e in events(run_dir, "exclusion"))
