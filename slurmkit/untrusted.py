"""Reading what a rank, a peer or another process wrote, without trusting a byte of it.

Heartbeats, a rank's event spool, its flight-recorder trace, metrics lines and the ledger are
written by code the user runs (or by whoever can write the node-local or run directory). Their
readers live in the node agent and in the CLIs: one exception there is a lost node, a requeue or
a report that cannot be shown. So every such read goes through here:

- :func:`read_regular` opens without blocking (a FIFO planted where a file was expected would
  hang the reader forever), without following a link, refuses anything but a regular file and
  reads at most ``max_bytes``;
- :func:`parse_json` takes bytes that must be UTF-8 JSON within a size, a nesting depth and an
  item count, with integers of at most :data:`MAX_INT_DIGITS` digits and finite floats only
  (Python's json refuses a 5,000-digit number with a bare ValueError, nests until a
  RecursionError, and accepts ``NaN``, ``1e999`` and lone surrogates that fail later, when printed);
- :func:`safe_line` makes such text fit to print: every character that could drive a terminal or
  make a line read reversed is shown escaped (``slurmkit logs``, ``status``, ``runs``).

Every refusal is an :class:`UntrustedDataError` (a ValueError) that names what was read and why;
callers skip that record, say so in their log or ledger, and go on.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import stat
from collections.abc import Iterator
from typing import Any, BinaryIO

MAX_DEPTH = 32  # nesting of arrays/objects: the deepest record slurmkit writes has 6
MAX_ITEMS = 1_000_000  # values in one document (a flight-recorder trace holds ~100,000)
MAX_INT_DIGITS = 30  # a step, a pid, a byte count or a sequence number fits in 20
INT_LIMIT = 10 ** MAX_INT_DIGITS


class UntrustedDataError(ValueError):
    """Data written by someone else that is refused: ``str(exc)`` says which and why."""


def _constant(text: str) -> Any:
    raise UntrustedDataError(f"{text} (not JSON)")


def _check_shape(value: Any, max_depth: int, max_items: int) -> None:
    """Depth, item count, numbers in range and text that can be encoded again, walked without
    recursion (json's own hooks for numbers cost a Python call per number: 6x slower)."""
    todo: list[tuple[Any, int]] = [(value, 1)]
    items = 0
    while todo:
        v, depth = todo.pop()
        items += 1
        if items > max_items:
            raise UntrustedDataError(f"more than {max_items} values")
        if isinstance(v, str):
            _check_text(v)
        elif isinstance(v, int):
            if not -INT_LIMIT < v < INT_LIMIT:
                raise UntrustedDataError(f"an integer of {len(str(abs(v)))} digits (at most {MAX_INT_DIGITS})")
        elif isinstance(v, float):
            if not math.isfinite(v):
                raise UntrustedDataError(f"a number out of range ({v})")
        elif isinstance(v, (list, dict)):
            if depth > max_depth:
                raise UntrustedDataError(f"nested deeper than {max_depth} levels")
            if isinstance(v, dict):
                for k in v:
                    _check_text(k)
                todo.extend((x, depth + 1) for x in v.values())
            else:
                todo.extend((x, depth + 1) for x in v)


def _check_text(s: str) -> None:
    if not s.isascii():
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate ("\\ud800"): fails where it is printed or written
            raise UntrustedDataError("a string with a lone surrogate (not UTF-8)") from None


@functools.lru_cache(maxsize=1)
def _decoder() -> json.JSONDecoder:
    """One decoder for every read: json.loads with an argument builds a new one per call, a
    seventh of a ledger line's read."""
    return json.JSONDecoder(parse_constant=_constant)


def parse_json(data: bytes | str, *, max_bytes: int, max_depth: int = MAX_DEPTH,
               max_items: int = MAX_ITEMS) -> Any:
    """The JSON value in ``data``, within the limits above; UntrustedDataError says what is wrong."""
    if len(data) > max_bytes:
        raise UntrustedDataError(f"over {max_bytes} bytes")
    if isinstance(data, bytes):
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise UntrustedDataError(f"not JSON (not UTF-8: {exc.reason} at byte {exc.start})") from None
    try:
        value = _decoder().decode(data)
    except UntrustedDataError:
        raise
    except RecursionError:
        raise UntrustedDataError(f"nested deeper than {max_depth} levels") from None
    except ValueError as exc:  # JSONDecodeError, and Python's own limit of 4,300 digits
        digits = re.search(r"value has (\d+) digits", str(exc))
        if digits:
            raise UntrustedDataError(f"an integer of {digits.group(1)} digits (at most {MAX_INT_DIGITS})") from None
        raise UntrustedDataError(f"not JSON ({str(exc)[:120]})") from None
    if _needs_walk(data, max_depth, max_items):
        _check_shape(value, max_depth, max_items)
    return value


# What in the text can make a parsed value fail the walk: a run of over MAX_INT_DIGITS digits (a
# long integer, or a float that overflows), a large exponent, a surrogate escape (one of a pair
# is fine, a lone one is not: the walk tells). Three plain searches: one alternation is 2x slower.
_LONG_DIGITS = re.compile("[0-9]{%d}" % (MAX_INT_DIGITS + 1))
_BIG_EXPONENT = re.compile("[eE][+-]?[0-9]{3}")


def _needs_walk(text: str, max_depth: int, max_items: int) -> bool:
    """Whether the parsed value must be walked: a ledger line of a few brackets and plain
    numbers (nearly all of them) cannot fail it, and a walk costs 4x the parse."""
    return (text.count("[") + text.count("{") > max_depth or len(text) > max_items
            or "\\u" in text or _LONG_DIGITS.search(text) is not None
            or _BIG_EXPONENT.search(text) is not None)


def parse_object(data: bytes | str, *, max_bytes: int, max_depth: int = MAX_DEPTH) -> dict[str, Any]:
    """:func:`parse_json` that must give an object."""
    value = parse_json(data, max_bytes=max_bytes, max_depth=max_depth)
    if not isinstance(value, dict):
        raise UntrustedDataError(f"a JSON {type(value).__name__ if value is not None else 'null'}, "
                                 "not an object")
    return value


def open_regular(path: str) -> int:
    """A read-only descriptor of the regular file at ``path``: never blocks on a FIFO, never
    follows a link (ELOOP), never a device. OSError when there is none (FileNotFoundError when
    absent), UntrustedDataError when something else is there."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        os.close(fd)
        raise
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise UntrustedDataError(f"{path} is not a regular file (mode {stat.filemode(mode)})")
    return fd


def read_regular(path: str, max_bytes: int, *, offset: int = 0) -> bytes:
    """At most ``max_bytes`` of the regular file at ``path`` from ``offset`` (see
    :func:`open_regular`); UntrustedDataError when the file holds more than that."""
    fd = open_regular(path)
    try:
        chunks, left = [], max_bytes + 1
        while left > 0:
            chunk = os.pread(fd, min(left, 1 << 20), offset)
            if not chunk:
                break
            chunks.append(chunk)
            offset += len(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > max_bytes:
        raise UntrustedDataError(f"{path} holds over {max_bytes} bytes")
    return data


def bounded_lines(f: BinaryIO, max_bytes: int) -> Iterator[bytes]:
    """The lines of a binary file; a line over ``max_bytes`` comes as its first ``max_bytes`` + 1
    bytes (for the caller to refuse by its size) and the rest of it is skipped unread into memory."""
    while True:
        line = f.readline(max_bytes + 1)
        if not line:
            return
        if len(line) > max_bytes and not line.endswith(b"\n"):
            while (rest := f.readline(1 << 20)) and not rest.endswith(b"\n"):
                pass
        yield line


def _escape(c: str) -> str:
    code = ord(c)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def safe_line(text: str) -> str:
    """``text`` with every non-printable character but the tab escaped (\\x1b, \\x9b, \\u202e)."""
    return "".join(c if c.isprintable() or c == "\t" else _escape(c) for c in text)
