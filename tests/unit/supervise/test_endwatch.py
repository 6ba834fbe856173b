"""The end of a generation pushed by the store (slurmkit.supervise.endwatch), on a real TCPStore:
a failure or the last finish wakes every agent's watch; a watch that cannot wait says so (the
loop then polls); the loop notices a failure without waiting out its poll interval, and a
follower's steady state costs no store round trip per poll."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from slurmkit.supervise.channel import Channel
from slurmkit.failures.classes import FailureClass as F
from slurmkit.supervise.endwatch import EndWatch
from slurmkit.supervise.policy import Action
from tests.unit.supervise.test_loop import Cluster, Script

TOKEN = bytes(range(32))
NODES = ("n0", "n1", "n2")


@pytest.fixture()
def server() -> Any:
    s = dist.TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True, wait_for_workers=False,
                      timeout=timedelta(seconds=30))
    yield s
    del s


def channel_on(port: int) -> Channel:
    store = dist.TCPStore("127.0.0.1", port, is_master=False, use_libuv=True, timeout=timedelta(seconds=30))
    return Channel(store, "7-0", TOKEN, NODES)


def wait_until(cond: Any, what: str, deadline_s: float = 60.0) -> None:
    end = time.monotonic() + deadline_s
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_a_failure_wakes_every_watch(server: Any) -> None:
    watches = [EndWatch(lambda: channel_on(server.port)) for _ in NODES]
    for w in watches:
        w.arm(0)
    assert [w.ended(0) for w in watches] == [False, False, False]
    channel_on(server.port).post_failure(0, "n1", 3, F.RANK_CRASH)
    wait_until(lambda: all(w.ended(0) for w in watches), "every watch to see the failure")
    assert [w.ended(1) for w in watches] == [None, None, None]  # not armed for generation 1


def test_only_the_last_finish_ends_the_generation(server: Any) -> None:
    w = EndWatch(lambda: channel_on(server.port))
    w.arm(0)
    ch = channel_on(server.port)
    ch.post_finished(0, "completed", 3)
    ch.post_finished(0, "signalled", 3)
    assert ch.finished(0) == (1, 1)
    assert w.ended(0) is False  # two of three slots
    ch.post_finished(0, "completed", 3)
    wait_until(lambda: w.ended(0), "the last finish to end the generation")


def test_a_timed_out_wait_is_renewed_and_a_new_generation_rearms(server: Any) -> None:
    w = EndWatch(lambda: channel_on(server.port), wait_s=0.05)
    w.arm(0)
    ch = channel_on(server.port)
    wait_until(lambda: ch.store.check(["never"]) is False, "a store answer")  # several waits time out meanwhile
    assert w.ended(0) is False
    ch.post_failure(0, "n0", 0, F.HANG)
    wait_until(lambda: w.ended(0), "generation 0's end")
    w.arm(1)
    assert w.ended(1) is False and w.ended(0) is None
    ch.post_failure(1, "n2", 1, F.RANK_CRASH)
    wait_until(lambda: w.ended(1), "generation 1's end")


def test_a_watch_that_cannot_connect_says_poll(server: Any) -> None:
    def refuse() -> Channel:
        raise RuntimeError("connection refused")

    w = EndWatch(refuse)
    w.arm(0)
    wait_until(lambda: w.ended(0) is None, "the watch to give up")


def test_a_store_that_goes_away_says_poll() -> None:
    s = dist.TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True, wait_for_workers=False)
    w = EndWatch(lambda: channel_on(s.port))
    w.arm(0)
    wait_until(lambda: w._conn is not None, "the watch's connection")  # noqa: SLF001 - a test of its state
    assert w.ended(0) is False
    del s  # the server closes every connection: the blocked wait fails
    wait_until(lambda: w.ended(0) is None, "the watch to give up on the closed store")


def test_pause_is_cut_short_by_the_end(server: Any) -> None:
    w = EndWatch(lambda: channel_on(server.port))
    w.arm(0)
    done = threading.Event()

    def pause() -> None:
        w.pause(0, 3600.0)
        done.set()

    threading.Thread(target=pause, daemon=True).start()
    assert not done.wait(0.1)
    channel_on(server.port).post_failure(0, "n1", 0, F.RANK_CRASH)
    wait_until(done.is_set, "the pause to end with the generation")


def test_the_loop_notices_a_failure_without_waiting_out_its_poll(tmp_path: Path) -> None:
    """A poll interval of an hour: polled, this run would take hours; pushed, the failure of
    node 1 reaches every agent at once, node 0 decides a restart and generation 1 completes."""
    c = Cluster(tmp_path, [Script(), Script(fail={0: F.RANK_CRASH}), Script()], poll_interval_s=3600.0)
    assert c.run() == {0: 0, 1: 0, 2: 0}
    assert c.decisions() == [(0, Action.RESTART, ())]
    assert [e["cls"] for e in c.ledger.of("failure")] == ["rank_crash"]


class CountingStore:
    """A store wrapper that counts round trips (every call)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.calls = inner, 0
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if not callable(attr):
            return attr

        def counted(*a: Any, **k: Any) -> Any:
            with self._lock:
                self.calls += 1
            return attr(*a, **k)
        return counted


