"""GPU Xid and uncorrected memory errors in the kernel log since the last check.

The source is pluggable: ``/dev/kmsg`` (the kernel's ring buffer, one record per read, a
sequence number as the cursor) or a text file with one message per line (a site's kern.log, or
a test's emulated log), a byte offset as the cursor. Each source remembers where the last check
stopped, so a check only sees what is new; the first check of an agent looks back
``lookback_s`` (records and lines with a ``[seconds since boot]`` stamp older than that are
ignored; a line without a stamp counts).
"""

from __future__ import annotations

import errno
import os
import re
import stat
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from slurmkit.gpufaults import HW_RE, XID_RE
from slurmkit.health.result import CheckResult, bad, ok, printable, skipped

NAME = "kernel_log"
_FIRST_READ_BYTES = 1 << 20  # a text log's first check reads at most its last MiB
_STAMP_RE = re.compile(r"\[\s*(\d+\.\d+)\]")


@dataclass(frozen=True)
class Message:
    uptime_s: float | None  # seconds since boot when the kernel logged it (None: unknown)
    text: str


class LogSource(Protocol):
    """Messages logged since the previous call (the first call: the recent past)."""

    path: str

    def read_new(self) -> list[Message]: ...


def read_uptime() -> float:
    with open("/proc/uptime") as f:
        return float(f.read().split()[0])


class KmsgSource:
    """/dev/kmsg: records ``prio,seq,usec,flags;message``; the last sequence number read is the
    cursor (the ring may have dropped records since: the kernel says so with EPIPE)."""

    def __init__(self, path: str = "/dev/kmsg") -> None:
        self.path = path
        self.last_seq: int | None = None

    def read_new(self) -> list[Message]:
        fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        out: list[Message] = []
        try:
            while True:
                try:
                    rec = os.read(fd, 8192)
                except BlockingIOError:
                    break
                except OSError as exc:
                    if exc.errno == errno.EPIPE:  # overwritten while reading: go on with the next
                        continue
                    raise
                if not rec:
                    break
                head, _, body = rec.decode(errors="replace").partition(";")
                fields = head.split(",")
                if len(fields) < 3 or not fields[1].isdigit():
                    continue
                seq = int(fields[1])
                if self.last_seq is not None and seq <= self.last_seq:
                    continue
                self.last_seq = seq
                usec = int(fields[2]) if fields[2].isdigit() else None
                out.append(Message(usec / 1e6 if usec is not None else None, body.split("\n", 1)[0]))
        finally:
            os.close(fd)
        return out


class TextLogSource:
    """A text file, one message per line; the byte offset read so far is the cursor. A file
    that shrank was rotated: read from its start."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.offset: int | None = None

    def read_new(self) -> list[Message]:
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            start = max(0, size - _FIRST_READ_BYTES) if self.offset is None or self.offset > size else self.offset
            f.seek(start)
            data = f.read(size - start)
        end = data.rfind(b"\n") + 1  # a line still being written is read next time
        self.offset = start + end
        out = []
        for raw in data[:end].decode(errors="replace").splitlines():
            m = _STAMP_RE.search(raw)
            out.append(Message(float(m.group(1)) if m else None, raw))
        return out


def open_source(path: str) -> LogSource:
    """A character device is read as /dev/kmsg, anything else as a text log."""
    try:
        st = os.stat(path)
    except OSError:
        return TextLogSource(path)  # reading reports why
    return KmsgSource(path) if stat.S_ISCHR(st.st_mode) else TextLogSource(path)


@dataclass(frozen=True)
class Finding:
    kind: str  # "xid" | "hardware"
    xid: int | None
    text: str


def scan(messages: Iterable[Message], bad_xids: Iterable[int], since_uptime_s: float | None) -> tuple[list[Finding], int]:
    """(findings that fail the node, count of other Xids) among messages at or after
    ``since_uptime_s`` (None: all of them)."""
    bad_set = set(bad_xids)
    found: list[Finding] = []
    other = 0
    for m in messages:
        if since_uptime_s is not None and m.uptime_s is not None and m.uptime_s < since_uptime_s:
            continue
        x = XID_RE.search(m.text)
        if x is not None:
            if int(x.group("xid")) in bad_set:
                found.append(Finding("xid", int(x.group("xid")), m.text))
            else:
                other += 1
        elif HW_RE.search(m.text):
            found.append(Finding("hardware", None, m.text))
    return found, other


class KernelLogCheck:
    """The check, holding its source (and so its cursor) from one pre-flight to the next."""

    def __init__(self, source: LogSource, bad_xids: Iterable[int], lookback_s: float,
                 uptime: Callable[[], float] = read_uptime) -> None:
        self.source, self.bad_xids, self.lookback_s = source, list(bad_xids), lookback_s
        self._uptime = uptime
        self._first = True

    def __call__(self) -> CheckResult:
        try:
            messages = self.source.read_new()
        except OSError as exc:
            return skipped(NAME, f"kernel log {self.source.path} not readable ({exc.strerror or exc}; "
                                 "kernel.dmesg_restrict?): Xids not checked")
        since = self._uptime() - self.lookback_s if self._first else None
        self._first = False
        found, other = scan(messages, self.bad_xids, since)
        figures = {"messages": len(messages), "bad": len(found), "xid_other": other}
        if found:
            first = found[0]
            what = f"Xid {first.xid}" if first.kind == "xid" else "an uncorrected memory error"
            more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
            return bad(NAME, f"{what} in {self.source.path} since the last check: "
                             f"{printable(first.text, 300).strip()!r}{more}",
                       f"no GPU Xid of health.bad_xids and no uncorrected memory error since the last check",
                       "drain the node (scontrol update nodename=<node> state=drain reason=xid) and have "
                       "it checked; a new job excludes it", **figures)
        return ok(NAME, f"no Xid of health.bad_xids and no uncorrected memory error in {len(messages)} new message(s)",
                  **figures)
