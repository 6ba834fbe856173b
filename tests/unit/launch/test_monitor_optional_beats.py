"""Heartbeats are optional for programs that do not beat (supervisor.require_heartbeat): a
plain DDP script is not killed as a hang after startup_timeout_s; it is judged from its first
beat on, and a stopped rank is still found by its process state."""

from __future__ import annotations

import json
import time

import pytest

from slurmkit.config import compose
from slurmkit.errors import ConfigError
from slurmkit.failures.classes import FailureClass
from slurmkit.failures.programs import expects_heartbeats
from slurmkit.launch.monitor import RankMonitor
from tests.unit.launch.test_contract_slurm_env import agent
from tests.unit.launch.test_monitor import Clock, add, beater

TRAIN = ["python", "-m", "slurmkit.train"]
DDP_SCRIPT = ["python", "examples/ddp/main.py", "--epochs", "3"]


def monitor(clock: Clock, states: dict[int, str], *, require: bool) -> RankMonitor:
    return RankMonitor("node1", 1, heartbeat_timeout_s=60.0, startup_timeout_s=20.0, require_heartbeat=require,
                       wall=clock.wall, mono=clock.mono, proc_state=lambda pid: states.get(pid, "S"))


@pytest.fixture
def clock() -> Clock:
    return Clock()


def test_a_program_that_never_beats_is_no_hang_by_the_clock(tmp_path, clock: Clock) -> None:
    mon = monitor(clock, {}, require=False)
    add(mon, tmp_path, 0)
    for t in (19.0, 21.0, 3600.0, 86_400.0):  # far past startup_timeout_s=20
        clock.t = t
        mon.poll()
    assert mon.triggered is None and mon.evidence == []


def test_required_beats_still_time_out_at_startup(tmp_path, clock: Clock) -> None:
    mon = monitor(clock, {}, require=True)
    add(mon, tmp_path, 0)
    clock.t = 21.0
    mon.poll()
    assert mon.triggered is not None and mon.triggered.cls == FailureClass.HANG
    assert "no heartbeat" in mon.triggered.detail


def test_after_its_first_beat_the_heartbeat_timeout_applies(tmp_path, clock: Clock) -> None:
    mon = monitor(clock, {}, require=False)
    add(mon, tmp_path, 0)
    clock.t = 500.0
    mon.poll()
    beater(tmp_path, clock, 0).beat(7)
    mon.poll()
    clock.t = 559.0
    mon.poll()
    assert mon.triggered is None
    clock.t = 561.0
    mon.poll()
    assert mon.triggered is not None and mon.triggered.cls == FailureClass.HANG
    assert "after step 7" in mon.triggered.detail


def test_a_stopped_rank_without_beats_is_a_hang_by_its_state(tmp_path, clock: Clock) -> None:
    states: dict[int, str] = {}
    mon = monitor(clock, states, require=False)
    add(mon, tmp_path, 0)
    add(mon, tmp_path, 1)
    states[1000] = "T"  # rank 0 stopped (its pid is 1000 in these helpers)
    clock.t = 10.0
    mon.poll()
    states[1000] = "S"  # resumed (a debugger let go): the stop does not add up
    clock.t = 50.0
    mon.poll()
    states[1000] = "T"
    clock.t = 100.0
    mon.poll()
    clock.t = 159.0
    mon.poll()
    assert mon.triggered is None
    clock.t = 161.0
    mon.poll()
    assert mon.triggered is not None and mon.triggered.rank == 0 and mon.triggered.cls == FailureClass.HANG
    assert "state T" in mon.triggered.detail
    assert [e.rank for e in mon.evidence] == [0]  # the running peer is never blamed


@pytest.mark.parametrize("bad", [{"generation": 1, "time": 1.0}, {"generation": 1, "step": "x", "time": 1.0},
                                 {"generation": 1, "step": 3, "time": "soon"}, {"generation": 1, "step": 3}])
def test_a_malformed_beat_from_a_user_program_is_no_beat(tmp_path, clock: Clock, bad: dict) -> None:
    mon = monitor(clock, {}, require=False)
    add(mon, tmp_path, 0)
    (tmp_path / "rank0.json").write_text(json.dumps(bad))
    clock.t = 1000.0
    assert mon.poll() == {}  # and the agent did not raise
    assert mon.triggered is None


@pytest.mark.parametrize(("setting", "command", "want"), [
    ("auto", TRAIN, True), ("auto", [*TRAIN, "train.steps=5"], True), ("auto", DDP_SCRIPT, False),
    ("auto", ["python", "-m", "slurmkit.examples.allreduce"], False), ("auto", ["torchrun", "x.py"], False),
    ("true", DDP_SCRIPT, True), ("false", TRAIN, False),
])
def test_expects_heartbeats(setting: str, command: list[str], want: bool) -> None:
    assert expects_heartbeats(setting, command) is want