def follower_window(c: Cluster, gate: threading.Event) -> tuple[int, int]:
    """Run ``c`` and count node 1's main-loop store calls over 30 of its polls while the
    generation runs (its beats go on their own connection, as the agent's Beater's do: not
    counted); then open ``gate`` so the run ends. (polls, calls) in that window."""
    follower = c.sups[1]
    counting = CountingStore(c.store)
    follower.channel.store = counting
    real_beat = follower.channel.beat
    follower.channel.beat = lambda nr, tick, store=None: real_beat(nr, tick, c.store)  # type: ignore[method-assign,assignment]
    polls = [0]
    poll = c.nodes[1].poll

    def counted_poll(gen: int) -> Any:
        polls[0] += 1
        return poll(gen)

    c.nodes[1].poll = counted_poll  # type: ignore[method-assign]
    window: list[tuple[int, int]] = []

    def measure() -> None:
        wait_until(lambda: polls[0] >= 3, "node 1's first polls")
        p0, c0 = polls[0], counting.calls
        wait_until(lambda: polls[0] >= p0 + 30, "30 more polls")
        window.append((polls[0] - p0, counting.calls - c0))
        gate.set()

    threading.Thread(target=measure, daemon=True).start()
    assert c.run() == {0: 0, 1: 0}
    assert window
    return window[0]


@pytest.mark.parametrize("push", [True, False])
def test_a_followers_steady_state_costs_no_round_trip_per_poll(tmp_path: Path, push: bool) -> None:
    """Node 1's main-loop store calls over 30 of its polls while the generation runs: with the
    end pushed, none (node 0's beat is read once per beat interval, set here longer than the
    test); polled, the change counter at every poll."""
    gate = threading.Event()
    c = Cluster(tmp_path, [Script(gate=gate), Script(gate=gate)], poll_interval_s=0.02, push=push)
    c.sups[1].beat_interval_s = 3600.0
    n_polls, calls = follower_window(c, gate)
    if push:
        assert calls <= 1, (n_polls, calls)  # at most its node-0 beat read falling in the window
    else:
        assert calls >= n_polls - 1, (n_polls, calls)  # one change-counter read per poll


class Beats:
    """What the loop reads of an agent's alive thread (slurmkit.supervise.liveness.Beater)."""

    failing: BaseException | None = None


