"""A short chaos campaign on the real local cluster: ``tools/chaos`` end to end.

Two fixed seeds, 3 faults each, 20 steps, a checkpoint every 4 steps, one reference run:
seed 5 crashes the run's own S3 server so that a promotion to S3 meets the outage, then kills
the node of train slot 0, then SIGSTOPs a rank (a hang); seed 29 fills the NVMe tier of one
node (a real size-limited tmpfs: root needed), then SIGKILLs two ranks on two nodes 0.3 s
apart, then one rank. Steps last at least 1 s (``--step-delay-s 1``): on an idle machine a
0.25 s step let a run pass the next fault's aim while the previous fault was still being
placed (an S3 outage is reported and undone in ~5 s), and the fault was never reached.
Every invariant must hold, the
faults must be in the runs' ledgers as injected, and the summary line must add up. The long
campaign is `tools/chaos --seeds 1-50` (docs/chaos.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from slurmkit.supervise.ledger import read_ledger
from slurmkit.testing.chaos.plan import draw_plan

pytestmark = pytest.mark.integration
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHAOS = os.path.join(ROOT, "tools", "chaos")
SEEDS, STEPS, INTERVAL = [5, 29], 20, 4
SHAPE = ["--steps", str(STEPS), "--interval", str(INTERVAL), "--min-faults", "3", "--max-faults", "3",
         "--step-delay-s", "1"]


@pytest.mark.timeout(1800)
def test_short_campaign_keeps_every_invariant(cluster_env, tmp_path) -> None:
    plans = [draw_plan(s, steps=STEPS, interval=INTERVAL, min_faults=3, max_faults=3) for s in SEEDS]
    kinds = {f.kind for p in plans for f in p.faults}
    # the plans this test is about: the three tier faults among them
    assert {"s3_down_during_promotion", "node_loss", "rank_sigstop", "nvme_full", "two_at_once",
            "rank_sigkill"} <= kinds, kinds
    out = tmp_path / "runs.jsonl"
    env = {**os.environ, **cluster_env, "SLURMKIT_CLUSTER_DIR": os.environ.get("SLURMKIT_CLUSTER_DIR",
                                                                               "/tmp/slurmkit-cluster")}
    res = subprocess.run([sys.executable, CHAOS, "--seeds", ",".join(map(str, SEEDS)), *SHAPE,
                          "--run-root", str(tmp_path / "runs"), "--out", str(out)],
                         env=env, capture_output=True, text=True, timeout=1700)
    log = res.stdout[-12000:] + res.stderr[-4000:]
    assert res.returncode == 0, log
    last = [ln for ln in res.stdout.splitlines() if ln.strip()][-1]
    assert last.startswith("RESULT "), log
    fields = dict(kv.split("=", 1) for kv in last.split()[1:])
    n = len(SEEDS)
    assert fields["runs"] == str(n) and fields["faults"] == str(3 * n), last
    assert fields["survived"] == fields["bit_exact"] == str(n), last
    assert fields["healthy_excluded"] == "0" and fields["failed_seeds"] == "none", last
    assert int(fields["max_lost_steps"]) <= INTERVAL, last
    assert 0 < float(fields["goodput_median"]) <= 1, last

    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["seed"] for r in rows] == SEEDS
    for row, plan in zip(rows, plans):
        assert all(c["ok"] for c in row["checks"].values()), row
        injected = [e for e in read_ledger(os.path.join(row["run_dir"], "ledger.jsonl"))
                    if e["event"] == "fault_injected" and e.get("source") == "chaos"]
        assert [e["kind"] for e in injected] == [f.kind for f in plan.faults], injected
        assert "replay" in row and f"--seed {plan.seed}" in row["replay"]