@pytest.mark.parametrize(("override", "want"), [([], "auto"), (["supervisor.require_heartbeat=true"], "true"),
                                                (["supervisor.require_heartbeat=False"], "false"),
                                                (["supervisor.require_heartbeat=auto"], "auto")])
def test_config_field(override: list[str], want: str) -> None:
    assert compose(["+exp=tiny", *override]).supervisor.require_heartbeat == want


def test_config_field_refuses_other_values() -> None:
    with pytest.raises(ConfigError, match="require_heartbeat"):
        compose(["+exp=tiny", "supervisor.require_heartbeat=sometimes"])


def _verdict_after_startup(node) -> object:
    """Start a real rank that never beats; poll until the startup timeout has passed (a condition
    on the clock, not a fixed sleep) and a few polls more; the verdict (None: no hang)."""
    node.start(gen=0, slot=0, port=29512, master_addr="127.0.0.1")
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 <= node.cfg.supervisor.startup_timeout_s:
            node.poll(0)
        for _ in range(3):
            node.poll(0)
        return node.monitor.triggered
    finally:
        node.stop()


@pytest.mark.parametrize(("setting", "hang"), [("auto", False), ("true", True)])
def test_the_agent_lets_a_real_program_without_beats_run(tmp_path, setting: str, hang: bool) -> None:
    (tmp_path / "run").mkdir()
    node = agent(tmp_path, 0, ["job.command=[python,-c,'import time; time.sleep(120)']",
                               "supervisor.startup_timeout_s=0.05", f"supervisor.require_heartbeat={setting}"])
    verdict = _verdict_after_startup(node)
    assert (verdict is not None) is hang
    if hang:
        assert verdict.cls == FailureClass.HANG and "no heartbeat" in verdict.detail


# A program that never beats but prints its steps (torchtitan's metric line, a user's pattern):
# its own step lines are the clock (RankMonitor.on_progress, fed by the agent's program adapter).

def test_a_program_timed_by_its_step_lines_hangs_after_three_of_its_longest_gaps(tmp_path, clock: Clock) -> None:
    mon = monitor(clock, {}, require=False)
    add(mon, tmp_path, 0)
    clock.t = 30.0
    mon.on_progress(0, 1)  # one line: no gap known yet, no clock
    clock.t = 500.0
    mon.poll()
    assert mon.triggered is None
    mon.on_progress(0, 10)  # 470 s after step 1 (a first compile, a slow start): the program's measure
    mon.on_progress(0, 10)  # the same step again changes nothing
    clock.t = 500.0 + 3 * 470.0
    mon.poll()
    assert mon.triggered is None  # exactly three gaps: not yet
    clock.t += 0.5
    mon.poll()
    assert mon.triggered is not None and mon.triggered.cls == FailureClass.HANG, mon.evidence
    assert mon.triggered.kind == "heartbeat" and mon.triggered.time == clock.wall() - clock.t + 500.0  # step 10's line
    assert "no step line after step 10" in mon.triggered.detail and "470.0 s" in mon.triggered.detail


def test_short_gaps_still_give_the_program_heartbeat_timeout(tmp_path, clock: Clock) -> None:
    mon = monitor(clock, {}, require=False)
    add(mon, tmp_path, 0)
    for step in range(1, 6):  # a line a second
        clock.t = float(step)
        mon.on_progress(0, step)
    clock.t = 5.0 + 59.0
    mon.poll()
    assert mon.triggered is None  # 3 x 1 s is less than heartbeat_timeout_s=60
    clock.t = 5.0 + 61.0
    mon.poll()
    assert mon.triggered is not None and "no step line after step 5 for 61.0 s" in mon.triggered.detail


def test_an_announced_save_stops_the_clock_until_it_is_over(tmp_path, clock: Clock) -> None:
    mon = monitor(clock, {}, require=False)
    add(mon, tmp_path, 0)
    for step, t in ((1, 0.0), (2, 10.0), (3, 20.0)):
        clock.t = t
        mon.on_progress(0, step)
    mon.on_progress(0, None, saving=True)  # torchtitan: "Saving the checkpoint"
    clock.t = 20.0 + 3600.0
    mon.poll()
    assert mon.triggered is None  # an hour-long save is no hang by the step lines
    mon.on_progress(0, None, saving=False)  # "Finished saving the checkpoint"
    clock.t += 59.0
    mon.poll()
    assert mon.triggered is None  # the clock started again when the save ended
    clock.t += 2.0
    mon.poll()
    assert mon.triggered is not None and "after step 3" in mon.triggered.detail


