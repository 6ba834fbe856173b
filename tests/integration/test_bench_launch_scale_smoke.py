"""The launch benchmark runs end to end on the local cluster's nodes: real jobs, real srun steps,
the real launch lines; its RESULT line complete and its counts what each shape must cost.

No timing thresholds: only the counts are checked (one step create per step, every agent
started, the emulated counts and their growth)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "tools", "bench", "launch_scale.py")


@pytest.mark.timeout(600)
def test_launch_scale_bench_on_the_local_cluster(cluster_env, tmp_path) -> None:
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    cmd = [sys.executable, BENCH, "--rounds", "1", "--nodes", "4", "--group", "2", "--emulate", "64,2048"]
    res = subprocess.run(cmd, cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=540)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = [ln for ln in res.stdout.splitlines() if ln.strip()]
    assert lines[-1].startswith("RESULT ") and sum(ln.startswith("RESULT") for ln in lines) == 1, res.stdout
    f = dict(kv.split("=", 1) for kv in lines[-1].split()[1:])
    # node 0 alone, nodes 1-2 together, node 3 alone: 3 step creates for 4 nodes; one per node: 4; one step: 1
    assert (f["nodes"], f["group"], f["step_creates"], f["per_node_step_creates"], f["single_step_creates"]) == (
        "4", "2", "3", "4", "1"), f
    assert int(f["sruns"]) >= 1 and int(f["per_node_sruns"]) >= 1, f  # the most seen at once: node 0's at least
    assert (f["emulated_nodes"], f["emulated_step_creates"], f["emulated_per_node_step_creates"]) == (
        "2048", "17", "2048"), f
    assert float(f["step_creates_exp"]) == 0.0 and float(f["per_node_step_creates_exp"]) == 1.0, f
    assert all(float(f[k]) > 0 for k in ("start_all_s", "per_node_start_all_s", "single_start_all_s")), f
