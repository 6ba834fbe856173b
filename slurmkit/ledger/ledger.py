"""The run's event ledger: one JSONL file per run that survives requeues.

Writers: the submitting CLI (once), ``slurmkit cancel``, and one node agent per node. Rank 0's
trainer does not open the ledger when it runs under an agent: it hands its events to its own
node's agent through a node-local spool (slurmkit.ledger.spool) and the agent writes them,
so each node has exactly one writer and nothing in the training process touches the shared
file system for the ledger.

An agent's ledger is batched: events are held in memory and written in one ``write()`` of
whole lines (O_APPEND) every ``flush_interval_s``, when ``max_batch_bytes`` are held, at once
for the events an engineer or a waiting process acts on (a failure, a decision, the end), and
at close. A write that fails (ENOSPC, EDQUOT, EIO, a stale NFS handle) keeps the events and
retries at the next flush; it is reported on stderr (first failure, then at most once per
``report_every_s``), counted in :attr:`Ledger.stats`, and recorded as a ``ledger_write_failed``
event once a write succeeds again. It never raises into the agent. What is held is bounded
(``max_held_bytes``): past it the oldest heartbeat samples go first, then the oldest events,
and the drop is counted.

Every record is validated against slurmkit.ledger.events before it is held, so a bad
record fails in the writer, not in a reader. Every figure about a run (goodput, MTTR, lost
work) is derived from this file; :func:`read_ledger` skips a torn line (a writer killed or a
disk filled mid-write) and recovers the whole record that follows one on the same line.
"""

from __future__ import annotations

import errno as errno_mod
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from slurmkit.ledger.events import check_read, encode, validate
from slurmkit.ledger.names import (ALLOCATION_START, CHECKPOINTED_ON_SIGNAL, CONFIG_WARNING, DECISION, END,
                                   EXCLUSION, FAILURE, HEARTBEAT, LEDGER_WRITE_FAILED, RANK_DATA_REFUSED,
                                   RANKS_STARTED, REQUEUE, SUCCESSOR, SUCCESSOR_REFUSED, TRAIN_FINISHED,
                                   TRAIN_STOPPED)
from slurmkit.runfiles import LEDGER_NAME
from slurmkit.untrusted import UntrustedDataError, bounded_lines, parse_object

log = logging.getLogger(__name__)

# Events someone acts on as soon as they are written (a test waiting for pids, `status`, the
# engineer tailing the file while node 0 decides): written at once, with what is held before them.
URGENT = frozenset({RANKS_STARTED, FAILURE, DECISION, EXCLUSION, REQUEUE, END,
                    CHECKPOINTED_ON_SIGNAL, TRAIN_FINISHED, TRAIN_STOPPED,
                    LEDGER_WRITE_FAILED, CONFIG_WARNING, ALLOCATION_START, SUCCESSOR,
                    SUCCESSOR_REFUSED})
RECORD_START = b'{"t": '  # every record the ledger writes begins so (the time is its first key)
LINE_BYTES = 4 * 1024 * 1024  # one record read back: a node's hang_stacks event is ~100 KiB
REFUSALS_NAMED = 20  # refused lines named per read of a ledger (a flood is cut short)


def _open_append(path: str) -> int:
    return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class Source(Protocol):
    """Something that hands over finished records written elsewhere (a node-local spool)."""

    def read_new(self) -> list[dict[str, Any]]: ...


def _refusals(src: Source) -> list[dict[str, Any]]:
    """What a source refused since it was last asked (``rank_data_refused`` fields), if it says."""
    take = getattr(src, "take_refusals", None)
    try:
        notes = take() if callable(take) else []
    except Exception:  # never let the report of a refusal fail the writer
        return []
    return [n for n in notes if isinstance(n, dict)]


@dataclass
class LedgerStats:
    written: int = 0  # records on disk
    flushes: int = 0  # successful write() batches
    failures: int = 0  # failed write attempts, in all
    dropped: int = 0  # records given up (held past max_held_bytes, or still held at close)
    rejected: int = 0  # records from a source that failed validation
    last_error: str = ""


