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
COMMON = {"n", "store_rps", "fs_ops_per_step", "ledger_bytes_per_h", "ledger_bytes_per_h_est", "false_lost",
          "rps_per_agent", "load", "sizes"}
FIELDS = COMMON | {"detect_s", "decide_s", "notice_s", "stop_s", "node0_decide_s", "fanout_s", "node0_rpcs",
                   "detect_exp", "decide_exp", "store_rps_exp", "decide_cpu_s", "decide_busy_cores",
                   "steady_busy_cores", "cores", "agent_cpu_ms", "agent_cpu_max_ms"}


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
    # The CPU of the bench's processes in the decision window was read (a short window at N=8 may
    # hold no clock tick of 10 ms: zero is possible, a missing reading is not).
    assert int(fields["cores"]) == os.cpu_count(), fields
    assert float(fields["decide_cpu_s"]) >= 0 and float(fields["decide_busy_cores"]) >= 0, fields
    assert float(fields["steady_busy_cores"]) >= 0, fields
    # Each follower's own CPU from the failure to the decision was read (its thread's clock).
    assert 0 < float(fields["agent_cpu_ms"]) <= float(fields["agent_cpu_max_ms"]), fields
    # The decision's parts add up to it (one clock), and node 0's own part is the smallest.
    parts = float(fields["stop_s"]) + float(fields["node0_decide_s"]) + float(fields["fanout_s"])
    assert abs(parts - float(fields["decide_s"])) < 0.0025, fields  # four values, each rounded to 1 ms
    assert 0 <= float(fields["notice_s"]) <= float(fields["stop_s"]), fields
    assert float(fields["node0_decide_s"]) <= float(fields["decide_s"]), fields
    assert int(fields["node0_rpcs"]) > 0, fields
    # Each node writes the real agent's heartbeat samples: one record's size times their rate.
    assert float(fields["ledger_bytes_per_h_est"]) > 0, fields
    assert float(fields["store_rps"]) > 0 and float(fields["rps_per_agent"]) > 0, fields
    assert fields["false_lost"] == "0", res.stdout  # nobody is called lost while all beat
    assert fields["fs_ops_per_step"] == "0", res.stdout  # a rank's step never touches the run dir
    for name in ("detect_exp", "decide_exp", "store_rps_exp"):
        float(fields[name])  # two sizes give a slope
    assert "growth exponent in N" in res.stdout and "vs torchrun" in res.stdout, res.stdout
    # The run directories it made were removed.
    assert not [p for p in os.listdir(tmp_path) if p.startswith("cpbench-")], os.listdir(tmp_path)


@pytest.mark.timeout(300)
def test_control_plane_soak_mode_counts_false_losses_and_ledger_growth(tmp_path) -> None:
    # A short soak: no fault, a window long enough for the heartbeat samples (10 s at this N)
    # to reach the ledger file, so its measured growth is not zero.
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    cmd = [sys.executable, BENCH, "--sizes", "4", "--soak-s", "14", "--sample-ranks", "2", "--procs", "2",
           "--dir", str(tmp_path)]
    res = subprocess.run(cmd, cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=280)
    assert res.returncode == 0, res.stdout + res.stderr
    last = [ln for ln in res.stdout.splitlines() if ln.strip()][-1]
    assert last.startswith("RESULT mode=soak "), res.stdout
    fields = dict(kv.split("=", 1) for kv in last.split()[1:])
    assert set(fields) == COMMON | {"mode", "soak_s"}, fields
    assert fields["false_lost"] == "0" and fields["fs_ops_per_step"] == "0", res.stdout
    assert float(fields["ledger_bytes_per_h"]) > 0 and float(fields["ledger_bytes_per_h_est"]) > 0, fields
