"""Agents in srun steps of several nodes (launch.nodes_per_step=2) on the real local cluster: a
shared step that cannot be created, then a node of it lost for real (slurmd and the job's
processes SIGKILLed). One job, the standalone script (submit.emit=sbatch) as a site submits it.

Three train nodes and a spare: node 0's agent in its own step, node ranks 1 and 2 in one step,
the spare in its own. The shared step's srun names a node Slurm does not know, so it fails
("Unable to create step" or "Invalid node name"): no agent of node ranks 1-2 ever starts. The
batch script says so at once (slurmkit/supervise/stepsended.py) and node 0 relaunches both
agents in one srun step of their two nodes, instead of waiting out two first-beat deadlines
(2 x startup_timeout_s = 600 s by default). Then node rank 2 dies: the spare takes its slot, no
requeue, node rank 1 trains on, and training completes.

What happens to the relaunched step's other agent when node rank 2 dies is srun's choice: with
spares the steps run with --no-kill, and Slurm 22.05 here keeps the step's other task running
(measured: the job RESIZING without the node, "srun: error: Node failure on node3", no "Force
Terminated"); without --no-kill it ends the whole step once the node is DOWN, and a site may
see an I/O error end it either way. Then node 0 relaunches that agent again
(supervisor.agent_relaunches=2 here): the test accepts both. The decision that relaunches the
healthy agents of a step in the same decision that gives the dead node's slot to a spare is
tested in tests/unit/supervise/test_relaunch.py.
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from tests.integration.faults import (
    COMMON, diagnose, events, final, finish, kill_node, mark_fault, restore_node, wait_for_step,
)
from tests.integration.helpers import run_as_submitter, slurm_env, submit_cli

pytestmark = pytest.mark.integration


def test_a_shared_step_that_fails_to_start_and_a_node_lost_from_it(cluster_env, tmp_path) -> None:
    env = slurm_env(cluster_env)
    # health=off: a pre-flight link test on this loaded machine may give the spare away first
    res = submit_cli([*COMMON, "job.name=lg", "job.nodes=3", "supervisor.spare_nodes=1", "health=off",
                      "launch.nodes_per_step=2", "supervisor.agent_relaunches=2", "submit.emit=sbatch",
                      f"submit.run_root={tmp_path}"], env, str(tmp_path))
    assert res.returncode == 0, res.stdout + res.stderr
    found = re.search(r"wrote (\S+job\.sbatch)", res.stdout)
    assert found, res.stdout
    script, run_dir = found.group(1), os.path.dirname(found.group(1))
    with open(script) as f:
        lines = f.read().split("\n")
    (shared,) = [i for i, ln in enumerate(lines) if ln.lstrip().startswith("SLURMKIT_GROUP_LOG_DIR=")]
    assert '--nodelist="$SLURMKIT_LIST"' in lines[shared]
    lines[shared] = lines[shared].replace('--nodelist="$SLURMKIT_LIST"', "--nodelist=nosuchnode")
    with open(script, "w") as f:
        f.write("\n".join(lines))
    sb = run_as_submitter(["sbatch", "--parsable", script], env, str(tmp_path), timeout_s=60)
    assert sb.returncode == 0, sb.stdout + sb.stderr
    job = sb.stdout.strip().split(";")[0]

    step = wait_for_step(run_dir, 5, 13)  # a rank of node rank 2: its relaunched agent trains
    (start,) = events(run_dir, "allocation_start")
    nodes, lost, peer = start["nodes"], str(start["train_nodes"][2]), str(start["train_nodes"][1])
    assert [nodes.index(n) for n in (peer, lost)] == [1, 2] and start["spares"] == [nodes[3]]
    first = events(run_dir, "failure")[0]
    assert "its srun step (node ranks 1-2) ended with code" in first["evidence"], first
    assert first["t"] - start["t"] < 60, (first, start)  # said at once, not after 2 x startup_timeout_s
    relaunched = events(run_dir, "agent_relaunched")
    assert sorted(r["node"] for r in relaunched) == sorted([peer, lost]), relaunched
    assert relaunched[0]["command"] == relaunched[1]["command"]  # one srun step for both
    assert "--nodes=2" in relaunched[0]["command"]
    for nr in range(4):  # each agent's log where a step of one node would have put it
        assert os.path.exists(os.path.join(run_dir, "logs", f"{job}_node{nr}_log.out")), os.listdir(
            os.path.join(run_dir, "logs"))

    mark_fault(run_dir, "node_loss", node=lost, step=step)
    try:
        kill_node(env, lost)
        state = finish(job, env, run_dir=run_dir)
        assert state == "COMPLETED", f"job {job} ended {state}\n{diagnose(run_dir, job, env)}"
    finally:
        restore_node(env, lost)
    story = diagnose(run_dir, job, env)
    assert final(run_dir)["step"] > step, story
    assert not events(run_dir, "requeue"), story  # everything happened inside the allocation
    replaced = [d for d in events(run_dir, "decision") if d["action"] == "replace_node"]
    assert replaced and replaced[0]["exclude"] == [lost], story
    later = [r["node"] for r in events(run_dir, "agent_relaunched")[2:]]
    assert later in ([], [peer]), story  # srun kept the step's other task, or node 0 relaunched it
    after = [e for e in events(run_dir, "ranks_started") if e["generation"] >= 2]
    assert lost not in {e["node"] for e in after} and peer in {e["node"] for e in after}, story
    # Slurm's accounting: node 0's step and the spare's (the shared one was never created), the
    # relaunch of both agents in one step of two nodes, then a step of one node per later relaunch
    res2 = subprocess.run(["sacct", "-j", job, "-n", "-P", "--format=JobID,NNodes"], env=env,
                          capture_output=True, text=True, timeout=60, check=True)
    steps: dict[int, int] = {}
    for row in res2.stdout.split():
        jobid, nnodes = row.split("|")
        if jobid.startswith(f"{job}.") and jobid.split(".")[1].isdigit():
            steps[int(jobid.split(".")[1])] = int(nnodes)
    assert sorted(steps.values()) == sorted([1, 1, 2] + [1] * len(later)), res2.stdout
