"""The GPU check rehearses on CPU end to end: the real submit path with cluster=local, its probe
as the job's program, the trainer's metrics read back; its RESULT line complete.

No timing thresholds: only that each section produced its figures (a pin probe with the CPUs
the agent gave, an MFU read from metrics.jsonl for both the eager and the compiled trainer)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "tools", "bench", "gpu_check.py")


@pytest.mark.timeout(600)
def test_gpu_check_rehearses_on_cpu(tmp_path) -> None:
    cmd = [sys.executable, BENCH, "--rehearse", "--work", str(tmp_path), "--steps", "6", "--skip", "2",
           "--sections", "pin,mfu,compiled"]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=540)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = [ln for ln in res.stdout.splitlines() if ln.strip()]
    assert lines[-1].startswith("RESULT "), res.stdout
    f = dict(kv.split("=", 1) for kv in lines[-1].split()[1:])
    assert f["gpu"] == "0" and f["pin_rc"] == "0" and f["pin_device"] == "cpu", res.stdout
    allowed = sorted(os.sched_getaffinity(0))
    assert f["pin_cpus"] in (f"{allowed[0]}-{allowed[-1]}", str(allowed[0])), res.stdout  # the agent's plan
    for tag in ("eager", "compiled"):
        assert f[f"mfu_{tag}_rc"] == "0" and 0 < float(f[f"mfu_{tag}"]) < 1, res.stdout
        assert float(f[f"tokens_per_s_{tag}"]) > 0
