"""Agents in srun steps of several nodes (launch.nodes_per_step=2) on the real local cluster,
and a node of a shared step lost for real (slurmd and the job's processes SIGKILLed).

Three train nodes and a spare: node 0's agent in its own step, node ranks 1 and 2 in one step,
the spare in its own. Node rank 2 dies. The run must go on in its allocation: the spare takes
the dead node's slot, no requeue, node rank 1 trains on, and training completes. Every agent of
the shared step wrote its own log where a one-node step would have put it.

What happens to the shared step's other agent is srun's choice: with spares the steps run
with --no-kill, and Slurm 22.05 here keeps the step's other task running (measured: the job
RESIZING without the node, "srun: error: Node failure on node3", no "Force Terminated"); without
--no-kill it ends the whole step once the node is DOWN ("node2: task 0: Killed"), and a site may
see an I/O error end it either way. Then node 0 relaunches that agent (a step of one node): the
test accepts both, and the decision that relaunches is tested in tests/unit/test_supervise_relaunch.py.
"""

from __future__ import annotations

import glob
import os
import subprocess

import pytest

from tests.integration.faults import (
    COMMON, diagnose, events, final, finish, kill_node, mark_fault, restore_node, submit, wait_for_step,
)
from tests.integration.helpers import slurm_env

pytestmark = pytest.mark.integration


def test_a_node_lost_from_a_shared_step_takes_a_spare_and_its_step_peer_trains_on(
        cluster_env, tmp_path) -> None:
    env = slurm_env(cluster_env)
    # health=off: a pre-flight link test on this loaded machine may give the spare away first
    job, run_dir = submit([*COMMON, "job.name=lg", "job.nodes=3", "supervisor.spare_nodes=1", "health=off",
                           "launch.nodes_per_step=2"], env, str(tmp_path))
    step = wait_for_step(run_dir, 5, 13)  # a rank of node rank 2
    (start,) = events(run_dir, "allocation_start")
    nodes, lost, peer = start["nodes"], str(start["train_nodes"][2]), str(start["train_nodes"][1])
    assert [nodes.index(n) for n in (peer, lost)] == [1, 2] and start["spares"] == [nodes[3]]
    # every agent's own log, those of the shared step too (each agent redirected its output)
    logs = os.path.join(run_dir, "submitit")
    for nr in range(4):
        assert glob.glob(os.path.join(logs, f"{job}_node{nr}_log.out")), sorted(os.listdir(logs))
    mark_fault(run_dir, "node_loss", node=lost, step=step)
    try:
        kill_node(env, lost)
        state = finish(job, env)
        assert state == "COMPLETED", f"job {job} ended {state}\n{diagnose(run_dir, job, env)}"
    finally:
        restore_node(env, lost)
    story = diagnose(run_dir, job, env)
    assert final(run_dir)["step"] > step, story
    assert not events(run_dir, "requeue"), story  # everything happened inside the allocation
    replaced = [d for d in events(run_dir, "decision") if d["action"] == "replace_node"]
    assert replaced and replaced[0]["exclude"] == [lost], story
    relaunched = [r["node"] for r in events(run_dir, "agent_relaunched")]
    assert relaunched in ([], [peer]), story  # srun kept the step's other task, or node 0 relaunched it
    assert lost not in {e["node"] for e in events(run_dir, "node_kept")}, story
    later = [e for e in events(run_dir, "ranks_started") if e["generation"] >= 1]
    assert lost not in {e["node"] for e in later} and peer in {e["node"] for e in later}, story
    # Slurm's accounting: three launch steps for four nodes (node 0's, the shared one, the
    # spare's), then a step of one node per relaunch
    res = subprocess.run(["sacct", "-j", job, "-n", "-P", "--format=JobID,NNodes"], env=env,
                         capture_output=True, text=True, timeout=60, check=True)
    steps: dict[int, int] = {}
    for row in res.stdout.split():
        jobid, nnodes = row.split("|")
        if jobid.startswith(f"{job}.") and jobid.split(".")[1].isdigit():
            steps[int(jobid.split(".")[1])] = int(nnodes)
    assert sorted(steps[i] for i in range(3)) == [1, 1, 2], res.stdout
    assert [steps[i] for i in sorted(steps) if i >= 3] == [1] * len(relaunched), res.stdout