class Ledger:
    """Append-only JSONL event log at ``path``; ``clock`` returns epoch seconds.

    ``flush_interval_s=0`` (the default, for one-shot writers such as the CLI) writes every
    record at once; a positive interval batches (a daemon thread flushes on that interval).
    ``opener`` and ``write`` are the file system calls (tests inject failing ones).
    """

    def __init__(self, path: str, *, source: str = "", clock: Callable[[], float] = time.time,
                 flush_interval_s: float = 0.0, max_batch_bytes: int = 64 * 1024,
                 max_held_bytes: int = 8 * 1024 * 1024, report_every_s: float = 60.0,
                 opener: Callable[[str], int] = _open_append,
                 write: Callable[[int, bytes], int] = os.write,
                 report: Callable[[str], None] = _stderr,
                 mono: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self.source = source
        self._clock, self._mono = clock, mono
        self.flush_interval_s = flush_interval_s
        self.max_batch_bytes, self.max_held_bytes = max_batch_bytes, max_held_bytes
        self.report_every_s = report_every_s
        self._opener, self._write, self._report = opener, write, report
        self._lock = threading.RLock()
        self._held: list[tuple[str, bytes]] = []  # (event name, encoded line), oldest first
        self._held_bytes = 0
        self._torn = False  # the last write stopped inside a line: start the next with "\n"
        self._sources: list[Source] = []
        self._failing_since: float | None = None  # epoch time of the first failure in a row
        self._failing_errno: str | None = None
        self._failures_in_row = 0
        self._worst_held = 0
        self._dropped_in_row = 0
        self._last_report: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.stats = LedgerStats()
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    # ------------------------------------------------------------------ writing
    def append(self, event: str, **fields: Any) -> dict[str, Any]:
        """Validate and hold (or write) one event; returns the record."""
        validate(event, fields)
        record: dict[str, Any] = {"t": round(self._clock(), 6), "event": event}
        if self.source:
            record["source"] = self.source
        record.update(fields)
        line = encode(record)  # before anything is held: a bad value raises here, in the caller
        with self._lock:
            self._pull()  # what a rank wrote before this event comes before it in the file
            self._hold(event, line)
            self._after_hold(event)
        return record

    def attach(self, source: Source) -> None:
        """Write the records ``source`` hands over (with their own time and source)."""
        with self._lock:
            self._sources.append(source)
        self._ensure_thread()

    def flush(self) -> bool:
        """Write everything held; True when nothing is left held. Never raises OSError."""
        with self._lock:
            self._pull()
            return self._flush_held()

    def close(self, *, retries: tuple[float, ...] = (0.2, 1.0, 3.0),
              sleep: Callable[[float], None] = time.sleep) -> bool:
        """Stop the flusher and write what is held, retrying a few times; True when all landed."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5.0)
        ok = self.flush()
        for delay in retries:
            if ok:
                break
            sleep(delay)
            ok = self.flush()
        if not ok:
            with self._lock:
                lost = len(self._held)
                self.stats.dropped += lost
                self._held, self._held_bytes = [], 0
            self._report(f"slurmkit ledger: gave up on {lost} event(s) for {self.path}: "
                         f"{self.stats.last_error}")
        return ok

    # ------------------------------------------------------------------ internals
    def _pull(self) -> None:
        for src in self._sources:
            try:
                records = src.read_new()
            except OSError as exc:  # a node-local spool that vanished: report, keep going
                self._note_failure(exc, what="read a rank's events")
                continue
            except Exception as exc:  # a reader's bug must not end the node's one ledger writer
                self.stats.rejected += 1
                self._report(f"slurmkit ledger: reading a rank's events failed: {exc!r:.200}")
                continue
            notes = _refusals(src)
            for rec in records:
                line, why = self._checked(rec)
                if line is not None:
                    self._hold(str(rec["event"]), line)
                elif len(notes) < REFUSALS_NAMED:
                    notes.append({"file": str(getattr(src, "path", "?")), "reason": why[:300]})
            self._hold_refusals(notes)

    def _hold_refusals(self, notes: list[dict[str, Any]]) -> None:
        """What a source refused, as ``rank_data_refused`` events of this writer: the file and why."""
        for note in notes:
            try:
                validate(RANK_DATA_REFUSED, note)
                record: dict[str, Any] = {"t": round(self._clock(), 6), "event": RANK_DATA_REFUSED}
                if self.source:
                    record["source"] = self.source
                record.update(note)
                self._hold(RANK_DATA_REFUSED, encode(record))
            except ValueError as exc:
                self._report(f"slurmkit ledger: a refusal could not be recorded: {exc}")
                continue
            self._report(f"slurmkit ledger: refused {note.get('file')}: {note.get('reason')}")

    def _checked(self, rec: Mapping[str, Any]) -> tuple[bytes | None, str]:
        """A record from a source, validated and re-encoded with ``t`` first; (None, why) if refused."""
        event = rec.get("event")
        fields = {k: v for k, v in rec.items() if k not in ("t", "event", "source")}
        try:
            if not isinstance(event, str) or not isinstance(rec.get("t"), (int, float)):
                raise ValueError("no event name or time")
            validate(event, fields)
            out: dict[str, Any] = {"t": rec["t"], "event": event}
            if isinstance(rec.get("source"), str):
                out["source"] = rec["source"]
            out.update(fields)
            return encode(out), ""
        except (ValueError, TypeError, RecursionError) as exc:
            self.stats.rejected += 1
            return None, f"event {str(event)[:60]!r}: {exc}"

    def _hold(self, event: str, line: bytes) -> None:
        self._held.append((event, line))
        self._held_bytes += len(line)
        if self._held_bytes > self.max_held_bytes:
            self._shed()

    def _shed(self) -> None:
        """Past the bound: the oldest heartbeat samples go first (the next sample supersedes
        them), then the oldest events. Every drop is counted (and reported at recovery)."""
        over = self._held_bytes - self.max_held_bytes
        for only in (HEARTBEAT, None):
            keep: list[tuple[str, bytes]] = []
            for ev, line in self._held:
                if over > 0 and only in (None, ev):
                    over -= len(line)
                    self._held_bytes -= len(line)
                    self.stats.dropped += 1
                    self._dropped_in_row += 1
                else:
                    keep.append((ev, line))
            self._held = keep
            if over <= 0:
                return

    def _after_hold(self, event: str) -> None:
        if self.flush_interval_s <= 0 or event in URGENT or self._held_bytes >= self.max_batch_bytes:
            self._flush_held()
        else:
            self._ensure_thread()

    def _ensure_thread(self) -> None:
        if self.flush_interval_s <= 0 or self._thread is not None or self._stop.is_set():
            return
        self._thread = threading.Thread(target=self._flusher, name="ledger-flush", daemon=True)
        self._thread.start()

    def _flusher(self) -> None:
        while not self._stop.wait(self.flush_interval_s):
            try:
                self.flush()
            except Exception as exc:  # the flusher must outlive any bug below it
                self._report(f"slurmkit ledger: flush failed: {exc!r}")

    def _flush_held(self) -> bool:
        if not self._held:
            return True
        prefix = b"\n" if self._torn else b""
        data = prefix + b"".join(line for _, line in self._held)
        done = 0
        try:
            fd = self._opener(self.path)
            try:
                while done < len(data):
                    n = self._write(fd, data[done:])
                    if n <= 0:
                        raise OSError(errno_mod.EIO, "write returned 0")
                    done += n
            finally:
                os.close(fd)
        except OSError as exc:
            self._consume(done, len(prefix))
            self._note_failure(exc, what="write")
            return False
        self._consume(done, len(prefix))
        self.stats.flushes += 1
        if self._failing_since is not None:
            self._recovered()
        return True

    def _consume(self, done: int, prefix_len: int) -> None:
        """Forget the records that reached the file; a record cut in two stays held whole
        (rewritten after a newline: the reader skips the fragment)."""
        if done < prefix_len:
            return
        self._torn = False
        left = done - prefix_len
        k = 0
        while k < len(self._held) and len(self._held[k][1]) <= left:
            left -= len(self._held[k][1])
            self._held_bytes -= len(self._held[k][1])
            k += 1
        self.stats.written += k
        self._held = self._held[k:]
        self._torn = left > 0

    def _note_failure(self, exc: OSError, *, what: str) -> None:
        self.stats.failures += 1
        self._failures_in_row += 1
        self._worst_held = max(self._worst_held, len(self._held))
        name = errno_mod.errorcode.get(exc.errno or 0, "")
        self.stats.last_error = f"{name + ': ' if name else ''}{exc.strerror or exc}"
        if self._failing_since is None:
            self._failing_since, self._failing_errno = self._clock(), name or None
        now = self._mono()
        if self._last_report is None or now - self._last_report >= self.report_every_s:
            self._last_report = now
            self._report(f"slurmkit ledger: cannot {what} {self.path}: {self.stats.last_error}; "
                         f"{len(self._held)} event(s) held, retrying "
                         f"{'every %gs' % self.flush_interval_s if self.flush_interval_s > 0 else 'at the next event'} "
                         f"({self._failures_in_row} failure(s) so far)")

    def _recovered(self) -> None:
        """Writes work again: say so in the ledger itself (the gap is part of the record)."""
        fields: dict[str, Any] = {
            "failures": self._failures_in_row, "error": self.stats.last_error,
            "errno": self._failing_errno, "first_failure_t": round(self._failing_since or 0.0, 6),
            "held": self._worst_held, "dropped": self._dropped_in_row}
        self._failing_since, self._failures_in_row = None, 0
        self._worst_held = self._dropped_in_row = 0
        self._last_report = None
        self._report(f"slurmkit ledger: writing {self.path} works again after "
                     f"{fields['failures']} failure(s); {fields['dropped']} event(s) dropped")
        record: dict[str, Any] = {"t": round(self._clock(), 6), "event": LEDGER_WRITE_FAILED}
        if self.source:
            record["source"] = self.source
        record.update(fields)
        self._hold(LEDGER_WRITE_FAILED, encode(record))
        self._flush_held()


def read_ledger(path: str, *, refused: Callable[[str], None] | None = None) -> Iterator[dict[str, Any]]:
    """Yield the events of a ledger. A torn line (a writer killed or a disk filled mid-write)
    is skipped; when another record was appended after the fragment on the same line, that
    record is recovered. A line that is not UTF-8 JSON within the limits of slurmkit.untrusted,
    not an object, or whose known fields have the wrong type (events.check_read) is skipped and
    named to ``refused`` (default: a warning in the log), never raised: status, report and the
    supervisor read this file, and any process of the user can append to it."""
    if not os.path.exists(path):
        return
    say = refused if refused is not None else _warn
    told = 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(bounded_lines(f, LINE_BYTES), 1):
            rec, why = parse_record(raw)
            if rec is not None:
                yield rec
            elif why and told < REFUSALS_NAMED and (raw.endswith(b"\n") or len(raw) > LINE_BYTES):
                told += 1  # (a last line without its newline is still being written)
                say(f"{path} line {lineno} skipped: {why}")


def _warn(message: str) -> None:
    log.warning("%s", message)


def parse_line(raw: bytes) -> dict[str, Any] | None:
    """One ledger line as a record, or None when no whole, well-typed record is on it."""
    return parse_record(raw)[0]


def parse_record(raw: bytes, max_bytes: int = LINE_BYTES) -> tuple[dict[str, Any] | None, str]:
    """(the record on one ledger or spool line, "") or (None, why not; "" for an empty line)."""
    raw = raw.strip()
    if not raw:
        return None, ""
    starts = [0]
    last = raw.rfind(RECORD_START)
    if last > 0:
        starts.append(last)
    why = ""
    for start in starts:
        try:
            value = parse_object(raw[start:], max_bytes=max_bytes)
        except UntrustedDataError as exc:
            why = why or str(exc)
            continue
        problem = check_read(value)
        if problem is None:
            return value, ""
        why = why or problem
    return None, why
