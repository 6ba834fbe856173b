"""The MTTR benchmark still runs end to end on the local cluster: one real SIGKILL, measured.

No timing thresholds: the figures only have to exist and be positive, and the job it used must
be gone afterwards.
"""

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
BENCH = os.path.join(ROOT, "tools", "bench", "mttr.py")


@pytest.mark.timeout(600)
def test_mttr_bench_measures_a_rank_crash(cluster_env, tmp_path) -> None:
    env_path = tmp_path / "env.json"
    env_path.write_text(json.dumps(cluster_env))
    env = {**slurm_env(cluster_env), "TMPDIR": str(tmp_path)}
    res = subprocess.run([sys.executable, BENCH, "--classes", "crash", "--skip-baseline", "--skip-goodput",
                          "--cluster-env", str(env_path)], cwd=str(tmp_path), env=env,
                         capture_output=True, text=True, timeout=540)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = [ln for ln in res.stdout.splitlines() if ln.strip()]
    assert lines and lines[-1].startswith("RESULT "), res.stdout + res.stderr
    assert sum(ln.startswith("RESULT") for ln in lines) == 1, res.stdout
    fields = dict(kv.split("=", 1) for kv in lines[-1].split()[1:])
    assert set(fields) == {"crash_detect_s", "crash_resume_s", "crash_baseline_resume_s", "goodput"}, fields
    detect, resume = float(fields["crash_detect_s"]), float(fields["crash_resume_s"])
    assert detect > 0 and resume > detect, (detect, resume, res.stdout)
    assert fields["crash_baseline_resume_s"] == "na" and fields["goodput"] == "na", fields
    # The supervisor classified the SIGKILL as a rank crash and restarted in the allocation.
    run = re.search(r"^crash\s+slurmkit\s+#1 .* job (\d+) rank_crash/restart\s", res.stdout, re.M)
    assert run, res.stdout
    assert wait_terminal(run.group(1), env, timeout_s=120) in ("CANCELLED", "COMPLETED")
    # The run directories were removed (no --keep).
    assert not [p for p in os.listdir(tmp_path) if p.startswith("mttr-")], os.listdir(tmp_path)
