"""A short chaos campaign on the real local cluster: ``tools/chaos`` end to end.

Three fixed seeds, 3-4 faults each, 20 steps, a checkpoint every 4 steps, one reference run.
Together they inject every item of the menu at least once (asserted from the plans), three of
them inside the previous fault's restart: seed 60 hangs a rank (SIGSTOP), SIGKILLs two ranks
0.3 s apart, then a rank while the ranks restart, then aborts a rank with an NCCL error line;
seed 90 SIGKILLs a rank inside a save, kills the node of train slot 1 while the ranks restart,
then fills a node's NVMe tier (a real size-limited tmpfs: root needed); seed 213 SIGKILLs node
0's agent (its node lives: the successor requeues keeping it), sends the time-limit warning
while the next allocation's ranks start, then crashes the run's own S3 server while a
promotion is due. Steps last at least 1 s (``--step-delay-s 1``): on an idle machine
a 0.25 s step let a run pass the next fault's aim while the previous fault was still being
placed (an S3 outage is reported and undone in ~5 s), and the fault was never reached.
Every invariant must hold, the faults must be in the runs' ledgers as injected, and the
summary line must add up. The long campaign is `tools/chaos --seeds 1-50` (docs/chaos.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from slurmkit.ledger.ledger import read_ledger
from testkit.chaos.menu import BY_NAME
from testkit.chaos.plan import draw_plan

pytestmark = pytest.mark.integration
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHAOS = os.path.join(ROOT, "tools", "chaos")
SEEDS, STEPS, INTERVAL, MIN_FAULTS, MAX_FAULTS = [60, 90, 213], 20, 4, 3, 4
# The tiny model with its checkpoint of 60 MB (a kill inside a save needs a save that lasts),
# one sequence of 32 tokens a step: a sixteenth of the tokens of its default step, so four ranks
# stepping each second leave CPU to the rest of the suite.
SHAPE = ["--steps", str(STEPS), "--interval", str(INTERVAL), "--min-faults", str(MIN_FAULTS),
         "--max-faults", str(MAX_FAULTS), "--step-delay-s", "1",
         "--override", "train.micro_batch=1", "--override", "train.seq_len=32"]


@pytest.mark.timeout(1800)
def test_short_campaign_keeps_every_invariant(cluster_env, tmp_path) -> None:
    plans = [draw_plan(s, steps=STEPS, interval=INTERVAL, min_faults=MIN_FAULTS, max_faults=MAX_FAULTS)
             for s in SEEDS]
    # every item of the menu at least once, and faults inside a restart
    assert {f.kind for p in plans for f in p.faults} == set(BY_NAME), plans
    assert sum(f.moment == "during_restart" for p in plans for f in p.faults) >= 3, plans
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
    assert fields["runs"] == str(n) and fields["faults"] == str(sum(len(p.faults) for p in plans)), last
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
