"""The store.adopt benchmark still runs end to end against the real S3 server, and its repair
leaves the program's folder holding the saved bytes (it checks that itself; no timing
thresholds here)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from testkit.s3server import S3Server

pytestmark = pytest.mark.integration
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "tools", "bench", "adopt.py")
KEYS = ["adopt_s", "copy_s", "adopt_ratio", "putback_s", "refetch_s", "repair_speedup", "total_mib"]


def test_adopt_bench_compares_with_a_plain_copy_and_a_refetch(s3_server: S3Server, tmp_path) -> None:
    env = {**os.environ, **s3_server.env(), "TMPDIR": str(tmp_path)}
    res = subprocess.run([sys.executable, BENCH, "--ranks", "4", "--nodes", "2", "--mib", "2", "--runs", "2"],
                         cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = [ln for ln in res.stdout.splitlines() if ln.strip()]
    assert lines[-1].startswith("RESULT ") and sum(ln.startswith("RESULT") for ln in lines) == 1, res.stdout
    fields = {k: float(v) for k, v in (kv.split("=", 1) for kv in lines[-1].split()[1:])}
    assert list(fields) == KEYS and fields["total_mib"] == 8, fields
    assert fields["adopt_ratio"] == pytest.approx(fields["adopt_s"] / fields["copy_s"], rel=0.02)
    assert sum(ln.startswith("run ") for ln in lines) == 2, res.stdout
