"""This node's clock offset to node 0, measured through the agents' store.

Why ticks and not a request/response served by node 0: node 0 would then answer every agent (2,048
requests, each a read and a write on its side, all at once at a generation's start). Instead node
0's agent posts a *tick* every ``TICK_S``: its wall-clock time, sealed, under a fresh key, then a
counter (slurmkit.supervise.channel). That is three local store operations per tick whatever the
number of agents, and it wakes only the agents that wait on it. An agent measures one sample as
NTP does one exchange: it notes its own time ``sent``, reads the counter (k), waits for tick k+1
(one store wait) and notes ``received``. Tick k+1 did not exist when the counter read k, so node
0 stamped it after ``sent`` and before ``received`` (less the microseconds between node 0's stamp
and its own local writes: node 0 hosts the store). Node 0's clock minus this node's is then
``node0 - (sent + received) / 2``, within half the sample's round trip; of a few samples the one
with the shortest round trip is kept. With ticks every 50 ms a sample takes about 25 ms plus a
round trip, so the uncertainty stays near the network's own.

A node is bad only when its offset is beyond ``health.max_clock_offset_s`` even at the edge of
that uncertainty: a slow network is not a wrong clock. No tick in time (node 0 unreachable, or
not ticking) is ``wait``: node 0's trouble is not this node's.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from slurmkit.errors import ConfigError
from slurmkit.health.result import CheckResult, bad, ok, skipped, wait

log = logging.getLogger(__name__)
NAME = "clock"
TICK_S = 0.05  # node 0 posts its time this often
# Tests only (docs/health.md "Pre-flight"): "NODE:SECONDS[,NODE:SECONDS]" shifts those nodes' clocks as
# the clock check and node 0's ticks see them, so a test can make one node's clock wrong.
TEST_OFFSET_ENV = "SLURMKIT_TEST_CLOCK_OFFSET_S"


@dataclass(frozen=True)
class Sample:
    """One exchange, all in seconds of wall-clock time: this node's before and after, node 0's
    in between."""

    sent: float
    node0: float
    received: float

    @property
    def rtt_s(self) -> float:
        return self.received - self.sent

    @property
    def offset_s(self) -> float:
        """Node 0's clock minus this node's (positive: this node is behind)."""
        return self.node0 - (self.sent + self.received) / 2

    @property
    def uncertainty_s(self) -> float:
        return max(self.rtt_s, 0.0) / 2


def best_sample(samples: list[Sample]) -> Sample | None:
    """The sample with the shortest round trip (the tightest bound), ignoring any whose local
    clock stepped backwards while it ran (negative round trip)."""
    usable = [s for s in samples if s.rtt_s >= 0]
    return min(usable, key=lambda s: s.rtt_s) if usable else None


def judge_offset(sample: Sample, max_offset_s: float, samples: int) -> CheckResult:
    """The verdict on one node's best sample: bad only when beyond the bound even at the edge
    of the measurement's uncertainty."""
    figures: dict[str, float | int] = {"offset_s": round(sample.offset_s, 6),
                                       "uncertainty_s": round(sample.uncertainty_s, 6),
                                       "rtt_s": round(sample.rtt_s, 6), "samples": samples,
                                       "max_offset_s": max_offset_s}
    if abs(sample.offset_s) - sample.uncertainty_s > max_offset_s:
        ahead = "behind" if sample.offset_s > 0 else "ahead of"
        return bad(NAME, f"this node's clock is {abs(sample.offset_s):.3f} s {ahead} node 0's "
                   f"(+/- {sample.uncertainty_s:.3f} s)",
                   f"clocks within health.max_clock_offset_s={max_offset_s:g} s of node 0's",
                   "fix the node's time sync (`chronyc tracking` or `ntpq -p` on it), or raise "
                   "health.max_clock_offset_s", **figures)
    return ok(NAME, f"offset to node 0 {sample.offset_s:+.4f} s (+/- {sample.uncertainty_s:.4f} s)", **figures)


def injected_offset_s(env: Mapping[str, str], node: str) -> float:
    """The test hook's shift of ``node``'s clock in seconds (0.0 without it)."""
    text = env.get(TEST_OFFSET_ENV, "").strip()
    shifts: dict[str, float] = {}
    for item in filter(None, text.split(",")):
        name, _, value = item.partition(":")
        try:
            shifts[name.strip()] = float(value)
        except ValueError:
            raise ConfigError(f"{TEST_OFFSET_ENV}={text!r}", "NODE:SECONDS[,NODE:SECONDS] (a test hook)",
                              f"unset {TEST_OFFSET_ENV}") from None
    return shifts.get(node, 0.0)


class ClockCheck:
    """The ``clock`` check of one agent: ``connect`` gives a channel over the check's own store
    connection (made on first use, kept across generations)."""

    def __init__(self, connect: Callable[[], Any], *, node_rank: int, num_nodes: int, max_offset_s: float,
                 samples: int = 4, now: Callable[[], float] = time.time,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
        self.connect, self.node_rank, self.num_nodes = connect, node_rank, num_nodes
        self.max_offset_s, self.samples = max_offset_s, samples
        self.now, self.clock, self.sleep = now, clock, sleep
        self._channel: Any = None

    def __call__(self, deadline_s: float) -> CheckResult:
        if self.num_nodes < 2:
            return skipped(NAME, "a single-node job has no node 0 to compare with")
        if self.node_rank == 0:
            return ok(NAME, "node 0 keeps the reference time", offset_s=0.0)
        if self._channel is None:
            self._channel = self.connect()
        got = self.measure(self._channel, self.clock() + 0.8 * deadline_s)
        best = best_sample(got)
        if best is None:
            return wait(NAME, f"no clock tick from node 0 within {0.8 * deadline_s:.1f} s",
                        "node 0's agent posts its time every few tens of milliseconds",
                        "look at node 0 (its agent, its load, the network to it); this node is not the cause",
                        samples=0)
        return judge_offset(best, self.max_offset_s, len(got))

    def measure(self, channel: Any, until: float) -> list[Sample]:
        out: list[Sample] = []
        for i in range(self.samples):
            if self.clock() >= until:
                break
            # Each sample starts later after the last tick than the one before, so the samples
            # wait different fractions of a tick period and one of them has a short round trip
            # (back to back, each would wait one whole period).
            self.sleep(TICK_S * 0.9 * i / self.samples)
            sent = self.now()
            tick = channel.clock_seq()
            node0 = channel.wait_clock_tick(tick + 1, min(1.0, until - self.clock()))
            received = self.now()
            if node0 is not None:
                out.append(Sample(sent, node0, received))
        return out


class ClockTicker:
    """Node 0's ticks, on a daemon thread with its own store connection, for the agent's life."""

    def __init__(self, connect: Callable[[], Any], *, now: Callable[[], float] = time.time,
                 interval_s: float = TICK_S) -> None:
        self.connect, self.now, self.interval_s = connect, now, interval_s
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="clock-ticks", daemon=True)

    def start(self) -> ClockTicker:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopped.set()

    def _run(self) -> None:
        try:
            channel = self.connect()
            tick = channel.clock_seq()  # an earlier ticker of this attempt (none: 0)
            while not self.stopped.is_set():
                tick += 1
                channel.post_clock_tick(tick, self.now())
                self.stopped.wait(self.interval_s)
        except Exception as exc:  # noqa: BLE001 - the agents' clock checks then say "wait"
            if not self.stopped.is_set():
                log.warning("node 0's clock ticks stopped: %r (the clock checks will wait)", exc)
