"""Where the driver places a fault, read from a real ledger file (no cluster: the job's Slurm
state comes from a stand-in, the ledger is written by the real Ledger writer)."""

from __future__ import annotations

import os

import pytest

from slurmkit.ledger.ledger import Ledger
from testkit.chaos.driver import Cluster, Driver, RunOver
from testkit.chaos.plan import PlannedFault, draw_plan


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
    from testkit.chaos.driver import facts_from_run_dir
    from testkit.chaos.invariants import verdict

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

    from testkit.chaos.driver import overrides
    from testkit.chaos.plan import armed_spec

    plan = next(p for p in map(draw_plan, range(50)) if any(f.kind == "nccl_abort" for f in p.faults))
    args = overrides(plan, step_delay_s=0.25, name="chaos-render", exclusive=True,
                     object_uri="s3://checkpoints/chaos/$SLURMKIT_RUN_ID")
    res = subprocess.run([sys.executable, "-m", "slurmkit.submit", *args, "submit.emit=sbatch",
                          f"submit.run_root={tmp_path}"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    script = next(os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs if f == "job.sbatch")
    text = open(script).read()
    assert "#SBATCH --exclusive" in text
    assert armed_spec(plan) in text
    import yaml

    config = next(os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs if f == "config.yaml")
    with open(config) as f:
        store = yaml.safe_load(f)["store"]
    assert store["object_uri"] == "s3://checkpoints/chaos/$SLURMKIT_RUN_ID" and store["object_every_saves"] == 1


class Ranks(Driver):
    """The driver with its rank processes given (a real child process stands in for rank 0)."""

    procs: dict = {}

    def ranks(self):  # type: ignore[override]
        return self.procs


def in_save_driver(tmp_path, child) -> Ranks:
    from testkit.chaos.procs import Proc

    (tmp_path / "config.yaml").write_text("store:\n  nvme_uri: $SLURMKIT_RUN_DIR/ckpt/nvme\n")
    d = Ranks(StandIn(), draw_plan(1, steps=32, interval=4), str(tmp_path), "0" * 64)
    d.job_id, d.run_dir = "7", str(tmp_path)
    d.procs = {0: Proc(child.pid, ("python", "-m", "slurmkit.train"), {"RANK": "0", "SLURMD_NODENAME": "node1"},
                       "S", 0)}
    return d


def test_a_kill_inside_a_save_waits_for_that_step_being_written_on_the_rank_s_node(tmp_path) -> None:
    import signal
    import subprocess
    import sys

    from slurmkit.ledger.ledger import read_ledger

    partial = tmp_path / "ckpt" / "nvme" / "node1" / ".partial"
    (partial / "step_0000000004.ab12-1").mkdir(parents=True)  # an older save: not the one aimed at
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        d = in_save_driver(tmp_path, child)
        d.cluster.state = "COMPLETED"  # type: ignore[attr-defined]
        fault = PlannedFault("rank_sigkill_during_save", "after_save", saves=1, offset=2, target=0)
        with pytest.raises(RunOver, match="the save of step 8 on node1"):
            d.kill_in_save(fault, 8)
        assert child.poll() is None
        d.cluster.state = "RUNNING"  # type: ignore[attr-defined]
        (partial / "step_0000000008.ab12-2").mkdir()
        t = d.kill_in_save(fault, 8)
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        child.kill()
        child.wait()
    (mark,) = [e for e in read_ledger(str(tmp_path / "ledger.jsonl")) if e["event"] == "fault_injected"]
    assert mark["kind"] == "rank_sigkill_during_save" and mark["step"] == 8 and mark["phase"] == "saving"
    assert mark["node"] == "node1" and mark["rank"] == 0 and mark["time"] == t


def test_after_a_fault_that_restarts_nothing_saves_are_counted_from_its_step(tmp_path) -> None:
    """A full disk or an S3 outage starts no generation: the next fault counts the saves after
    the step it hit, never waiting for a train_started that does not come."""
    d = driver(tmp_path, RUN + [(8.0, "ckpt_saved", {"step": 16, "tier": "lustre"}),
                                (9.0, "ckpt_saved", {"step": 20, "tier": "nvme"})])
    d._base = (7.5, 13)
    assert d.wait_after_save(PlannedFault("rank_sigkill", "after_save", saves=2, offset=1), since=7.5) == 21


def test_the_save_that_meets_a_full_disk_is_over_once_saved_anywhere_or_failed_elsewhere(tmp_path) -> None:
    for sub in ("a", "b", "c"):
        (tmp_path / sub).mkdir()
    d = driver(tmp_path / "a", RUN + [(8.0, "ckpt_failed", {"step": 16, "tier": "nvme", "reason": "disk_full"})])
    assert d._save_after(13, 7.5, "nvme") is None  # failed on the full tier only: still saving
    d = driver(tmp_path / "b", RUN + [(8.0, "ckpt_failed", {"step": 16, "tier": "nvme", "reason": "disk_full"}),
                                      (8.5, "ckpt_saved", {"step": 16, "tier": "lustre"})])
    assert d._save_after(13, 7.5, "nvme")["tier"] == "lustre"
    assert d._save_after(16, 7.5, "nvme") is None  # an older save is no answer
    d = driver(tmp_path / "c", RUN + [(8.0, "ckpt_failed", {"step": 16, "tier": "lustre", "reason": "io_error"})])
    assert d._save_after(13, 7.5, "nvme")["event"] == "ckpt_failed"


def test_a_tier_fault_placed_after_the_last_save_is_not_injected(tmp_path, monkeypatch) -> None:
    """Seen in the 50-seed campaign (seed 47): the tmpfs took seconds to set up, the run saved
    its last step meanwhile, and the fill was recorded as injected, then 'never noticed'."""
    from testkit.chaos import nvme

    steps = draw_plan(1).steps
    d = driver(tmp_path, [*RUN, (8.0, "ckpt_saved", {"step": steps, "tier": "nvme"})])
    released: list[object] = []
    full = nvme.FullTier(path=str(tmp_path / "nvme"), size_bytes=1 << 20, filler_bytes=1 << 20, mounted=False)
    monkeypatch.setattr(nvme, "node_nvme_dir", lambda run_dir, node: str(tmp_path / "nvme"))
    monkeypatch.setattr(nvme, "preflight_min_free", lambda run_dir: 0)
    monkeypatch.setattr(nvme, "fill_tier", lambda path, min_free: full)
    monkeypatch.setattr(nvme, "release", released.append)
    monkeypatch.setattr(d, "node_of_slot", lambda slot: "node1")
    with pytest.raises(RunOver, match="saved its last step"):
        d.fill_nvme(PlannedFault("nvme_full", "after_save", saves=1, offset=1, target=0), step=steps - 1)
    assert released == [full] and not d.filled_nodes  # filler gone, no node counted as filled
    assert not [e for e in d.events() if e.get("event") == "fault_injected"]
    assert d._last_save_made() == steps
    (tmp_path / "x").mkdir()
    assert driver(tmp_path / "x", RUN)._last_save_made() is None


def test_a_save_that_ended_while_the_disk_was_being_filled_does_not_release_the_filler(tmp_path, monkeypatch) -> None:
    """ci63: the tmpfs took a second to set up, the save of step 12 ended meanwhile, and that
    save (later than the fault's step 10) released the filler at once: 'the fill missed'."""
    from testkit.chaos import nvme

    d = driver(tmp_path, [*RUN, (8.0, "ckpt_saved", {"step": 12, "tier": "nvme"})])
    full = nvme.FullTier(path=str(tmp_path / "nvme"), size_bytes=1 << 20, filler_bytes=1 << 20, mounted=False)
    monkeypatch.setattr(nvme, "node_nvme_dir", lambda run_dir, node: str(tmp_path / "nvme"))
    monkeypatch.setattr(nvme, "preflight_min_free", lambda run_dir: 0)
    monkeypatch.setattr(nvme, "fill_tier", lambda path, min_free: full)
    monkeypatch.setattr(nvme, "release", lambda f: None)
    monkeypatch.setattr(nvme, "free_bytes", lambda path: 0)
    monkeypatch.setattr(d, "node_of_slot", lambda slot: "node1")
    waited: list[object] = []
    monkeypatch.setattr(d, "wait", lambda what, cond, **kw: waited.append(cond()))
    d.fill_nvme(PlannedFault("nvme_full", "after_save", saves=1, offset=1, target=0), step=10)
    assert waited == [None]  # step 12's save is no answer: it ended before the tier was full
