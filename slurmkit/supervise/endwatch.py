"""An agent's wait for the end of a generation, pushed by the store instead of polled.

A generation ends when any agent posts a failure (or node 0 a lost agent) or when the last
slot reports it finished; either sets the generation's one end key
(slurmkit.supervise.channel.Channel.post_failure / post_finished). Each agent keeps one thread,
on its own store connection, blocked in one store ``wait`` on that key: the store wakes every
waiter the moment the key is set, so every agent notices a failure one round trip after it is
posted, and no agent polls the store to find out. At 2,048 agents that removes the poll of a
change counter every ``supervisor.poll_interval_s`` (two round trips a second per agent, two
thirds of the store's load) and the half poll interval that every agent waited on average
before it noticed.

The agent's main loop reads :meth:`EndWatch.ended` (no round trip) between its looks at its own
ranks. The watch never decides anything by itself: once the key is there the loop reads the
failure and the finish counts as before, and a key a stranger set without a failure or a finish
behind it ends nothing. When the watch cannot wait (the store failing, no connection) it says so
(:meth:`EndWatch.ended` returns None) and the loop polls the change counter as before, so a store
in trouble costs nothing more than it did.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Protocol

log = logging.getLogger(__name__)

#: The longest single wait. A timed-out wait is simply renewed; torch logs two warning lines
#: for each, so it is long: a generation that runs a day costs about 600 lines in the agent log.
WAIT_S = 300.0


class Waits(Protocol):
    """What the watch needs of the channel: one blocking wait on a generation's end key."""

    def wait_ended(self, gen: int, timeout_s: float) -> bool: ...


class EndWatch:
    """One agent's watch of the current generation's end key (see the module docstring).

    ``connect`` opens the watch's own connection (a channel over a new TCPStore client): a
    blocking wait holds its connection, and the agent's main loop must not wait behind it.
    """

    def __init__(self, connect: Callable[[], Waits], *, wait_s: float = WAIT_S) -> None:
        self._connect = connect
        self._wait_s = wait_s
        self._lock = threading.Lock()
        self._gen: int | None = None
        self._ended = threading.Event()
        self._failed = threading.Event()
        self._busy: threading.Thread | None = None  # the thread holding the connection
        self._conn: Waits | None = None

    def arm(self, gen: int) -> None:
        """Start watching ``gen`` (the generation the agent is about to run). A thread still
        waiting on an earlier generation (it ended without its key: node 0 lost) keeps its own
        connection; this one gets a new connection then."""
        with self._lock:
            if self._gen == gen:
                return
            self._gen = gen
            self._ended = threading.Event()
            self._failed = threading.Event()
            if self._busy is not None and self._busy.is_alive():
                self._conn = None  # held by the old waiter
            t = threading.Thread(target=self._run, args=(gen, self._ended, self._failed),
                                 name=f"end-watch-{gen}", daemon=True)
            self._busy = t
        t.start()

    def ended(self, gen: int) -> bool | None:
        """True once ``gen``'s end key is set; False while it is not; None when this watch cannot
        tell (not armed for ``gen``, or its store connection failed): poll instead."""
        with self._lock:
            if self._gen != gen:
                return None
            ended, failed = self._ended, self._failed
        if ended.is_set():
            return True
        return None if failed.is_set() else False

    def pause(self, gen: int, seconds: float) -> None:
        """The main loop's pause between looks at its ranks: ``seconds``, cut short the moment
        ``gen``'s end key is set (so a failure is noticed without waiting out the poll)."""
        with self._lock:
            ended = self._ended if self._gen == gen else None
        if ended is None:
            threading.Event().wait(seconds)
        else:
            ended.wait(seconds)

    def _run(self, gen: int, ended: threading.Event, failed: threading.Event) -> None:
        conn: Waits | None = None
        try:
            with self._lock:
                conn = self._conn
            if conn is None:
                conn = self._connect()
                with self._lock:
                    self._conn = conn
            while not conn.wait_ended(gen, self._wait_s):
                with self._lock:
                    if self._gen != gen:  # the agent moved on without this key being set
                        return
            ended.set()
        except Exception as exc:  # noqa: BLE001 - any failure here means: poll instead
            log.warning("the end-of-generation watch of generation %d stopped (%s: %s); polling instead",
                        gen, type(exc).__name__, exc)
            with self._lock:
                if conn is not None and self._conn is conn:
                    self._conn = None  # the next generation connects again
            failed.set()
