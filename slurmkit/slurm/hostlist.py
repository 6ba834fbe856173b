"""Slurm hostlist expressions: ``gpu[001-004,010]``, ``node[1-3],login1``, ``a[1-2]-b[3-4]``.

Pure functions. Zero padding follows Slurm: a range ``[08-10]`` pads every number to the width
of its lower bound (``08 09 10``); ``[8-10]`` does not pad.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable

from slurmkit.errors import ConfigError

#: Refuse expressions that would expand to more names than any real cluster has.
MAX_HOSTS = 1_000_000

_NO_HOSTS = {"", "(null)", "None assigned", "(None)"}
_TRAILING_DIGITS = re.compile(r"^(.*?)(\d+)$")


def _bad(expr: str, why: str) -> ConfigError:
    return ConfigError(
        detected=f"hostlist {expr!r}: {why}",
        requirement="a Slurm hostlist such as node[1-4,8] or gpu[001-004],login1",
        fix="write comma-separated names with bracketed numeric ranges lo-hi where lo <= hi",
    )


def _split_top_level(expr: str) -> list[str]:
    """Split on commas outside brackets."""
    parts: list[str] = []
    depth = 0
    start = 0
    for i, ch in enumerate(expr):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise _bad(expr, "brackets cannot nest")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise _bad(expr, "']' without '['")
        elif ch == "," and depth == 0:
            parts.append(expr[start:i])
            start = i + 1
    if depth != 0:
        raise _bad(expr, "'[' without ']'")
    parts.append(expr[start:])
    return parts


def _expand_range_list(expr: str, body: str) -> list[str]:
    """``001-004,010`` -> ['001', ..., '004', '010']."""
    out: list[str] = []
    for item in body.split(","):
        lo, sep, hi = item.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise _bad(expr, f"range {item!r} is not a number or lo-hi")
        if not sep:
            out.append(lo)
            continue
        first, last = int(lo), int(hi)
        if last < first:
            raise _bad(expr, f"range {item!r} goes down")
        if last - first >= MAX_HOSTS:
            raise _bad(expr, f"range {item!r} has more than {MAX_HOSTS} names")
        out.extend(str(n).zfill(len(lo)) for n in range(first, last + 1))
    return out


def _expand_one(expr: str, item: str) -> list[str]:
    """Expand one comma-free item; several bracket groups give their cartesian product."""
    pieces = re.split(r"(\[[^\]]*\])", item)
    choices: list[list[str]] = []
    for piece in pieces:
        if piece.startswith("["):
            choices.append(_expand_range_list(expr, piece[1:-1]))
        else:
            choices.append([piece])
    total = 1
    for c in choices:
        total *= len(c)
    if total > MAX_HOSTS:
        raise _bad(expr, f"expands to more than {MAX_HOSTS} names")
    return ["".join(combo) for combo in itertools.product(*choices)]


def expand_hostlist(expr: str) -> list[str]:
    """Expand a hostlist expression into host names, in the order written.

    ``"(null)"``, ``"None assigned"`` and the empty string mean no hosts. Raises ConfigError on
    malformed expressions (they can come from user configs such as an exclude list).
    """
    expr = expr.strip()
    if expr in _NO_HOSTS:
        return []
    names: list[str] = []
    for item in _split_top_level(expr):
        item = item.strip()
        if not item:
            raise _bad(expr, "empty name between commas")
        names.extend(_expand_one(expr, item))
        if len(names) > MAX_HOSTS:
            raise _bad(expr, f"expands to more than {MAX_HOSTS} names")
    return names


def _ranges(numbers: list[str]) -> list[str]:
    """Digit strings of one prefix -> range items; a run keeps the width of its first number.

    ``08 09 10 9`` gives ``08-10`` and ``9``: ``9`` and ``09`` are different hosts.
    """
    remaining = set(numbers)
    items: list[str] = []
    for lo in sorted(numbers, key=lambda d: (int(d), len(d))):
        if lo not in remaining:
            continue
        remaining.discard(lo)
        hi = lo
        while (nxt := str(int(hi) + 1).zfill(len(lo))) in remaining:
            remaining.discard(nxt)
            hi = nxt
        items.append(lo if hi == lo else f"{lo}-{hi}")
    return items


def compress_hostlist(names: Iterable[str]) -> str:
    """Compress host names into a hostlist expression (sorted, duplicates dropped).

    Names are grouped by their prefix before the trailing number, so ``expand_hostlist`` of the
    result gives back the same set of names.
    """
    unique = list(dict.fromkeys(n.strip() for n in names if n.strip()))
    for n in unique:
        if any(ch in n for ch in "[],"):
            raise _bad(n, "a host name cannot contain '[', ']' or ','")
    groups: dict[str, list[str]] = {}
    plain: list[str] = []
    for name in unique:
        m = _TRAILING_DIGITS.match(name)
        if m:
            groups.setdefault(m.group(1), []).append(m.group(2))
        else:
            plain.append(name)
    parts: list[tuple[str, str]] = [(p, p) for p in plain]
    for prefix, numbers in groups.items():
        items = _ranges(numbers)
        text = prefix + items[0] if len(items) == 1 and "-" not in items[0] else (
            f"{prefix}[{','.join(items)}]")
        parts.append((prefix, text))
    return ",".join(text for _, text in sorted(parts))
