"""A program that is not slurmkit's on the real local Slurm cluster: it finds its rank and world
from Slurm's task variables (as Lightning and submitit do), forms a real gloo group from them,
and runs longer than supervisor.startup_timeout_s without ever writing a heartbeat. It must see
world size 4 and distinct, correct ranks, and complete without any failure verdict."""

from __future__ import annotations

import json
import os

import pytest

from tests.integration.helpers import parse_submitted, read_ledger, slurm_env, submit_cli, wait_terminal
from tests.integration.test_topology_slurm import _logs

pytestmark = pytest.mark.integration
PROBE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "slurm_task_probe.py")
STARTUP_S = 15  # the program runs 25 s past forming its group, and never beats


def test_a_program_without_beats_sees_its_slurm_task_and_completes(cluster_env, tmp_path) -> None:
    env = slurm_env(cluster_env)
    res = submit_cli(["+exp=tiny", "job.name=slurmtask", "job.nodes=2", "job.ranks_per_node=2",
                      f"job.command=[python,{PROBE},'25']", f"supervisor.startup_timeout_s={STARTUP_S}",
                      f"submit.run_root={tmp_path}"], env, str(tmp_path))
    assert res.returncode == 0, res.stdout + res.stderr
    job_id, run_dir = parse_submitted(res.stdout)
    state = wait_terminal(job_id, env)
    records = {}
    for rank in range(4):
        path = os.path.join(run_dir, "slurm_task", f"rank{rank}.json")
        assert os.path.exists(path), f"rank {rank} wrote no record (job {state}): " + _logs(run_dir)
        with open(path) as f:
            records[rank] = json.load(f)
    nodes = set()
    for rank, r in records.items():
        slot, local = divmod(rank, 2)
        assert r["submitit"] == [rank, local, 4, slot], r
        assert r["torch"] == [rank, 4] and r["rank_sum"] == 6.0 and r["RANK"] == str(rank)
        s = r["slurm"]
        assert (s["SLURM_NTASKS"], s["SLURM_NTASKS_PER_NODE"], s["SLURM_NODEID"]) == ("4", "2", str(slot))
        assert s["SLURM_JOB_ID"] == job_id.split("_")[0]  # the job's own variables are Slurm's
        assert r["rounds"] > 0
        nodes.add(r["SLURMKIT_NODE"])
    assert len(nodes) == 2
    events = read_ledger(run_dir)
    assert [e for e in events if e.get("event") == "failure"] == [], [e for e in events if e.get("event") == "failure"]
    assert state == "COMPLETED", _logs(run_dir)
