"""A user's progress pattern (issue 36): checked once with a Detected/Requirement/Fix error, and
never one whose matching time explodes on a crafted line of MAX_LINE_CHARS (Python's re has no
timeout: ``(\\d+).*loss (?P<loss>[0-9.]+)`` on 4,096 digits ran two minutes here)."""

from __future__ import annotations

import time

import pytest

from slurmkit.adapters import Progress, compile_pattern
from slurmkit.adapters.patterns import MAX_LINE_CHARS, MAX_PATTERN_CHARS, match_pattern
from slurmkit.errors import ConfigError

ACCEPTED = [
    r"step (?P<step>\d+) .*loss (?P<loss>[0-9.]+)",
    r"step (?P<step>\d+).*loss (?P<loss>[0-9.]+)",  # one place where two repeats meet: n^2
    r"step (?P<step>\d+).*loss (?P<loss>\S+)",
    r"(?i)step[:=]\s*(?P<step>\d+)\s+(?:loss|lm_loss)[:=]\s*(?P<loss>[0-9.eE+-]+)",
    r"^\[rank0\]:.*it (?P<step>\d+)/\d+ .*loss=(?P<loss>[0-9.]+)",
    r"\biter(?:ation)? (?P<step>[0-9,]+) \| lm loss: (?P<loss>\S+) \| tokens/s: (?P<tokens_per_s>[0-9.]+)",
    r"(?P<step>\d+) (?P<loss>\d+\.\d+) (?P<tflops>\d+\.\d+) (?P<mfu>0\.\d+)",
    r"step=(?P<step>\d{1,9})",
    r".*(?P<step>\d+)",
    r"(?P<step>\d+)",
]

REFUSED = [
    ("", "empty"),
    ("x" * (MAX_PATTERN_CHARS + 1), "characters long"),
    ("(", "does not compile"),
    (r"step (\d+) loss (?P<loss>\S+)", "no group named 'step'"),
    (r"step (?P<stp>\d+)", "no group named 'step'"),
    (r"step (?P<step>\d+) lr (?P<lr>\S+)", "['lr']"),
    (r"(?P<step>(a+)+)", "a repeat inside a repeat"),
    (r"(?P<step>\d+)(?:\s*\w+=\S*)*x", "a repeat inside a repeat"),
    (r"(?P<step>(?:a|ab)*)c", "an alternation inside a repeat"),
    (r"(?P<step>\d+) (?P=step)", "backreference"),
    (r"(?P<step>\d)(?(step)a|b)", "backreference"),
    (r"(?P<step>\d+).*loss (?P<loss>[0-9.]+)", "split the same text"),  # n^3: minutes
    (r".*.*(?P<step>x)", "split the same text"),
    (r"^(?P<step>\d+).*.*x", "split the same text"),
    (r"(?P<step>\d+)\D*(?P<loss>\d+)x", "split the same text"),
    (r".*(?P<step>\d+)$", "split the same text"),  # the $ after the last repeat can fail
]


@pytest.mark.parametrize("text", ACCEPTED)
def test_accepted(text: str) -> None:
    assert compile_pattern(text).pattern == text


@pytest.mark.parametrize(("text", "why"), REFUSED)
def test_refused_with_detected_requirement_fix(text: str, why: str) -> None:
    with pytest.raises(ConfigError) as info:
        compile_pattern(text)
    assert why in info.value.detected
    message = str(info.value)
    assert message.startswith("Detected: progress pattern") and "Requirement:" in message and "Fix:" in message


def _crafted(text: str) -> list[str]:
    """Lines of MAX_LINE_CHARS made of the pattern's own words and digits, the worst for it."""
    n = MAX_LINE_CHARS
    words = ["1", "a", " ", "step ", "step 1", "step 1 ", "loss ", "loss 1", "it 1/1 ", "[rank0]:",
             "step=1", "iter 1 | lm loss: ", "1 1.0 ", "1.0 0.", "step: 1 "]
    return [(w * n)[:n] for w in words] + [("step " + "1" * n)[:n], ("[rank0]:" + "1" * n)[:n]]


@pytest.mark.parametrize("text", ACCEPTED)
def test_accepted_patterns_cost_little_on_crafted_lines(text: str) -> None:
    pattern = compile_pattern(text)
    for line in _crafted(text):
        start = time.perf_counter()
        match_pattern(pattern, line)
        # n^2 at worst: about 1 s on a loaded core for the slowest; n^3 takes minutes
        assert time.perf_counter() - start < 10, (text, line[:40])


def test_match_reads_the_groups_as_figures() -> None:
    pattern = compile_pattern(r"it (?P<step>[0-9,]+) loss (?P<loss>\S+)(?: tps (?P<tokens_per_s>\S+))?"
                              r"(?: mfu (?P<mfu_pct>\S+)%)?(?: tflops (?P<tflops>\S+))?")
    assert match_pattern(pattern, "it 1,200 loss 2.5 tps 3,000 mfu 40% tflops 1.5") == \
        Progress(1200, 2.5, 3000.0, 0.4, 1.5)
    assert match_pattern(pattern, "it 7 loss nan") == Progress(7)
    assert match_pattern(pattern, "it 7 loss 1 mfu 140%") == Progress(7, 1.0)
    assert match_pattern(pattern, "it ٧ loss 1") is None  # \d and \S take any digit; a step is ASCII
    assert match_pattern(pattern, "it 9007199254740992 loss 1") is None
    assert match_pattern(pattern, "no match") is None
    fraction = compile_pattern(r"s(?P<step>\d+) m(?P<mfu>\S+)")
    assert match_pattern(fraction, "s1 m0.4") == Progress(1, mfu=0.4)
    assert match_pattern(fraction, "s1 m40") == Progress(1)  # a fraction, not a percent


def test_an_optional_step_that_did_not_match_gives_nothing() -> None:
    pattern = compile_pattern(r"(?:step (?P<step>\d+) )?loss (?P<loss>[0-9.]+)")
    assert match_pattern(pattern, "loss 2.5") is None
    assert match_pattern(pattern, "step 3 loss 2.5") == Progress(3, 2.5)
