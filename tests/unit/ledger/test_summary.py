"""Figures from ledgers: synthetic ones with exact numbers, and real ones from the local cluster."""

from __future__ import annotations

import json
import os
import random
from typing import Any

import pytest
from rich.console import Console

from slurmkit.ledger.ledger import Ledger, read_ledger
from slurmkit.ledger.summary import Segment, summarize
from slurmkit.supervise.__main__ import main

DATA = os.path.join(os.path.dirname(__file__), "..", "..", "data", "failures", "ledgers")


def ev(t: float, event: str, **fields: Any) -> dict[str, Any]:
    return {"t": t, "event": event, **fields}


def beat(t: float, *steps: int, gen: int = 0) -> dict[str, Any]:
    return ev(t, "heartbeat", generation=gen, node="n1", steps={str(r): s for r, s in enumerate(steps)})


CLEAN = [
    ev(1000.0, "submitted", job_id="7"),
    ev(1005.0, "allocation_start", attempt="7-0"),
    ev(1006.0, "ranks_started", generation=0, node="n1"),
    beat(1008.0, 3, 3),  # left by an earlier run: before train_started, dropped
    ev(1010.0, "train_started", step=0, generation=0),
    beat(1020.0, 10, 9),  # the slowest rank's step counts
    ev(1030.0, "ckpt_saved", step=20),
    beat(1040.0, 30, 30),
    ev(1050.0, "train_finished", step=40),
    ev(1052.0, "end", status="completed", exit_code=0),
]


def test_clean_run() -> None:
    r = summarize(CLEAN)
    assert (r.start, r.wall_s, r.status, r.final_step) == (1000.0, 52.0, "completed", 40)
    assert r.productive_s == 40.0 and r.goodput == 40.0 / 52.0
    assert (r.restarts, r.replacements, r.requeues, r.steps_lost) == (0, 0, 0, 0)
    assert r.failures == [] and r.failures_by_class == {} and r.excluded_nodes == []


def restart_run(*, injected_step: int | None = 34, inject: bool = True) -> list[dict[str, Any]]:
    fault = ev(1045.0, "fault_injected", time=1045.0, rank=1, kind="exit")
    if injected_step is not None:
        fault["step"] = injected_step
    return [
        ev(1000.0, "submitted"),
        ev(1002.0, "ranks_started", generation=0, node="n1"),
        ev(1010.0, "train_started", step=0, generation=0),
        beat(1020.0, 10, 10),
        ev(1030.0, "ckpt_saved", step=20),
        ev(1030.5, "ckpt_durable", step=20),
        beat(1040.0, 30, 30),
        *([fault] if inject else []),
        ev(1046.0, "state", old="running", new="stopping"),
        ev(1046.5, "state", old="stopping", new="deciding"),
        ev(1047.0, "failure", cls="rank_crash", rank=1, node="n1", evidence="returncode -9",
           time_of_fault=1045.5),
        ev(1047.0, "decision", action="restart", reason="r", exclude=[]),
        ev(1047.25, "state", old="deciding", new="restarting"),
        ev(1048.0, "ranks_started", generation=1, node="n1"),
        beat(1049.0, 34, 34, gen=0),  # generation 0's beats, still in the files: dropped
        ev(1055.0, "ckpt_restored", step=20),
        ev(1056.0, "train_started", step=20, generation=1),
        beat(1060.0, 24, 24, gen=1),
        ev(1076.0, "train_finished", step=40),
        ev(1077.0, "end", status="completed", exit_code=0),
    ]


def test_restart_with_injected_fault() -> None:
    r = summarize(restart_run())
    assert r.wall_s == 77.0 and r.restarts == 1 and r.failures_by_class == {"rank_crash": 1}
    # Kept: 0->20 in the first segment (1010..1030) and 20->40 in the second (1056..1076).
    assert r.productive_s == 40.0 and r.goodput == 40.0 / 77.0
    (f,) = r.failures
    assert (f.cls, f.rank, f.node, f.action, f.injected) == ("rank_crash", 1, "n1", "restart", True)
    assert f.fault_time == 1045.0
    assert f.detection_s == 1.0  # fault -> running->stopping
    assert f.restart_s == 3.0  # -> ranks_started
    assert f.restore_s == 10.0  # -> ckpt_restored
    assert f.resume_s == 15.0  # -> first heartbeat after train_started (not the stale 1049 one)
    assert (f.fault_step, f.restored_step, f.steps_lost) == (34, 20, 14)
    assert r.steps_lost == 14


def test_fault_step_defaults_to_the_last_step_seen() -> None:
    (f,) = summarize(restart_run(injected_step=None)).failures
    assert (f.fault_step, f.restored_step, f.steps_lost) == (30, 20, 10)


