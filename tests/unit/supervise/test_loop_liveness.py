"""Liveness that scales and is confirmed: deadlines from N and the measured beat interval,
Slurm's view (the fake controller, through the client) before a node is called lost, a beater
that survives store errors, and a checkpoint-progress read that never holds a decision up."""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from slurmkit.slurm.client import SlurmClient
from slurmkit.slurm.retry import RetryPolicy
from slurmkit.supervise.channel import Channel
from slurmkit.supervise.ckpt_progress import CheckpointProgress
from slurmkit.supervise.liveness import Beater, Liveness, client_node_states, slurm_says_dead
from slurmkit.supervise.timeouts import KEEPALIVE_MISSES, MAX_BEATS_PER_S, beat_interval_s, liveness_deadline_s
from testkit.fakeslurm import FakeSlurm


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# ------------------------------------------------------------------ timing that scales with N
@pytest.mark.parametrize("n", [4, 16, 128, 512, 2048, 8192, 100_000])
def test_all_beats_together_stay_under_the_store_budget(n: int) -> None:
    interval = beat_interval_s(n, 0.5)
    assert interval >= 0.5
    # The budget holds up to the torchrun-like 5 s ceiling (past it detection would be too late).
    assert n / interval <= MAX_BEATS_PER_S or interval == 5.0
    assert liveness_deadline_s(interval, 3.0) >= KEEPALIVE_MISSES * interval


def test_interval_and_deadline_at_2048_nodes_detect_within_5_s() -> None:
    interval = beat_interval_s(2048, 0.5)
    assert interval == pytest.approx(1.024)
    assert liveness_deadline_s(interval, 3.0) <= 5.0
    assert liveness_deadline_s(0.5, 3.0) == 3.0  # small jobs keep supervisor.node_timeout_s


def tracker(clock: Clock, states=None, **kw) -> Liveness:  # noqa: ANN001
    return Liveness({1: "node2", 2: "node3"}, beat_interval_s=kw.get("interval", 1.0), floor_s=3.0,
                    first_beat_s=kw.get("first", 30.0), node_states=states, clock=clock)


def test_the_deadline_follows_the_interval_measured_for_each_agent() -> None:
    clock = Clock()
    live = tracker(clock)
    tick = {1: 0, 2: 0}
    for _ in range(20):  # node2 beats every 1 s, node3 every 2 s (a loaded host)
        clock.now += 1.0
        tick[1] += 1
        if int(clock.now) % 2 == 0:
            tick[2] += 1
        live.observe(dict(tick))
    assert live.deadline_s(1) == pytest.approx(4.0, abs=0.3)
    assert live.deadline_s(2) == pytest.approx(8.0, abs=0.8)


def test_silence_past_the_deadline_is_suspect_and_lost_after_a_second_without_slurm() -> None:
    clock = Clock()
    live = tracker(clock)
    live.observe({1: 5, 2: 5})
    clock.now += 4.5  # past the 4 s deadline: suspect, not lost
    live.observe({1: 5, 2: 6})
    assert live.lost() == []
    clock.now += 4.0  # 8.5 s silent: past two deadlines
    live.observe({1: 5, 2: 7})
    (lost,) = live.lost()
    assert lost.node_rank == 1 and "no answer from Slurm" in lost.why


def test_an_agent_that_beats_again_is_no_longer_suspect() -> None:
    clock = Clock()
    live = tracker(clock)
    live.observe({1: 1})
    clock.now += 5.0
    assert live.lost() == []  # suspect
    live.observe({1: 2})
    clock.now += 3.9
    assert live.lost() == []  # its silence counts from the new beat


def test_an_agent_that_never_beat_is_lost_after_the_first_beat_window() -> None:
    clock = Clock()
    live = tracker(clock, first=20.0)
    live.observe({1: 0})
    clock.now += 19.0
    assert live.lost() == []
    clock.now += 22.0
    (lost,) = live.lost()
    assert lost.node_rank == 1


def _fake_client(fake: FakeSlurm) -> SlurmClient:
    return SlurmClient(fake, retry=RetryPolicy(max_attempts=1, jitter_s=0))


def test_slurm_confirming_a_down_node_makes_it_lost_at_the_first_deadline() -> None:
    fake = FakeSlurm({"debug": "node[1-4]"})
    fake.fail_node("node2", reason="Not responding")
    asked = threading.Event()
    states = client_node_states(_fake_client(fake))

    def node_states(names: list[str]) -> dict[str, str]:
        try:
            return states(names)
        finally:
            asked.set()

    clock = Clock()
    live = tracker(clock, node_states)
    live.observe({1: 3})
    clock.now += 4.5
    live.lost()  # suspect: Slurm is asked in the background (its answer may already count)
    assert asked.wait(30)
    while live.slurm_state(1) is None:  # the answer lands just after the call returns
        threading.Event().wait(0.01)
    (lost,) = live.lost()
    assert lost.node_rank == 1 and lost.slurm_state is not None and "DOWN" in lost.slurm_state
    assert fake.calls[-1] == ["scontrol", "show", "node", "-o", "node2"]  # only the suspect node


def test_slurm_saying_the_node_is_up_does_not_save_a_silent_agent() -> None:
    fake = FakeSlurm({"debug": "node[1-4]"})
    clock = Clock()
    live = tracker(clock, client_node_states(_fake_client(fake)))
    live.observe({1: 3})
    clock.now += 4.5
    assert live.lost() == []
    while live.slurm_state(1) is None:
        threading.Event().wait(0.01)
    assert not slurm_says_dead(live.slurm_state(1) or "")
    assert live.lost() == []  # up per Slurm: give it the second deadline
    clock.now += 4.0
    (lost,) = live.lost()
    assert "two deadlines" in lost.why and "IDLE" in lost.why


