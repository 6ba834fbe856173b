"""Where the driver places a fault, read from a real ledger file (no cluster: the job's Slurm
state comes from a stand-in, the ledger is written by the real Ledger writer)."""

from __future__ import annotations

import os

import pytest

from slurmkit.supervise.ledger import Ledger
from slurmkit.testing.chaos.driver import Cluster, Driver, RunOver
from slurmkit.testing.chaos.plan import PlannedFault, draw_plan


class StandIn(Cluster):
    def __init__(self, state: str = "RUNNING") -> None:
        super().__init__(env={}, repo="/nonexistent", say=lambda s: None)
        self.state = state

    def job_state(self, job_id: str) -> str:
        return self.state


def driver(tmp_path, events: list[tuple[float, str, dict]], state: str = "RUNNING") -> Driver:
    clock = iter(t for t, _, _ in events)
    ledger = Ledger(os.path.join(tmp_path, "ledger.jsonl"), source="agent:node1", clock=lambda: next(clock))
    for _, name, fields in events:
        ledger.append(name, **fields)
    d = Driver(StandIn(state), draw_plan(1), str(tmp_path), "0" * 64)
    d.job_id, d.run_dir = "7", str(tmp_path)
    return d


RUN = [(1.0, "train_started", {"step": 0, "generation": 0}),
       (2.0, "ckpt_saved", {"step": 4, "tier": "nvme"}),
       (2.1, "ckpt_durable", {"step": 4, "tier": "lustre"}),
       (3.0, "ckpt_saved", {"step": 8, "tier": "nvme"}),
       (4.0, "failure", {"cls": "rank_crash", "generation": 0}),
       (4.1, "decision", {"action": "restart", "generation": 0}),
       (5.0, "ranks_started", {"generation": 1, "node": "node1"}),
       (6.0, "train_started", {"step": 8, "generation": 1}),
       (7.0, "ckpt_saved", {"step": 12, "tier": "nvme"})]


def test_after_save_counts_checkpoints_since_training_resumed_after_the_previous_fault(tmp_path) -> None:
    d = driver(tmp_path, RUN)
    assert d.wait_after_save(PlannedFault("rank_sigkill", "after_save", saves=2, offset=1), since=0.0) == 9
    # After the fault at t=3.5 training resumed from 8 (t=6): the first new checkpoint is 12.
    assert d.wait_after_save(PlannedFault("rank_sigkill", "after_save", saves=1, offset=3), since=3.5) == 15


def test_during_restart_waits_for_the_decision_then_the_next_ranks(tmp_path) -> None:
    d = driver(tmp_path, RUN)
    assert d.wait_restarting(since=3.5) == pytest.approx(5.0)
    assert d.phase(5.0) == "training"  # train_started at t=6 came after the ranks of t=5
    assert d.phase(6.5) == "restarting"


def test_a_trigger_that_never_comes_ends_when_the_job_ends(tmp_path) -> None:
    d = driver(tmp_path, RUN, state="COMPLETED")
    with pytest.raises(RunOver, match=r"2 checkpoint\(s\) after step 8"):
        d.wait_after_save(PlannedFault("rank_sigkill", "after_save", saves=2, offset=1), since=3.5)
    with pytest.raises(RunOver, match="training to resume"):
        d.wait_after_save(PlannedFault("rank_sigkill", "after_save", saves=1, offset=1), since=6.5)


def test_a_finished_run_is_judged_again_from_its_directory(tmp_path) -> None:
    from slurmkit.testing.chaos.driver import facts_from_run_dir
    from slurmkit.testing.chaos.invariants import verdict

    (tmp_path / "config.yaml").write_text("train:\n  steps: 12\n  ckpt_interval_steps: 4\n")
    (tmp_path / "final.json").write_text('{"step": 12, "param_sha256": "' + "c" * 64 + '"}')
    (tmp_path / "ckpt" / "shared" / "step_0000000012").mkdir(parents=True)
    events = [(1.0, "allocation_start", {"nodes": ["node1", "node2"]}),
              (2.0, "ranks_started", {"generation": 0, "node": "node1"}),
              (3.0, "train_started", {"step": 0, "generation": 0}),
              (4.0, "ckpt_saved", {"step": 4, "tier": "nvme"}),
              (5.0, "fault_injected", {"kind": "node_loss", "time": 5.0, "step": 6, "node": "node2"}),
              (6.0, "failure", {"cls": "node_loss", "node": "node2", "generation": 0}),
              (6.1, "decision", {"action": "requeue", "generation": 0, "exclude": ["node2"]}),
              (6.2, "exclusion", {"nodes": ["node2"], "how": "requeue"}),
              (6.3, "requeue", {"reason": "node loss", "exclude": ["node2"]}),
              (9.0, "allocation_start", {"nodes": ["node1", "node3"]}),
              (10.0, "train_started", {"step": 4, "generation": 0}),
              (11.0, "ckpt_saved", {"step": 12, "tier": "nvme", "promote_to": ["lustre"]}),
              (11.5, "ckpt_durable", {"step": 12, "tier": "lustre"}),
              (12.0, "end", {"status": "completed", "exit_code": 0})]
    d = driver(tmp_path, events)
    # The driver's own fault record is written with source "chaos", as Driver.mark does.
    lines = (tmp_path / "ledger.jsonl").read_text().replace('"source": "agent:node1", "kind"', '"source": "chaos", "kind"')
    (tmp_path / "ledger.jsonl").write_text(lines)
    facts = facts_from_run_dir(d.run_dir, "c" * 64, job_state="COMPLETED")
    assert (facts.steps, facts.interval, facts.killed_nodes) == (12, 4, frozenset({"node2"}))
    assert [(i.kind, i.step) for i in facts.injected] == [("node_loss", 6)]
    v = verdict(facts)
    assert v.ok, [(c.name, c.detail) for c in v.checks if not c.ok]
    assert v.get("lost_steps").value == 2


def test_the_overrides_of_a_campaign_run_render_through_the_real_submit(tmp_path) -> None:
    """Whole nodes and the armed NCCL faults reach the script (submit.emit=sbatch: no cluster)."""
    import subprocess
    import sys

    from slurmkit.testing.chaos.driver import overrides
    from slurmkit.testing.chaos.plan import armed_spec

    plan = next(p for p in map(draw_plan, range(50)) if any(f.kind == "nccl_abort" for f in p.faults))
    args = overrides(plan, step_delay_s=0.25, name="chaos-render", exclusive=True)
    res = subprocess.run([sys.executable, "-m", "slurmkit.submit", *args, "submit.emit=sbatch",
                          f"submit.run_root={tmp_path}"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    script = next(os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs if f == "job.sbatch")
    text = open(script).read()
    assert "#SBATCH --exclusive" in text
    assert armed_spec(plan) in text