def test_without_injection_no_detection_latency_and_fault_time_from_classifier() -> None:
    (f,) = summarize(restart_run(inject=False)).failures
    assert not f.injected and f.detection_s is None
    assert f.fault_time == 1045.5
    assert (f.restart_s, f.restore_s, f.resume_s) == (2.5, 9.5, 14.5)


def test_events_in_any_order() -> None:
    events = restart_run()
    shuffled = list(events)
    random.Random(3).shuffle(shuffled)
    assert summarize(shuffled) == summarize(events)


def test_interpolates_the_time_a_kept_step_was_reached() -> None:
    events = [
        ev(0.0, "train_started", step=0),
        beat(10.0, 10), beat(30.0, 30),  # no checkpoint event at 20 in this ledger
        ev(31.0, "failure", cls="hang", rank=0, node="n1", time_of_fault=30.0),
        ev(40.0, "train_started", step=20),
        ev(50.0, "train_finished", step=40),
    ]
    r = summarize(events)
    assert r.productive_s == 20.0 + 10.0  # 0->20 took 20 s (interpolated), 20->40 took 10 s
    assert r.failures[0].steps_lost == 10


def test_second_failure_before_training_restarted_loses_nothing_new() -> None:
    events = [
        ev(0.0, "train_started", step=0),
        ev(10.0, "ckpt_saved", step=10), beat(15.0, 15),
        ev(16.0, "failure", cls="user_error", rank=0, node="n1", time_of_fault=15.5),
        ev(16.0, "decision", action="restart"),
        ev(17.0, "ranks_started", generation=1),
        ev(20.0, "failure", cls="nccl_error", rank=2, node="n2", time_of_fault=19.0),
        ev(20.0, "decision", action="restart"),
        ev(21.0, "ranks_started", generation=2),
        ev(25.0, "train_started", step=10, generation=2),
        ev(35.0, "train_finished", step=20),
        ev(36.0, "end", status="completed"),
    ]
    r = summarize(events)
    assert [f.steps_lost for f in r.failures] == [5, 0]
    assert r.steps_lost == 5 and r.restarts == 2
    assert r.failures_by_class == {"user_error": 1, "nccl_error": 1}
    assert r.failures[1].restart_s == 2.0 and r.failures[1].restore_s == 6.0
    assert r.productive_s == 10.0 + 10.0


def test_replacement_requeue_and_exclusions() -> None:
    events = [
        ev(0.0, "submitted"),
        ev(1.0, "train_started", step=0),
        ev(5.0, "ckpt_saved", step=5),
        ev(6.0, "failure", cls="node_loss", rank=-1, node="n2", time_of_fault=6.0),
        ev(6.0, "decision", action="replace_node", exclude=["n2"]),
        ev(6.0, "exclusion", nodes=["n2"], how="spare"),
        ev(8.0, "train_started", step=5),
        ev(12.0, "ckpt_saved", step=9),
        ev(13.0, "checkpointed_on_signal", signal="time_limit", step=9),
        ev(13.0, "requeue", reason="time limit"),
        ev(14.0, "failure", cls="nccl_timeout", rank=3, node="n4", time_of_fault=13.5),
        ev(14.0, "decision", action="requeue", exclude=["n4"]),
        ev(14.0, "exclusion", nodes=["n4"], how="requeue"),
        ev(14.0, "requeue", reason="r", exclude=["n4"]),
        ev(20.0, "train_started", step=9),
        ev(21.0, "train_finished", step=10),
        ev(22.0, "end", status="completed"),
    ]
    r = summarize(events)
    assert (r.restarts, r.replacements, r.requeues) == (0, 1, 2)
    assert r.excluded_nodes == ["n2", "n4"]
    assert [f.action for f in r.failures] == ["replace_node", "requeue"]
    assert r.productive_s == 4.0 + 4.0 + 1.0 and r.wall_s == 22.0


def test_stopped_run_has_no_restored_step() -> None:
    events = [ev(0.0, "train_started", step=0), beat(4.0, 4),
              ev(5.0, "failure", cls="gpu_oom", rank=0, node="n1", time_of_fault=4.5),
              ev(5.0, "decision", action="stop"), ev(5.5, "end", status="stopped", exit_code=93)]
    r = summarize(events)
    (f,) = r.failures
    assert r.status == "stopped" and f.action == "stop"
    assert (f.fault_step, f.restored_step, f.steps_lost, f.restart_s, f.resume_s) == (4, None, None, None, None)
    assert r.productive_s == 4.0  # the last segment keeps what it did (nothing overwrote it)


def test_empty_and_running() -> None:
    assert summarize([]).status == "empty"
    r = summarize(CLEAN[:-2])
    assert r.status == "running" and r.wall_s == 40.0 and r.productive_s == 30.0


def test_segment_time_at() -> None:
    s = Segment(10.0, 0, [(10.0, 0), (20.0, 10), (30.0, 30)])
    assert [s.time_at(k) for k in (0, 5, 10, 20, 30, 99)] == [10.0, 15.0, 20.0, 25.0, 30.0, 30.0]


