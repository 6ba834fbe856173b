"""RankMonitor with injected clocks and process states; heartbeats written by the real Heartbeat."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import pytest

from slurmkit.failures.classes import FailureClass
from slurmkit.failures.classify import root_cause
from slurmkit.launch.monitor import EXIT_CHECKPOINTED_ON_SIGNAL, RankMonitor, _proc_state
from slurmkit.train.heartbeat import Heartbeat

F = FailureClass
WALL0 = 1_796_000_000.0


class Clock:
    """Monotonic and wall time moved by the test."""

    def __init__(self) -> None:
        self.t = 0.0

    def mono(self) -> float:
        return self.t

    def wall(self) -> float:
        return WALL0 + self.t


@pytest.fixture
def clock() -> Clock:
    return Clock()


def make_monitor(clock: Clock, states: dict[int, str] | None = None, *, generation: int = 1,
                 heartbeat_timeout_s: float = 60.0, startup_timeout_s: float = 300.0) -> RankMonitor:
    table = states if states is not None else {}
    proc_state: Callable[[int], str] = lambda pid: table.get(pid, "S")
    return RankMonitor("node1", generation, heartbeat_timeout_s=heartbeat_timeout_s,
                       startup_timeout_s=startup_timeout_s, wall=clock.wall, mono=clock.mono,
                       proc_state=proc_state)


def beater(tmp_path, clock: Clock, rank: int, generation: int = 1) -> Heartbeat:
    return Heartbeat(str(tmp_path / f"rank{rank}.json"), rank=rank, generation=generation,
                     clock=clock.wall, pid=1000 + rank)


def add(mon: RankMonitor, tmp_path, rank: int) -> None:
    mon.add_rank(rank, 1000 + rank, str(tmp_path / f"rank{rank}.json"))


def test_hang_reported_after_heartbeat_timeout(tmp_path, clock: Clock) -> None:
    mon = make_monitor(clock)
    add(mon, tmp_path, 0)
    hb = beater(tmp_path, clock, 0)
    for step in range(1, 6):
        clock.t += 1.0
        hb.beat(step)
        assert 0 in mon.poll()
    last_beat_wall = clock.wall()
    clock.t += 60.0  # exactly the timeout: not yet
    mon.poll()
    assert mon.triggered is None
    clock.t += 0.5
    mon.poll()
    ev = mon.triggered
    assert ev is not None and ev.cls == F.HANG and ev.kind == "heartbeat" and ev.rank == 0
    assert ev.time == pytest.approx(last_beat_wall)  # dated to the last step, not to detection
    assert "after step 5" in ev.detail
    clock.t += 100.0
    mon.poll()
    assert len(mon.evidence) == 1  # reported once


def test_steady_steps_are_no_hang(tmp_path, clock: Clock) -> None:
    mon = make_monitor(clock, heartbeat_timeout_s=10.0)
    add(mon, tmp_path, 0)
    hb = beater(tmp_path, clock, 0)
    for step in range(1, 50):
        clock.t += 9.0
        hb.beat(step)
        mon.poll()
    assert mon.triggered is None and mon.evidence == []


def test_startup_timeout(tmp_path, clock: Clock) -> None:
    mon = make_monitor(clock, startup_timeout_s=300.0)
    add(mon, tmp_path, 0)
    clock.t = 300.0
    mon.poll()
    assert mon.triggered is None
    clock.t = 301.0
    mon.poll()
    ev = mon.triggered
    assert ev is not None and ev.cls == F.HANG and "no heartbeat 301.0 s after start" in ev.detail
    assert ev.time == clock.wall()


def test_heartbeat_of_an_older_generation_is_ignored(tmp_path, clock: Clock) -> None:
    mon = make_monitor(clock, generation=2, startup_timeout_s=30.0)
    add(mon, tmp_path, 0)
    old = beater(tmp_path, clock, 0, generation=1)  # left over from the previous generation
    for step in range(1, 40):
        clock.t += 1.0
        old.beat(step)
        assert mon.poll() == {}
    ev = mon.triggered
    assert ev is not None and "no heartbeat" in ev.detail  # still waiting for a first beat


def test_beat_left_by_the_previous_allocation_is_ignored(tmp_path, clock: Clock) -> None:
    # A requeued job starts again at generation 0; the file still holds the old run's last beat.
    stale = Heartbeat(str(tmp_path / "rank0.json"), rank=0, generation=0, clock=clock.wall, pid=55)
    stale.beat(24)
    clock.t += 500.0
    mon = make_monitor(clock, generation=0, heartbeat_timeout_s=60.0, startup_timeout_s=300.0)
    add(mon, tmp_path, 0)
    clock.t += 120.0  # restoring a big checkpoint: longer than the heartbeat timeout
    assert mon.poll() == {}
    assert mon.triggered is None  # still within the startup timeout, not a hang after step 24
    beater(tmp_path, clock, 0, generation=0).beat(21)
    assert mon.poll()[0]["step"] == 21


def test_stopped_process_gets_the_earlier_time(tmp_path, clock: Clock) -> None:
    states = {1000: "S", 1001: "T"}
    mon = make_monitor(clock, states)
    add(mon, tmp_path, 0)
    add(mon, tmp_path, 1)
    hb0, hb1 = beater(tmp_path, clock, 0), beater(tmp_path, clock, 1)
    clock.t += 1.0
    hb1.beat(7)  # the stopped rank wrote its last beat first ...
    clock.t += 0.3
    hb0.beat(7)  # ... and its peer a moment later, then blocked behind it
    mon.poll()
    clock.t += 61.0
    mon.poll()
    by_rank = {e.rank: e for e in mon.evidence}
    assert set(by_rank) == {0, 1}
    assert "state T" in by_rank[1].detail and "state T" not in by_rank[0].detail
    assert by_rank[1].time < by_rank[0].time
    failure = root_cause(mon.evidence)
    assert failure is not None and (failure.rank, failure.cls) == (1, F.HANG)


def test_stopped_process_wins_even_when_its_last_beat_came_later(tmp_path, clock: Clock) -> None:
    mon = make_monitor(clock, {1000: "S", 1001: "T"})
    add(mon, tmp_path, 0)
    add(mon, tmp_path, 1)
    hb0, hb1 = beater(tmp_path, clock, 0), beater(tmp_path, clock, 1)
    clock.t += 1.0
    hb0.beat(3)
    clock.t += 0.2
    hb1.beat(3)
    mon.poll()
    clock.t += 61.0
    mon.poll()
    failure = root_cause(mon.evidence)
    assert failure is not None and failure.rank == 1


@pytest.mark.parametrize("code", [0, EXIT_CHECKPOINTED_ON_SIGNAL])
def test_clean_exits_are_not_failures(tmp_path, clock: Clock, code: int) -> None:
    assert EXIT_CHECKPOINTED_ON_SIGNAL == 95
    mon = make_monitor(clock, startup_timeout_s=1.0)
    add(mon, tmp_path, 0)
    mon.on_exit(0, code)
    clock.t += 1000.0
    mon.poll()  # an exited rank is not watched for hangs
    assert mon.triggered is None and mon.evidence == []


@pytest.mark.parametrize(("code", "cls"), [(1, F.USER_ERROR), (-9, F.RANK_CRASH), (-6, F.RANK_CRASH)])
def test_failing_exit_triggers(tmp_path, clock: Clock, code: int, cls: FailureClass) -> None:
    mon = make_monitor(clock)
    add(mon, tmp_path, 2)
    clock.t = 5.0
    mon.on_exit(2, code)
    ev = mon.triggered
    assert ev is not None and (ev.rank, ev.kind, ev.cls, ev.time) == (2, "exit", cls, WALL0 + 5.0)
    assert ev.detail == f"returncode {code}"


def test_exit_before_add_rank_is_kept(tmp_path, clock: Clock) -> None:
    # The waiter thread can report an instant exit before the agent registers the rank.
    mon = make_monitor(clock, startup_timeout_s=10.0)
    mon.on_exit(0, 0)
    add(mon, tmp_path, 0)
    clock.t += 100.0
    mon.poll()
    assert mon.evidence == []


@pytest.mark.parametrize(("line", "cls"), [
    ("[rank1]:[E ProcessGroupNCCL.cpp:1234] [PG 0 Rank 1] NCCL error: remote process exited or there "
     "was a network error", F.NCCL_ERROR),
    ("[E ProcessGroupNCCL.cpp:475] [Rank 1] Watchdog caught collective operation timeout: WorkNCCL("
     "SeqNum=87, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600458 "
     "milliseconds before timing out.", F.NCCL_TIMEOUT),
    ("[E ProcessGroupNCCL.cpp:1182] [Rank 5] Heartbeat monitor timed out! Process will be terminated "
     "after dumping debug info. workMetaList_.size()=2", F.WATCHDOG_STUCK),
    ("[  812.334455] NVRM: Xid (PCI:0000:3b:00): 79, pid=4321, name=python, GPU has fallen off the bus.",
     F.GPU_FAULT),
    ("slurmstepd: error: Detected 1 oom_kill event in StepId=123.0. Some of the step tasks have been "
     "OOM Killed.", F.HOST_OOM),
])
def test_triggering_lines(clock: Clock, line: str, cls: FailureClass) -> None:
    mon = make_monitor(clock)
    clock.t = 2.5
    mon.on_line(1, line + "\n")
    ev = mon.triggered
    assert ev is not None and (ev.cls, ev.rank, ev.kind, ev.time) == (cls, 1, "line", WALL0 + 2.5)
    assert ev.detail == line  # stripped


@pytest.mark.parametrize(("line", "cls"), [
    ("[rank0]: Traceback (most recent call last):", F.USER_ERROR),  # the exit will follow
    # A trainer may catch it and retry with a smaller batch: only its exit ends the generation.
    ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.", F.GPU_OOM),
    ("[rank2]: RuntimeError: CUDA error: an illegal memory access was encountered", F.CUDA_ERROR),
    ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
     "[127.0.0.1]:27296", F.PEER_FAILURE),
    ("[rank1]: torch.distributed.DistBackendError: NCCL error in: x.cpp:1, unhandled system error",
     F.NCCL_SYNC),
])
def test_non_triggering_lines_are_kept_as_evidence(clock: Clock, line: str, cls: FailureClass) -> None:
    mon = make_monitor(clock)
    mon.on_line(0, line)
    assert mon.triggered is None
    assert [e.cls for e in mon.evidence] == [cls]


def test_unclassified_lines_leave_no_evidence(clock: Clock) -> None:
    mon = make_monitor(clock)
    for line in ("step 3 loss 2.1", "NCCL INFO Bootstrap : Using eth0:10.0.0.1<0>", ""):
        mon.on_line(0, line)
    assert mon.evidence == [] and mon.triggered is None


def test_first_trigger_is_kept(clock: Clock) -> None:
    mon = make_monitor(clock)
    clock.t = 1.0
    mon.on_exit(3, -9)
    clock.t = 2.0
    mon.on_line(0, "ncclRemoteError: A call failed possibly due to a network error")
    assert mon.triggered is not None and mon.triggered.rank == 3
    assert len(mon.evidence) == 2


def test_proc_state_reads_a_real_stopped_process() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert _proc_state(proc.pid) in ("R", "S")
        os.kill(proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10.0
        while _proc_state(proc.pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _proc_state(proc.pid) == "T"
    finally:
        proc.kill()
        proc.wait()
    assert _proc_state(proc.pid) == ""  # reaped: gone
