"""Slurm time formats <-> seconds.

Slurm accepts "minutes", "minutes:seconds", "hours:minutes:seconds", "days-hours",
"days-hours:minutes" and "days-hours:minutes:seconds"; "UNLIMITED"/"INFINITE" mean no limit.
sacct's Elapsed and squeue's %M use the same shapes, so one parser serves all three.
Note that Slurm itself treats a time limit of 0 as "no limit"; that policy is left to callers.
"""

from __future__ import annotations

import re

from slurmkit.errors import ConfigError

_UNLIMITED = {"UNLIMITED", "INFINITE"}
_DAYS = re.compile(r"^(\d+)-(\d+)(?::(\d+))?(?::(\d+))?$")
_CLOCK = re.compile(r"^(\d+)(?::(\d+))?(?::(\d+))?$")


def _invalid(text: str, why: str) -> ConfigError:
    return ConfigError(
        detected=f"time {text!r}: {why}",
        requirement=("a Slurm time: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS "
                     "or UNLIMITED"),
        fix="write e.g. 90 (minutes), 04:00:00 or 2-00:00:00",
    )


def _below(text: str, value: int, limit: int, name: str) -> int:
    if value >= limit:
        raise _invalid(text, f"{name} {value} must be below {limit}")
    return value


def parse_time_limit(text: str) -> int | None:
    """Seconds of a Slurm time string; None for UNLIMITED. Raises ConfigError if malformed."""
    s = text.strip()
    if s.upper() in _UNLIMITED:
        return None
    m = _DAYS.match(s)
    if m:
        days = int(m.group(1))
        hours = _below(text, int(m.group(2)), 24, "hours")
        minutes = _below(text, int(m.group(3) or 0), 60, "minutes")
        seconds = _below(text, int(m.group(4) or 0), 60, "seconds")
        return ((days * 24 + hours) * 60 + minutes) * 60 + seconds
    m = _CLOCK.match(s)
    if not m:
        raise _invalid(text, "not a recognised time format")
    a, b, c = m.group(1), m.group(2), m.group(3)
    if b is None:
        return int(a) * 60
    if c is None:
        return int(a) * 60 + _below(text, int(b), 60, "seconds")
    minutes = _below(text, int(b), 60, "minutes")
    return (int(a) * 60 + minutes) * 60 + _below(text, int(c), 60, "seconds")


def format_time_limit(seconds: int | None) -> str:
    """Slurm time string for ``seconds``: ``HH:MM:SS`` or ``D-HH:MM:SS``; None -> UNLIMITED."""
    if seconds is None:
        return "UNLIMITED"
    if seconds < 0:
        raise ValueError(f"time limit cannot be negative: {seconds}")
    days, rest = divmod(int(seconds), 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    clock = f"{hours:02d}:{minutes:02d}:{secs:02d}"
    return f"{days}-{clock}" if days else clock