def test_file_beats_come_first_and_a_stopped_rank_is_named(tmp_path, clock: Clock) -> None:
    states: dict[int, str] = {}
    mon = monitor(clock, states, require=False)
    add(mon, tmp_path, 0)
    add(mon, tmp_path, 1)
    beater(tmp_path, clock, 0).beat(1)  # rank 0 beats through userapi: its file is its clock
    mon.poll()
    for step, t in ((1, 0.0), (2, 1.0)):
        clock.t = t
        mon.on_progress(0, step)
        mon.on_progress(1, step)
    clock.t = 50.0
    beater(tmp_path, clock, 0).beat(2)
    mon.poll()
    assert mon.triggered is None
    states[1001] = "T"  # rank 1 (pid 1001 in add) is stopped as well
    clock.t = 62.0
    mon.poll()
    assert mon.triggered is not None and mon.triggered.rank == 1, mon.evidence
    assert "no step line" in mon.triggered.detail and "state T" in mon.triggered.detail
    assert mon.triggered.time == clock.wall() - clock.t + 1.0 - 1.0  # a stopped rank is dated before its peers


# ------------------------------------------------------------------ beats outside the steps
def _poll_at(mon: RankMonitor, clock: Clock, t: float, beat=None, step: int = 40, **fields: object):  # noqa: ANN001, ANN202
    """Move the clock to ``t``, beat ``step`` with ``fields`` when ``beat`` is given, poll; what triggered."""
    clock.t = t
    if beat is not None:
        beat.beat(step, **fields)
    mon.poll()
    return mon.triggered


def test_phase_beats_keep_an_evaluating_rank_alive_until_they_stop(tmp_path, clock: Clock) -> None:
    """A rank in a long evaluation beats the same step with a phase (userapi.report_phase): each
    new one restarts the clock; when they stop (stuck in the loop), the timeout applies again."""
    mon = monitor(clock, {}, require=False)
    add(mon, tmp_path, 0)
    hb = beater(tmp_path, clock, 0)
    assert _poll_at(mon, clock, 10.0, hb) is None
    # six minutes of evaluation, a beat every 30 s, the step still 40
    assert all(_poll_at(mon, clock, float(t), hb, phase="validation") is None for t in range(40, 400, 30))
    assert _poll_at(mon, clock, 370.0 + 59.0) is None
    hang = _poll_at(mon, clock, 370.0 + 61.0)
    assert hang is not None and "after step 40" in hang.detail


@pytest.mark.parametrize("fields", [{}, {"phase": ""}, {"phase": "two words"}, {"phase": "x" * 33}, {"phase": 7}],
                         ids=["no-phase", "empty", "words", "long", "number"])
def test_the_same_step_beaten_again_without_a_named_phase_is_no_sign_of_life(tmp_path, clock: Clock,
                                                                             fields: dict) -> None:
    mon = monitor(clock, {}, require=False)
    add(mon, tmp_path, 0)
    hb = beater(tmp_path, clock, 0)
    assert [_poll_at(mon, clock, t, hb, **fields) is None for t in (10.0, 40.0, 69.0, 71.0)] == [True] * 3 + [False]


def test_a_save_stops_the_clock_until_the_next_beat(tmp_path, clock: Clock) -> None:
    mon = monitor(clock, {}, require=False)
    add(mon, tmp_path, 0)
    hb = beater(tmp_path, clock, 0)
    _poll_at(mon, clock, 10.0, hb)
    _poll_at(mon, clock, 20.0, hb, phase="saving")  # then nothing for ten minutes: a large checkpoint's write
    assert all(_poll_at(mon, clock, float(t)) is None for t in range(35, 620, 15))
    assert _poll_at(mon, clock, 620.0, hb, step=41) is None  # the save is over, a step came: the clock runs
    hang = _poll_at(mon, clock, 620.0 + 61.0)
    assert hang is not None and "after step 41" in hang.detail


def test_the_final_step_is_read_from_the_beat_the_rank_left(tmp_path, clock: Clock) -> None:
    """A rank that beat after the last poll and then died: its file still says how far it got
    (the agent's last sample of the generation, the report's steps lost)."""
    mon = monitor(clock, {}, require=False)
    add(mon, tmp_path, 0)
    add(mon, tmp_path, 1)
    hb = beater(tmp_path, clock, 0)
    _poll_at(mon, clock, 10.0, hb, step=5)
    clock.t = 11.0
    hb.beat(6)  # no poll after it
    assert mon.final_step(0) == 6 and mon.final_step(1) is None and mon.final_step(7) is None
