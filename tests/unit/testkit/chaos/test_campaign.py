"""The campaign's command line and summary, without a cluster."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import pytest

from testkit.chaos.campaign import RunSummary, main, parse_seeds, result_line
from testkit.chaos.driver import down_since
from testkit.chaos.invariants import Check, Verdict

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", ".."))


def summary(seed: int, *, ok: bool = True, lost: int = 2, healthy: int = 0, goodput: float = 0.5,
            injected: int = 4) -> RunSummary:
    checks = [Check("completes", ok, ""), Check("bit_exact", ok, ""), Check("lost_steps", True, "", lost),
              Check("healthy_excluded", healthy == 0, "", healthy), Check("no_leftover_processes", True, "", 0),
              Check("ledger_consistent", True, ""), Check("external", True, "", 0),
              Check("goodput", True, "", goodput)]
    return RunSummary(seed, injected, injected, Verdict(checks), f"tools/chaos --seed {seed}")


def test_seed_lists() -> None:
    assert parse_seeds("1-3,9") == [1, 2, 3, 9]
    assert parse_seeds("7") == [7]
    with pytest.raises(argparse.ArgumentTypeError):
        parse_seeds("a-3")


def test_result_line_sums_the_runs() -> None:
    line = result_line([summary(1, goodput=0.4), summary(2, ok=False, lost=3, goodput=0.6, injected=5),
                        summary(3, healthy=1, goodput=0.5)])
    assert line.startswith("RESULT ")
    fields = dict(kv.split("=") for kv in line.split()[1:])
    assert fields["runs"] == "3" and fields["faults"] == "13"
    assert fields["survived"] == "2" and fields["bit_exact"] == "2"
    assert fields["max_lost_steps"] == "3" and fields["healthy_excluded"] == "1"
    assert fields["goodput_median"] == "0.500"
    assert fields["failed_seeds"] == "2,3"


def test_node_down_events_since_the_run_started() -> None:
    out = ("|2026-12-01T15:33:38|Unknown\n"
           "node1|2026-12-01T15:43:46|DOWN*\n"
           "node3|2026-12-01T15:36:18|DOWN*\n"
           "node4|2026-12-01T15:50:00|DRAIN\n")
    since = time.mktime(time.strptime("2026-12-01T15:40:00", "%Y-%m-%dT%H:%M:%S"))
    assert down_since(out, since) == {"node1"}


def test_plan_only_prints_the_plans_and_touches_no_cluster() -> None:
    out: list[str] = []
    assert main(["--seeds", "1-3", "--plan-only"], say=out.append) == 0
    assert [line.split(":")[0] for line in out] == ["seed 1", "seed 2", "seed 3"]


def test_a_run_too_short_for_its_faults_is_said_in_one_line() -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--seeds", "1", "--steps", "20", "--plan-only"], say=lambda _: None)
    assert str(exc.value).startswith("chaos: steps=20 with interval=4") and "raise steps to 28" in str(exc.value)


def test_the_tool_runs_from_a_checkout() -> None:
    res = subprocess.run([sys.executable, os.path.join(REPO, "tools", "chaos"), "--menu"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    rows = {line.split()[0]: line.split()[1] for line in res.stdout.splitlines() if line.strip()}
    assert rows["node_loss"] == rows["nvme_full"] == rows["s3_down_during_promotion"] == "yes", res.stdout


def test_a_failed_attempt_ends_the_job_only_once_it_stays_failed() -> None:
    from testkit.chaos.driver import SETTLE_S, settled

    assert settled("COMPLETED", None, 0.0) and settled("CANCELLED by 0", None, 0.0)
    assert not settled("RUNNING", None, 0.0) and not settled("PENDING", 5.0, 100.0)
    assert not settled("NODE_FAIL", 100.0, 100.0 + SETTLE_S - 1)
    assert settled("NODE_FAIL", 100.0, 100.0 + SETTLE_S)


def test_summarize_gives_the_result_line_of_saved_runs(tmp_path) -> None:
    runs = [summary(1, goodput=0.4), summary(2, ok=False, lost=3, goodput=0.6, injected=5)]
    out = tmp_path / "runs.jsonl"
    out.write_text("".join(r.to_json() + "\n" for r in runs))
    said: list[str] = []
    assert main(["--summarize", str(out)], say=said.append) == 1
    assert said == [result_line(runs)]


def test_only_a_down_near_the_node_loss_makes_it_external() -> None:
    """Seen in seed 2: node 1's agent called node 0 lost 7 s after the job's own end; node 0
    went DOWN (someone else's kill) two minutes later. That later DOWN excuses nothing."""
    from testkit.chaos.driver import external_losses

    failure = [{"t": 1000.0, "event": "failure", "cls": "node_loss", "node": "node2"}]
    assert external_losses(failure, [("node2", 1040.0)], set()) == {"node2"}
    assert external_losses(failure, [("node2", 1200.0)], set()) == frozenset()
    assert external_losses(failure, [("node2", 1040.0)], {"node2"}) == frozenset()  # ours
    assert external_losses(failure, [("node3", 1040.0)], set()) == frozenset()
