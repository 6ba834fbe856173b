"""The control-plane benchmark still runs end to end at small N: real supervisor loops and
channels over a real TCPStore, one agent lost per size, its RESULT line complete.

No timing thresholds: the figures have to exist and make sense (a loss is detected and decided,
nothing is called lost in the fault-free window, and a rank's heartbeat, written where the real
agent tells it to, makes no shared-file-system operation per step).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "tools", "bench", "control_plane.py")
FIELDS = {"n", "detect_s", "decide_s", "store_rps", "fs_ops_per_step", "ledger_bytes_per_h", "false_lost",
          "rps_per_agent", "node0_decide_s", "detect_exp", "decide_exp", "store_rps_exp", "sizes"}


@pytest.mark.timeout(600)
def test_control_plane_bench_small_sizes(tmp_path) -> None:
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    cmd = [sys.executable, BENCH, "--sizes", "4,8", "--steady-s", "2", "--sample-ranks", "2", "--procs", "2",
           "--dir", str(tmp_path)]
    res = subprocess.run(cmd, cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=540)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = [ln for ln in res.stdout.splitlines() if ln.strip()]
    assert lines and lines[-1].startswith("RESULT "), res.stdout + res.stderr
    assert sum(ln.startswith("RESULT") for ln in lines) == 1, res.stdout
    fields = dict(kv.split("=", 1) for kv in lines[-1].split()[1:])
    assert set(fields) == FIELDS, fields
    assert fields["n"] == "8" and fields["sizes"] == "4,8", fields  # both sizes ran
    assert float(fields["detect_s"]) > 0 and float(fields["decide_s"]) > 0, fields
    assert float(fields["node0_decide_s"]) <= float(fields["decide_s"]), fields
    assert float(fields["store_rps"]) > 0 and float(fields["rps_per_agent"]) > 0, fields
    assert fields["false_lost"] == "0", res.stdout  # nobody is called lost while all beat
    assert fields["fs_ops_per_step"] == "0", res.stdout  # a rank's step never touches the run dir
    for name in ("detect_exp", "decide_exp", "store_rps_exp"):
        float(fields[name])  # two sizes give a slope
    assert "growth exponent in N" in res.stdout and "vs torchrun" in res.stdout, res.stdout
    # The run directories it made were removed.
    assert not [p for p in os.listdir(tmp_path) if p.startswith("cpbench-")], os.listdir(tmp_path)