def test_a_slow_scontrol_never_blocks_the_liveness_poll() -> None:
    release = threading.Event()

    def stuck(names: list[str]) -> dict[str, str]:
        release.wait()
        return {}

    clock = Clock()
    live = tracker(clock, stuck)
    live.observe({1: 3})
    clock.now += 4.5
    assert live.lost() == []  # returned although the query hangs
    clock.now += 4.0
    (lost,) = live.lost()  # the second deadline passes without Slurm's answer
    assert "no answer from Slurm" in lost.why
    release.set()


def test_many_suspects_at_once_make_one_slurm_query_in_flight() -> None:
    """200 agents go quiet together (node 0 starved, a network blip): slurmctld gets one query
    of the node list queued when it starts, and the ones found while it is in flight go into
    the next one: two queries in all, not 200 (nor 200 threads on node 0)."""
    release, started = threading.Event(), threading.Event()
    queries: list[list[str]] = []

    def slow(names: list[str]) -> dict[str, str]:
        queries.append(list(names))
        started.set()
        release.wait(30)
        return {n: "MIXED" for n in names}

    clock = Clock()
    names = {nr: f"node{nr}" for nr in range(1, 201)}
    live = Liveness(names, beat_interval_s=1.0, floor_s=3.0, first_beat_s=10.0, node_states=slow, clock=clock)
    live.observe({nr: 3 for nr in range(1, 101)})
    clock.now += 4.5
    assert live.lost() == []  # nodes 1-100 suspect: one query starts
    assert started.wait(30)
    live.observe({nr: 3 for nr in range(101, 201)})  # first beats of the others
    clock.now += 4.5
    # 101-200 suspect now too, while the first query hangs (1-100: past two deadlines, lost)
    assert {x.node_rank for x in live.lost()} == set(range(1, 101))
    assert len(queries) == 1 and sorted(queries[0]) == sorted(names[nr] for nr in range(1, 101))
    release.set()
    deadline = time.monotonic() + 30
    while any(live.slurm_state(nr) is None for nr in names) and time.monotonic() < deadline:
        threading.Event().wait(0.01)
    assert len(queries) == 2 and sorted(queries[1]) == sorted(names[nr] for nr in range(101, 201)), queries
    assert all(live.slurm_state(nr) == "MIXED" for nr in names)


@pytest.mark.parametrize(("state", "dead"), [("ALLOCATED", False), ("MIXED", False), ("IDLE", False),
                                             ("DOWN+NOT_RESPONDING", True), ("ALLOCATED+NOT_RESPONDING", True),
                                             ("MIXED+DRAIN", True), ("IDLE*", True), ("FAIL", True)])
def test_dead_states(state: str, dead: bool) -> None:
    assert slurm_says_dead(state) is dead


# ------------------------------------------------------------------ the beater
class FlakyStore:
    """A real store whose first ``failures`` sets raise like a dropped connection."""

    def __init__(self, failures: int) -> None:
        self.store = dist.HashStore()
        self.failures = failures
        self.connects = 0

    def connect(self) -> "FlakyStore":
        self.connects += 1
        return self

    def set(self, key: str, value: str) -> None:
        if self.failures > 0:
            self.failures -= 1
            raise dist.DistNetworkError("Connection reset by peer")
        self.store.set(key, value)


def test_the_beater_survives_transient_store_errors_with_backoff() -> None:
    flaky = FlakyStore(failures=6)
    ch = Channel(flaky.store, "1-0", bytes(32), ["a", "b"])
    sleeps: list[float] = []
    beater = Beater(lambda store, tick: ch.beat(1, tick, store), flaky.connect, interval_s=1.0,
                    sleep=sleeps.append)

    def sleep(s: float) -> None:
        sleeps.append(s)
        if beater.tick >= 10:
            beater.stopped.set()

    beater.sleep = sleep
    beater.run()
    assert beater.errors == 6 and flaky.connects == 7  # reconnected after every error
    assert ch.beats([1]) == {1: 10}  # and kept beating
    backoff = sleeps[:6]
    assert backoff == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]  # doubling, capped at the beat interval


# ------------------------------------------------------------------ checkpoint progress
def test_progress_is_the_newest_step_of_any_tier() -> None:
    p = CheckpointProgress([lambda: 20, lambda: None, lambda: 30]).start()
    assert p.latest() == 30


def test_an_unreadable_tier_gives_no_progress_but_no_error() -> None:
    def broken() -> int | None:
        raise OSError("stale file handle")

    assert CheckpointProgress([broken, lambda: 7]).start().latest() == 7


def test_a_slow_tier_delays_a_decision_only_up_to_the_bound() -> None:
    release = threading.Event()
    first = threading.Event()

    def slow() -> int | None:
        if first.is_set():
            release.wait()
            return 50
        first.set()
        return 40

    p = CheckpointProgress([slow], refresh_s=3600).start()
    assert p.latest(wait_s=30) == 40
    # The next read hangs (a metadata server stalls): the last value read comes back at once.
    assert p.latest(wait_s=0.05) == 40
    release.set()
    assert p.latest(wait_s=30) == 50
