"""A user's regular expression for the progress lines of a program slurmkit has no adapter for
(a plain torchrun script prints ``epoch 3 it 120 loss 2.31`` in its own words).

The pattern is configuration: it is compiled and checked once (:func:`compile_pattern`, at
submit and where the agent starts), never per line. The lines it runs on are not trusted: they
are at most :data:`slurmkit.adapters.lines.MAX_LINE_BYTES` long, and a pattern whose matching
time can explode on a crafted line (a repeat inside a repeat, an alternation under a repeat, a
backreference) is refused, since Python's ``re`` backtracks and has no timeout.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from slurmkit.adapters.progress import FIELDS, Progress, progress_of
from slurmkit.errors import ConfigError

#: Characters of a pattern: a progress line's regex is one line, not a program.
MAX_PATTERN_CHARS = 1000
#: The longest line a pattern is run on (the caller drops longer ones; lines.MAX_LINE_BYTES).
MAX_LINE_CHARS = 4096

_EXAMPLE = r"'step (?P<step>\d+) .*loss (?P<loss>[0-9.]+)'"


def _sre_parser() -> Any:
    # The parser re compiles with: re._parser since 3.11, sre_parse before (both stdlib; no
    # public API gives a pattern's structure).
    try:
        return importlib.import_module("re._parser")
    except ImportError:  # Python 3.10
        return importlib.import_module("sre_parse")


def _refuse(text: str, detected: str, fix: str) -> ConfigError:
    return ConfigError(f"progress pattern {text!r}: {detected}",
                       "a regular expression with a named group 'step' (and optionally "
                       f"{', '.join(repr(f) for f in FIELDS[1:])}) that matches a line of "
                       f"{MAX_LINE_CHARS} characters in about linear time: no repeat or alternation "
                       "inside a repeat, no backreference, and no two repeats that can split the "
                       "same text between them (a literal or ^ first, then at most one such pair)", fix)


# The characters a pattern's items are judged on: ASCII and a few others that classes treat
# apart (a no-break space, a letter, an Arabic-Indic digit, a line separator, a private char).
_PROBES = frozenset([chr(i) for i in range(128)] + ["\u00a0", "\u00e9", "\u0663", "\u2028", "\uffff"])
_CATEGORIES = {"CATEGORY_DIGIT": r"\d", "CATEGORY_NOT_DIGIT": r"\D", "CATEGORY_SPACE": r"\s",
               "CATEGORY_NOT_SPACE": r"\S", "CATEGORY_WORD": r"\w", "CATEGORY_NOT_WORD": r"\W"}


def _category(cat: Any) -> frozenset[str]:
    regex = _CATEGORIES.get(getattr(cat, "name", str(cat)))
    return _PROBES if regex is None else frozenset(ch for ch in _PROBES if re.fullmatch(regex, ch))


def _class(items: Any, c: Any) -> frozenset[str]:
    """The probes a ``[...]`` class matches; anything unknown counts as every character."""
    chars: set[str] = set()
    negate = False
    for op, av in items:
        if op == c.NEGATE:
            negate = True
        elif op == c.LITERAL:
            chars |= {chr(av), chr(av).swapcase()}
        elif op == c.RANGE:
            chars |= {ch for ch in _PROBES if av[0] <= ord(ch) <= av[1]}
        elif op == c.CATEGORY:
            chars |= _category(av)
        else:
            return _PROBES
    return _PROBES - chars if negate else frozenset(chars)


def _one_char(op: Any, av: Any, c: Any) -> frozenset[str] | None:
    """The probes a one-character item matches (case folded in, to err on the wide side); None
    for any other item."""
    if op == c.LITERAL:
        return frozenset({chr(av), chr(av).swapcase()})
    if op == c.NOT_LITERAL:
        return _PROBES - {chr(av)}
    if op == c.ANY:
        return _PROBES
    if op == c.IN:
        return _class(av, c)
    return None


@dataclass(frozen=True)
class _Leaf:
    """One item of a pattern's flattened sequence: one required character (``repeat`` False)
    or a repeat of variable count (``repeat`` True, ``low`` its minimum), with the characters
    it can match; an alternation (``branches``); or a test that matches no character but can
    fail (``anchor``: ``^``, ``$``, ``\\b``, a lookaround; ``start`` for ``^`` and ``\\A``)."""

    chars: frozenset[str] = frozenset()
    repeat: bool = False
    low: int = 1
    branches: tuple[tuple[_Leaf, ...], ...] = ()
    anchor: bool = False
    start: bool = False


def _repeat_ops(c: Any) -> set[Any]:
    return {c.MAX_REPEAT, c.MIN_REPEAT} | ({c.POSSESSIVE_REPEAT} if hasattr(c, "POSSESSIVE_REPEAT") else set())


def _flatten(items: Any, c: Any, inside_repeat: bool) -> tuple[list[_Leaf], str | None]:
    """``items`` (an ``re`` parse tree) as leaves, and why matching it can take exponential
    time: a variable repeat or an alternation inside a repeat that runs more than once
    (``(a+)+``, ``(a|ab)*``), a backreference."""
    leaves: list[_Leaf] = []
    for op, av in items:
        one = _one_char(op, av, c)
        if one is not None:
            leaves.append(_Leaf(one))
        elif op in (c.GROUPREF, c.GROUPREF_EXISTS):
            return leaves, "a backreference"
        elif op in _repeat_ops(c):
            low, high, sub = av
            if inside_repeat and low != high:
                return leaves, "a repeat inside a repeat"
            inner, reason = _flatten(sub, c, inside_repeat or high > 1)
            if reason:
                return leaves, reason
            if (low, high) == (0, 1) and len(inner) > 1:  # (?: tps \d+)?: the group or nothing
                leaves.append(_Leaf(branches=(tuple(inner), ())))
            elif low != high:
                leaves.append(_Leaf(frozenset().union(*(_chars(x) for x in inner)), True, low))
            elif low > 0:
                leaves.extend(inner)
        elif op == c.BRANCH:
            if inside_repeat:
                return leaves, "an alternation inside a repeat"
            branches = []
            for branch in av[1]:
                inner, reason = _flatten(branch, c, inside_repeat)
                if reason:
                    return leaves, reason
                branches.append(tuple(inner))
            leaves.append(_Leaf(branches=tuple(branches)))
        elif op == c.SUBPATTERN or op == getattr(c, "ATOMIC_GROUP", None):
            inner, reason = _flatten(av[-1] if op == c.SUBPATTERN else av, c, inside_repeat)
            if reason:
                return leaves, reason
            leaves.extend(inner)
        elif op in (c.ASSERT, c.ASSERT_NOT):
            _, reason = _flatten(av[1], c, inside_repeat)
            if reason:
                return leaves, reason
            leaves.append(_Leaf(anchor=True))
        elif op == c.AT:
            leaves.append(_Leaf(anchor=True, start=av in (c.AT_BEGINNING, c.AT_BEGINNING_STRING)))
        else:  # anything else: as wide as a repeat can be
            leaves.append(_Leaf(_PROBES, True, 0))
    return leaves, None


def _chars(leaf: _Leaf) -> frozenset[str]:
    if leaf.branches:
        return frozenset().union(*(_chars(x) for b in leaf.branches for x in b))
    return leaf.chars


def _junctions(leaves: Sequence[_Leaf], open_: frozenset[str] | None,
               last: _Leaf | None) -> tuple[frozenset[str] | None, int]:
    """How many repeats in ``leaves`` start where an earlier repeat could still be matching
    (``\\d+.*``, ``.*x.*``: the text can be split between them in as many ways as it is long),
    and the characters the open repeats can take after them. ``open_``: those before
    ``leaves``; a required character none of them matches closes them (``\\d+ `` ends at the
    space). ``last``, the pattern's final leaf, counts for nothing when it is a repeat: nothing
    after it can fail (a ``$`` after it is a leaf of its own)."""
    count = 0
    for leaf in leaves:
        if leaf.anchor:
            continue
        if leaf.branches:
            ends = [_junctions(b, open_, last) for b in leaf.branches]
            count += max(n for _, n in ends)
            reached = [o for o, _ in ends if o is not None]
            open_ = frozenset().union(*reached) if reached else None
        elif not leaf.repeat:
            if open_ is not None and not open_ & leaf.chars:
                open_ = None
        else:
            if open_ is not None and open_ & leaf.chars and leaf is not last:
                count += 1
            open_ = leaf.chars | (open_ or frozenset()) if leaf.low == 0 else leaf.chars
    return open_, count


def _risky(text: str) -> str | None:
    """Why matching ``text`` can take far more than linear time on a crafted line, or None.

    Exponential: see :func:`_flatten`. Polynomial: a search tries every start, and each
    junction (:func:`_junctions`) multiplies a start's cost by the line's length; one factor of
    it is allowed (n^2, a fraction of a second on :data:`MAX_LINE_CHARS`), two are not
    (``(\\d+).*loss``: n^3, minutes). A pattern that starts with a literal or ``^`` tries only
    where that literal is, and takes the one factor inside.
    """
    parser = _sre_parser()
    leaves, reason = _flatten(parser.parse(text), parser, False)
    if reason:
        return reason
    if not leaves:
        return None
    _, count = _junctions(leaves, None, leaves[-1])
    first = next((leaf for leaf in leaves if not leaf.anchor or leaf.start), leaves[0])
    anchored = first.start or not (first.anchor or first.repeat or first.branches)
    if count + (0 if anchored else 1) > 1:
        return "repeats that can split the same text between them in many ways"
    return None


def compile_pattern(text: str) -> re.Pattern[str]:
    """``text`` compiled for :func:`match_pattern`; ConfigError (Detected/Requirement/Fix) when it
    is not one: does not compile, has no group ``step``, names a group that is no figure of
    :data:`slurmkit.adapters.progress.FIELDS`, is over :data:`MAX_PATTERN_CHARS`, or can
    backtrack without end (see :func:`_risky`)."""
    if not isinstance(text, str) or not text:
        raise _refuse(str(text), "it is empty", f"give one, e.g. {_EXAMPLE}")
    if len(text) > MAX_PATTERN_CHARS:
        raise _refuse(text[:40] + "...", f"it is {len(text)} characters long (at most {MAX_PATTERN_CHARS})",
                      "match only the part of the line that holds the figures")
    try:
        pattern = re.compile(text)
    except re.error as exc:
        raise _refuse(text, f"it does not compile ({exc})", f"correct it, e.g. {_EXAMPLE}") from None
    if "step" not in pattern.groupindex:
        raise _refuse(text, "it has no group named 'step'",
                      f"name the step's digits (?P<step>\\d+), e.g. {_EXAMPLE}")
    unknown = sorted(set(pattern.groupindex) - set(FIELDS))
    if unknown:
        raise _refuse(text, f"it names groups {unknown} that are no figure slurmkit reads",
                      f"use only {', '.join(FIELDS)} as group names ((?:...) for the others)")
    reason = _risky(text)
    if reason:
        raise _refuse(text, f"it holds {reason}, whose matching time can explode on a crafted line",
                      "start with the line's fixed text, match each figure with one flat repeat "
                      "of what it can hold, e.g. (?P<loss>[0-9.]+), and spell out the text between "
                      f"them, e.g. {_EXAMPLE}")
    return pattern


def match_pattern(pattern: re.Pattern[str], text: str) -> Progress | None:
    """The sample of the first match of ``pattern`` in ``text`` (one line or state, already
    bounded by the caller), None when there is none or its step is not a valid count."""
    found = pattern.search(text)
    if found is None:
        return None
    values = {name: value for name, value in found.groupdict().items() if name in FIELDS}
    return progress_of(values)