# ------------------------------------------------------------------ real ledgers (local Slurm cluster)

def real(name: str) -> list[dict[str, Any]]:
    return list(read_ledger(os.path.join(DATA, name)))


def test_real_completed_run() -> None:
    events = real("tiny_completed.jsonl")
    r = summarize(events)
    start = next(e["t"] for e in events if e["event"] == "train_started")
    # Productive until step 60 was first seen done (its checkpoint), not until the final hash.
    reached = next(e["t"] for e in events if e["event"] == "ckpt_saved" and e["step"] == 60)
    assert r.status == "completed" and r.final_step == 60 and r.failures == []
    assert r.productive_s == pytest.approx(reached - start)
    assert r.wall_s == pytest.approx(events[-1]["t"] - events[0]["t"])


def test_real_run_with_a_failure_and_a_requeue() -> None:
    r = summarize(real("tiny_raise_then_requeue.jsonl"))
    assert r.failures_by_class == {"user_error": 1, "node_loss": 1}
    assert (r.restarts, r.requeues, r.excluded_nodes, r.status) == (1, 1, ["node2"], "completed")
    first = r.failures[0]
    assert (first.rank, first.restored_step, first.steps_lost) == (3, 20, 0)
    assert first.restart_s is not None and first.restart_s < first.restore_s < first.resume_s  # type: ignore[operator]
    assert 0.0 < r.goodput < 1.0


def test_real_run_restarted_in_its_allocation() -> None:
    events = real("tiny_raise_restart.jsonl")
    r = summarize(events)
    assert (r.status, r.restarts, r.requeues, r.excluded_nodes) == ("completed", 1, 0, [])
    (f,) = r.failures
    assert (f.cls, f.rank, f.node, f.evidence) == ("user_error", 3, "node2", "[rank3]: Traceback (most recent call last):")
    assert f.restored_step == 20 and f.fault_step is not None and f.steps_lost == f.fault_step - 20
    restarted = {e["node"] for e in events if e["event"] == "ranks_started" and e["generation"] == 1}
    assert restarted == {"node1", "node2"}  # the follower node applied node 0's restart


# ------------------------------------------------------------------ CLI

@pytest.fixture
def run_dir(tmp_path) -> str:
    """A run directory whose ledger the real Ledger wrote (its clock replays the event times)."""
    events = restart_run()
    times = iter([float(e["t"]) for e in events])
    ledger = Ledger(str(tmp_path / "ledger.jsonl"), clock=lambda: next(times))
    for e in events:
        ledger.append(e["event"], **{k: v for k, v in e.items() if k not in ("t", "event")})
    return str(tmp_path)


@pytest.mark.parametrize("prefix", [[], ["report"]])
def test_cli_table(run_dir: str, prefix: list[str]) -> None:
    console = Console(record=True, width=200)
    assert main([*prefix, run_dir], out=console) == 0
    text = console.export_text()
    assert "goodput" in text and "51.9%" in text  # 40 / 77
    assert "rank_crash" in text and "r1@n1" in text and "34->20" in text


def test_cli_json(run_dir: str) -> None:
    console = Console(record=True, width=200)
    assert main(["report", run_dir, "--json"], out=console) == 0
    data = json.loads(console.export_text())
    assert data["goodput"] == pytest.approx(40 / 77) and data["failures"][0]["steps_lost"] == 14


def test_cli_without_ledger(tmp_path, capsys) -> None:
    assert main([str(tmp_path)], out=Console(record=True)) == 2
    assert "Detected: no ledger.jsonl" in capsys.readouterr().err


def test_a_run_whose_training_nobody_saw_has_unknown_goodput_and_steps_lost_never_0(tmp_path) -> None:
    # a program that neither beats nor prints a step anything reads: ranks start and fail, no
    # train_started ever (issue 36: the report said goodput 0.0% and steps lost 0)
    events = [e for e in restart_run() if e["event"] not in ("train_started", "heartbeat", "ckpt_saved",
                                                              "ckpt_durable", "ckpt_restored", "train_finished")]
    r = summarize(events)
    assert r.productive_s is None and r.goodput is None and r.steps_lost is None and r.final_step is None
    (f,) = r.failures
    assert (f.fault_step, f.restored_step, f.steps_lost) == (34, None, None)  # the test's own record of the fault
    ledger = Ledger(str(tmp_path / "ledger.jsonl"))
    for e in events:
        ledger.append(e["event"], **{k: v for k, v in e.items() if k not in ("t", "event")})
    console = Console(record=True, width=200)
    assert main(["report", str(tmp_path)], out=console) == 0
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip() for line in console.export_text().splitlines()
            if line.count("│") >= 3}
    assert rows["goodput"] == "-" and rows["steps lost"] == "-" and rows["productive"] == "-", rows
