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

from slurmkit.ledger.events import encode, validate
from slurmkit.ledger.ledger import parse_record
from slurmkit.untrusted import UntrustedDataError, open_regular

READ_BYTES = 4 * 1024 * 1024  # read per call: a rank that floods its spool is read in slices
LINE_BYTES = 256 * 1024  # one event of rank 0 is well under 1 KiB
REFUSALS_HELD = 10  # refusals named per pull (the rest are counted)


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
    """The agent side: the whole lines appended since the last call (a Ledger source).

    The spool is the rank's: every line is parsed within the limits of slurmkit.untrusted and
    type-checked (events.check_read; the ledger validates it again before writing it). A line
    that fails is skipped and named (:meth:`take_refusals`, which the ledger writes as a
    ``rank_data_refused`` event); a FIFO, a link or a device in its place is never opened, at most
    ``READ_BYTES`` are read per call, and a line longer than ``LINE_BYTES`` is dropped, not held."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._offset = 0
        self._partial = b""
        self._skipping = False  # inside a line already refused for its length
        self._unreadable = False  # refused as a whole (said once)
        self._refusals: list[dict[str, Any]] = []
        self.refused = 0

    def read_new(self) -> list[dict[str, Any]]:
        data = self._read()
        self._offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()  # what follows the last newline is still being written
        if self._skipping and lines:
            lines.pop(0)  # the end of the overlong line
            self._skipping = False
        if len(self._partial) > LINE_BYTES:
            self._refuse(f"a line over {LINE_BYTES} bytes")
            self._partial, self._skipping = b"", True
        out = []
        for raw in lines:
            rec, why = parse_record(raw, LINE_BYTES)
            if rec is not None:
                out.append(rec)
            elif why:
                self._refuse(why)
        return out

    def _read(self) -> bytes:
        """What was appended, at most READ_BYTES; b"" (the reason refused once) when the file
        is not there or is not a regular file of its own."""
        try:
            fd = open_regular(self.path)
        except FileNotFoundError:
            return b""
        except (OSError, UntrustedDataError) as exc:  # a link (ELOOP), a FIFO, a device
            if not self._unreadable:
                self._refuse(f"cannot be read: {exc}")
            self._unreadable = True
            return b""
        self._unreadable = False
        try:
            if os.fstat(fd).st_size < self._offset:  # truncated and written again: read it anew
                self._offset, self._partial, self._skipping = 0, b"", False
            return os.pread(fd, READ_BYTES, self._offset)
        finally:
            os.close(fd)

    def _refuse(self, why: str) -> None:
        self.refused += 1
        if len(self._refusals) < REFUSALS_HELD:
            self._refusals.append({"file": self.path, "reason": why[:300], "count": self.refused})

    def take_refusals(self) -> list[dict[str, Any]]:
        """The refusals since the last call (at most REFUSALS_HELD; ``count`` numbers them all)."""
        out, self._refusals = self._refusals, []
        return out
