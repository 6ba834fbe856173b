"""Per-rank pinning on the real local Slurm cluster: what the kernel reports equals the plan.

The node agent plans each local rank (slurmkit.topology) and starts it through the pin
wrapper; tests/integration/affinity_probe.py, run as the rank program, records the kernel's
view of its own affinity and memory policy next to the plan it was handed (SLURMKIT_CPUS,
SLURMKIT_MEM_NODES). The emulated nodes share this machine's CPUs, so the ranks of one node
must split them without overlap.
"""

from __future__ import annotations

import json
import os
import re
from collections import defaultdict

import pytest

from tests.integration.helpers import parse_submitted, slurm_env, submit_cli, wait_terminal

pytestmark = pytest.mark.integration
PROBE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "affinity_probe.py")


def cpuset(text: str) -> set[int]:
    """A kernel CPU list ("0-2,5") as a set; independent of slurmkit's own parser on purpose."""
    out: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def run_probe(cluster_env: dict[str, str], tmp_path, nodes: int) -> tuple[str, list[dict]]:
    """Submit the probe as a nodes x 2 job, wait for it; (final state, one record per rank)."""
    env = slurm_env(cluster_env)
    res = submit_cli(["+exp=tiny", "job.name=affinity", f"job.nodes={nodes}", "job.ranks_per_node=2",
                      f"job.command=[python,{PROBE}]", f"submit.run_root={tmp_path}"],
                     env, str(tmp_path))
    assert res.returncode == 0, res.stdout + res.stderr
    job_id, run_dir = parse_submitted(res.stdout)
    state = wait_terminal(job_id, env)
    records = []
    for rank in range(nodes * 2):
        path = os.path.join(run_dir, "affinity", f"rank{rank}.json")
        assert os.path.exists(path), f"rank {rank} wrote no record (job {state}); logs: " + _logs(run_dir)
        with open(path) as f:
            records.append(json.load(f))
    return state, records


def _logs(run_dir: str) -> str:
    logs = os.path.join(run_dir, "logs")
    if not os.path.isdir(logs):
        return "(no logs directory)"
    parts = []
    for name in sorted(os.listdir(logs)):
        with open(os.path.join(logs, name), errors="replace") as f:
            parts.append(f"--- {name}\n{f.read()[-2000:]}")
    return "\n".join(parts)


def check_pinning(records: list[dict], nodes: int) -> None:
    machine = os.sched_getaffinity(0)
    by_node: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        plan = cpuset(r["SLURMKIT_CPUS"] or "")
        kernel = cpuset(r["cpus_allowed_list"])
        assert plan, f"rank {r['rank']} got no CPU plan: {r}"
        assert kernel == plan, f"rank {r['rank']}: Cpus_allowed_list {kernel} != plan {plan}"
        assert set(r["sched_getaffinity"]) == plan
        assert plan <= machine
        assert int(r["OMP_NUM_THREADS"]) >= 1
        # Memory: the plan's nodes are allowed, and the task policy is the planned one.
        mem_nodes = cpuset(r["SLURMKIT_MEM_NODES"] or "")
        assert mem_nodes and mem_nodes <= cpuset(r["mems_allowed_list"]), r
        if r["SLURMKIT_MEM_POLICY"] == "preferred":
            m = re.search(r"prefer[^:]*:(\S+)", r["mempolicy"])
            assert m and cpuset(m.group(1)) == mem_nodes, f"rank {r['rank']} mempolicy {r['mempolicy']!r}"
        by_node[r["node"]].append(r)
    assert len(by_node) == nodes, {k: [r["rank"] for r in v] for k, v in by_node.items()}
    for node, ranks in by_node.items():
        assert sorted(r["local_rank"] for r in ranks) == [0, 1], node
        a, b = (cpuset(r["cpus_allowed_list"]) for r in ranks)
        assert not a & b, f"{node}: ranks share CPUs {a & b}"
        if len(machine) == 2:
            # The 2-CPU development VM: one CPU each, together all of them (0 and 1).
            assert a | b == machine and len(a) == len(b) == 1, (a, b)


def test_two_ranks_on_one_node_get_their_planned_disjoint_cpus(cluster_env, tmp_path) -> None:
    state, records = run_probe(cluster_env, tmp_path, nodes=1)
    check_pinning(records, nodes=1)
    assert state == "COMPLETED"


def test_two_nodes_two_ranks_each_pinned_per_node(cluster_env, tmp_path) -> None:
    state, records = run_probe(cluster_env, tmp_path, nodes=2)
    check_pinning(records, nodes=2)
    assert sorted(r["rank"] for r in records) == [0, 1, 2, 3]
    assert state == "COMPLETED"
