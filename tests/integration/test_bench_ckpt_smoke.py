"""The checkpoint benchmark still runs end to end against the real S3 server (no timing
thresholds: it must finish, compare every method, and find every restore bit-exact)."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest

from testkit.s3server import S3Server

pytestmark = pytest.mark.integration
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "tools", "bench", "ckpt.py")
RATIOS = ["block_ratio_vs_dcp", "durable_vs_dd", "restore_vs_dcp_load", "buddy_vs_shared",
          "obj_up_vs_s3fs",
          "obj_fetch_vs_s3fs_get", "obj_restore_vs_s3fs_get_load"]


def test_ckpt_bench_compares_every_method_and_restores_bit_exact(tmp_path: Any,
                                                                s3_server: S3Server) -> None:
    env = {**os.environ, **s3_server.env()}
    res = subprocess.run([sys.executable, BENCH, "--size-gb", "0.02", "--saves", "2",
                          "--dir", str(tmp_path / "work")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    lines = [ln for ln in res.stdout.splitlines() if ln.strip()]
    assert lines[-1].startswith("RESULT ") and sum(ln.startswith("RESULT") for ln in lines) == 1
    fields = dict(kv.split("=", 1) for kv in lines[-1].split()[1:])
    assert fields["bit_exact"] == "1" and fields["obj_bit_exact"] == "1", fields
    assert fields["buddy_bit_exact"] == "1", fields  # the spare restored through the buddy
    assert fields["checksum"] == "crc32"
    for key in RATIOS:
        assert float(fields[key]) > 0, (key, fields)
    # secrets never reach the output
    assert s3_server.secret_key not in res.stdout + res.stderr