@pytest.mark.parametrize("beater", [True, False])
def test_a_watching_followers_store_check_rides_on_its_beats(tmp_path: Path, beater: bool) -> None:
    """Node 1's main-loop store calls over 30 polls with a beat interval shorter than a poll:
    with its alive thread given to the loop, none (a store gone shows up as failing beats);
    without it, the main loop reads node 0's beat once per beat interval itself."""
    gate = threading.Event()
    c = Cluster(tmp_path, [Script(gate=gate), Script(gate=gate)], poll_interval_s=0.02)
    c.sups[1].beat_interval_s = 0.001
    c.sups[1].beater = Beats() if beater else None  # type: ignore[assignment]
    n_polls, calls = follower_window(c, gate)
    if beater:
        assert calls == 0, (n_polls, calls)
    else:
        assert calls >= n_polls - 1, (n_polls, calls)  # node 0's beat read at (nearly) every poll


def test_failing_beats_are_store_trouble_for_a_watching_follower(tmp_path: Path) -> None:
    """The follower's look at the store is its beats: while they fail, the watch sees a store
    error (the store-trouble path: Node0Lost after two liveness deadlines), with no round trip
    of its own; once a beat gets through again, nothing."""
    c = Cluster(tmp_path, [Script(), Script()])
    follower = c.sups[1]
    beats = Beats()
    follower.beater = beats  # type: ignore[assignment]
    counting = CountingStore(c.store)
    follower.channel.store = counting
    follower._watch_node0(0)  # noqa: SLF001
    beats.failing = dist.DistNetworkError("Connection reset by peer")
    with pytest.raises(RuntimeError, match="beats fail: Connection reset by peer"):
        follower._watch_node0(0)  # noqa: SLF001
    beats.failing = None
    follower._watch_node0(0)  # noqa: SLF001
    assert counting.calls == 0


def test_a_follower_reads_the_failure_once_per_failed_generation(tmp_path: Path) -> None:
    """The watch reads the failure that ended the generation; the stop (a hang's stacks or not)
    uses that notice instead of reading the key again."""
    c = Cluster(tmp_path, [Script(), Script(fail={0: F.RANK_CRASH}), Script()])
    follower = c.sups[2]
    keys: list[str] = []
    store = follower.channel.store

    class Keys:
        def __getattr__(self, name: str) -> Any:
            attr = getattr(store, name)

            def call(*a: Any, **k: Any) -> Any:
                if a and isinstance(a[0], str):
                    keys.append(a[0])
                return attr(*a, **k)
            return call

    follower.channel.store = Keys()
    assert c.run() == {0: 0, 1: 0, 2: 0}
    assert c.decisions() == [(0, Action.RESTART, ())]
    fail_key = follower.channel._gen(0, "fail")  # noqa: SLF001
    assert keys.count(fail_key) == 1, keys


def test_a_follower_waiting_on_a_slow_decision_looks_at_node0_once_per_deadline(tmp_path: Path) -> None:
    """Node 0 takes 1.5 s to decide. A follower's wait on the decision key is renewed once per
    node 0 liveness deadline (supervisor.node_timeout_s=1 here), not once per beat interval
    (0.01 s here: some 150 timed-out waits, each an exception and a log line in torch)."""
    c = Cluster(tmp_path, [Script(), Script(fail={0: F.RANK_CRASH}), Script()])
    decide = c.sups[0].node0_decide

    def slow(gen: int, participants: list[int]) -> Any:
        time.sleep(1.5)  # the slow decision this test is about (node 0's work, not a wait)
        return decide(gen, participants)

    c.sups[0].node0_decide = slow  # type: ignore[method-assign]
    follower = c.sups[2]
    key = follower.channel._gen(0, "decision")  # noqa: SLF001
    waits = [0]
    store = follower.channel.store

    class Waits:
        def __getattr__(self, name: str) -> Any:
            attr = getattr(store, name)
            if name != "wait":
                return attr

            def wait(keys: list[str], *a: Any) -> Any:
                if key in keys:
                    waits[0] += 1
                return attr(keys, *a)
            return wait

    follower.channel.store = Waits()
    assert c.run() == {0: 0, 1: 0, 2: 0}
    assert c.decisions() == [(0, Action.RESTART, ())]
    assert 1 <= waits[0] <= 3, waits
