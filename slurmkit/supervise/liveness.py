"""Node 0's view of which agents are alive: deadlines that scale, confirmed with Slurm.

Every agent bumps a beat counter in the store (slurmkit.supervise.channel) from its own thread;
node 0 reads all counters in one round trip per poll. An agent is *suspect* once its counter
has not moved for its deadline (slurmkit.supervise.timeouts.liveness_deadline_s of the interval
measured for that agent), and *lost* only when

- Slurm confirms it: the controller calls the node DOWN, FAIL, NOT_RESPONDING or drained; or
- it stays silent for a second deadline whatever Slurm says (the node may be up while the
  agent is dead, and an unreachable controller must not keep a job waiting forever).

The Slurm query runs in a background thread with a short retry budget; ``poll`` never blocks
on it, so a slow ``scontrol`` delays nothing but the confirmation itself. What Slurm said is
kept and goes into the decision's evidence without asking again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from slurmkit.supervise.timeouts import liveness_deadline_s

log = logging.getLogger(__name__)

_DEAD_STATES = frozenset({"DOWN", "FAIL", "FAILING", "NOT_RESPONDING", "DRAIN", "DRAINED", "DRAINING",
                          "POWER_DOWN", "POWERED_DOWN"})

#: Ask Slurm about nodes; returns ``{name: "STATE+FLAG+..."}`` for the nodes it knows.
NodeStates = Callable[[list[str]], Mapping[str, str]]


def slurm_says_dead(state: str) -> bool:
    return any(part in _DEAD_STATES for part in state.replace("*", "+NOT_RESPONDING").split("+"))


@dataclass
class _Agent:
    value: int
    changed: float  # when the counter last moved (node 0's clock)
    interval: float  # measured time between moves (moving average)
    beaten: bool  # sent at least one beat
    suspect_since: float | None = None
    slurm_state: str | None = None


@dataclass(frozen=True)
class Lost:
    node_rank: int
    silent_s: float
    why: str  # how it was confirmed, for the evidence
    slurm_state: str | None


class Liveness:
    """Track ``names`` (node rank -> name) from their beat counters."""

    def __init__(self, names: Mapping[int, str], *, beat_interval_s: float, floor_s: float,
                 first_beat_s: float, node_states: NodeStates | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.names = dict(names)
        self.beat_interval_s, self.floor_s, self.first_beat_s = beat_interval_s, floor_s, first_beat_s
        self._node_states = node_states
        self.clock = clock
        self._agents: dict[int, _Agent] = {}
        self._asking: set[int] = set()  # queued or in the query in flight
        self._queued: list[int] = []
        self._asker_busy = False
        self._lock = threading.Lock()

    def deadline_s(self, nr: int) -> float:
        a = self._agents.get(nr)
        if a is None or not a.beaten:
            return self.first_beat_s  # the agent may still be starting (srun skew, imports)
        measured = min(a.interval, 10 * self.beat_interval_s)  # a lagging agent widens its own
        return liveness_deadline_s(measured, self.floor_s)

    def observe(self, beats: Mapping[int, int]) -> None:
        """One read of the counters (channel.beats)."""
        now = self.clock()
        for nr, v in beats.items():
            a = self._agents.get(nr)
            if a is None:
                self._agents[nr] = _Agent(v, now, self.beat_interval_s, v > 0)
            elif v != a.value:
                if a.beaten:
                    a.interval = 0.7 * a.interval + 0.3 * (now - a.changed)
                a.value, a.changed, a.beaten = v, now, a.beaten or v > 0
                if a.suspect_since is not None:
                    log.warning("agent on %s beats again after %.1f s", self.names[nr], now - a.suspect_since)
                a.suspect_since = None

    def lost(self) -> list[Lost]:
        """Agents confirmed lost now (never blocks; Slurm is asked in the background)."""
        now, out = self.clock(), []
        new: list[int] = []  # suspect since this look: asked about together
        for nr, a in self._agents.items():
            silent = now - a.changed
            deadline = self.deadline_s(nr)
            if silent <= deadline:
                continue
            if a.suspect_since is None:
                a.suspect_since = now
                if len(new) < 8:
                    log.warning("agent on %s silent for %.1f s (deadline %.1f s): asking Slurm",
                                self.names[nr], silent, deadline)
                new.append(nr)
            with self._lock:
                state = a.slurm_state
            if state is not None and slurm_says_dead(state):
                out.append(Lost(nr, silent, f"Slurm says {state}", state))
            elif silent > 2 * deadline:
                said = f"Slurm says {state}" if state is not None else "no answer from Slurm"
                out.append(Lost(nr, silent, f"silent for two deadlines ({said})", state))
        if len(new) > 8:
            log.warning("and %d more agents silent past their deadline: asking Slurm", len(new) - 8)
        self._ask(new)
        return out

    def forget(self, nr: int) -> None:
        """Track ``nr`` afresh from its next beat (its agent was relaunched: the new one is judged
        by its own beats, not by its predecessor's silence)."""
        with self._lock:
            self._agents.pop(nr, None)

    def slurm_state(self, nr: int) -> str | None:
        a = self._agents.get(nr)
        with self._lock:
            return a.slurm_state if a else None

    def _ask(self, nrs: list[int]) -> None:
        """Queue ``nrs`` for Slurm's view. One query is in flight at a time, for every node queued
        when it starts (one ``scontrol show node`` of a node list): when many agents go quiet at
        once (node 0 starved, a network blip) slurmctld gets one RPC, not one per node, and node
        0 does not start a thread and a subprocess per suspect."""
        if self._node_states is None or not nrs:
            return
        with self._lock:
            for nr in nrs:
                if nr not in self._asking:
                    self._asking.add(nr)
                    self._queued.append(nr)
            if self._asker_busy or not self._queued:
                return
            self._asker_busy = True
        threading.Thread(target=self._ask_queued, name="slurm-view", daemon=True).start()

    def _ask_queued(self) -> None:
        while True:
            with self._lock:
                batch, self._queued = self._queued, []
                if not batch:
                    self._asker_busy = False
                    return
            names = [self.names[nr] for nr in batch]
            try:
                states = self._node_states(names)  # type: ignore[misc]
            except Exception as exc:  # noqa: BLE001 - a broken controller is no answer
                log.warning("Slurm's view of %s: %s", ",".join(names[:8]) + (" ..." if len(names) > 8 else ""), exc)
                states = {}
            with self._lock:
                for nr, name in zip(batch, names):
                    a = self._agents.get(nr)  # None: forgotten meanwhile (relaunched)
                    if name in states and a is not None:
                        a.slurm_state = states[name]
                    self._asking.discard(nr)


def client_node_states(client: object) -> NodeStates:
    """``NodeStates`` through the supervisor's Slurm client, with the decision retry budget."""
    from slurmkit.supervise.slurmview import DECISION_RETRY, DECISION_TIMEOUT_S

    def states(names: list[str]) -> dict[str, str]:
        found = client.bounded(DECISION_RETRY, DECISION_TIMEOUT_S).nodes(names)  # type: ignore[attr-defined]
        return {n.name: "+".join([n.state, *n.flags]) for n in found}

    return states



class Beater:
    """An agent's beats, from a thread with its own store connection (so a busy main loop,
    stopping ranks or waiting for a decision, never looks like a lost node).

    A store error is not the end: the beater reconnects and retries with backoff (0.1 s
    doubling, capped at the beat interval) for as long as the agent lives. Whether the silence
    in between was too long is node 0's call (its deadlines), not this thread's.
    """

    def __init__(self, beat: Callable[[object, int], None], connect: Callable[[], object], *,
                 interval_s: float, sleep: Callable[[float], None] = time.sleep) -> None:
        self._beat, self._connect = beat, connect
        self.interval_s, self.sleep = interval_s, sleep
        self.tick = 0
        self.errors = 0
        # The store error of the beats failing now (None: the last beat reached the store). The
        # main loop of a follower reads it instead of a round trip of its own to find a store
        # that is gone (slurmkit.supervise.loop.Supervisor._watch_node0).
        self.failing: BaseException | None = None
        self.stopped = threading.Event()

    def run(self) -> None:
        store: object | None = None
        backoff = 0.1
        while not self.stopped.is_set():
            try:
                if store is None:
                    store = self._connect()
                self.tick += 1
                self._beat(store, self.tick)
            except (RuntimeError, OSError) as exc:  # torch's DistStoreError/DistNetworkError
                self.errors += 1
                self.failing = exc
                if self.errors == 1 or self.errors % 100 == 0:
                    log.warning("beat failed (%d so far), retrying in %.1f s: %s", self.errors, backoff, exc)
                store = None
                self.sleep(backoff)
                backoff = min(backoff * 2, max(self.interval_s, 0.1))
                continue
            backoff = 0.1
            self.failing = None
            self.sleep(self.interval_s)

    def start(self) -> "Beater":
        threading.Thread(target=self.run, name="agent-alive", daemon=True).start()
        return self
