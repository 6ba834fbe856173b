"""The submit-latency benchmark still runs end to end on the local cluster (no timing thresholds)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.integration.helpers import slurm_env, wait_terminal

pytestmark = pytest.mark.integration
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "tools", "bench", "submit_latency.py")
KEYS = ["submit_median_s", "sbatch_median_s", "overhead_s", "ratio"]


def test_submit_latency_bench_prints_result_and_cancels_its_jobs(cluster_env, tmp_path) -> None:
    env_path = tmp_path / "env.json"
    env_path.write_text(json.dumps(cluster_env))
    env = slurm_env(cluster_env)
    res = subprocess.run([sys.executable, BENCH, "--runs", "2", "--cluster-env", str(env_path)],
                         cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = [ln for ln in res.stdout.splitlines() if ln.strip()]
    assert lines and lines[-1].startswith("RESULT "), res.stdout
    assert sum(ln.startswith("RESULT") for ln in lines) == 1
    fields = dict(kv.split("=", 1) for kv in lines[-1].split()[1:])
    assert list(fields) == KEYS, fields
    values = {k: float(v) for k, v in fields.items()}
    assert all(v > 0 for v in values.values()), values
    assert values["ratio"] == pytest.approx(values["submit_median_s"] / values["sbatch_median_s"], rel=0.02)
    # Two timed submissions per variant, alternating, each with the job id it got.
    runs = re.findall(r"^run (\d)/2 (slurmkit|sbatch)\s+([\d.]+) s\s+job (\d+)$", res.stdout, re.M)
    assert [r[1] for r in runs] == ["slurmkit", "sbatch"] * 2, res.stdout
    # Every job it submitted was cancelled, none left to train on the cluster.
    for _, _, _, job_id in runs:
        assert wait_terminal(job_id, env, timeout_s=60) == "CANCELLED", job_id
