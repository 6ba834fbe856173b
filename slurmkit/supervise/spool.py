"""Rank events handed to the node's agent through a node-local file, not the shared ledger.

Rank 0 of the trainer has events for the ledger (training started, checkpoints saved and
durable, finished). Under an agent it appends them to a spool file in the node-local directory
(``$SLURMKIT_EVENTS_FILE``, beside the heartbeats) and the agent, the node's one ledger writer,
reads what is new and writes it into the ledger in order with its own events (the agent pulls
the spool before each of its own events, so "train_finished" always precedes the agent's "end").
The rank never opens the shared ledger, and the shared file keeps one writer per node.

Writing the spool never raises into training: a full /dev/shm is reported on stderr and the
event is lost (the checkpoint itself is unaffected).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any

from slurmkit.supervise.events import encode, validate
from slurmkit.supervise.ledger import parse_line


class SpoolWriter:
    """The rank side: ``append(event, **fields)`` like a Ledger, into a node-local file."""

    def __init__(self, path: str, *, source: str = "rank0",
                 clock: Callable[[], float] = time.time) -> None:
        self.path, self.source, self._clock = path, source, clock
        self.lost = 0
        os.makedirs(os.path.dirname(os.path.abspath(path)), mode=0o700, exist_ok=True)

    def append(self, event: str, **fields: Any) -> dict[str, Any]:
        validate(event, fields)
        record: dict[str, Any] = {"t": round(self._clock(), 6), "event": event, "source": self.source}
        record.update(fields)
        line = encode(record)
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, line)  # one local append of one line: never torn by a reader
            finally:
                os.close(fd)
        except OSError as exc:
            self.lost += 1
            print(f"slurmkit: cannot hand event {event!r} to the node agent ({self.path}): {exc}",
                  file=sys.stderr, flush=True)
        return record


class SpoolReader:
    """The agent side: the whole lines appended since the last call (a Ledger source)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._offset = 0
        self._partial = b""

    def read_new(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self._offset += len(data)
        data = self._partial + data
        lines = data.split(b"\n")
        self._partial = lines.pop()  # what follows the last newline is still being written
        out = []
        for raw in lines:
            rec = parse_line(raw)
            if rec is not None:
                out.append(rec)
        return out
