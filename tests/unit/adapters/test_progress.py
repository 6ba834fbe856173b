"""A progress sample's figures (issue 36): numbers in range or unknown, never 0 for unknown and
never an exception on text a program printed."""

from __future__ import annotations

import dataclasses

import pytest

from slurmkit.adapters import Progress
from slurmkit.adapters.progress import parse_count, parse_real, progress_of

COUNTS = [("0", 0), ("12", 12), ("12,345", 12345), (" 7 ", 7), ("9007199254740991", 2 ** 53 - 1),
          ("9007199254740992", None), ("1" * 41, None), ("-1", None), ("+1", None), ("1.0", None),
          ("1e3", None), ("12,34", None), ("1_000", None), ("٣", None), ("５", None), ("", None), (None, None)]


@pytest.mark.parametrize(("text", "expected"), COUNTS)
def test_parse_count(text: str | None, expected: int | None) -> None:
    assert parse_count(text) == expected


REALS = [("5.19840", 5.1984), ("-0.5", -0.5), ("+2", 2.0), ("1,234.56", 1234.56), ("1.10e+03", 1100.0),
         (".5", 0.5), ("1.", 1.0), ("1e308", 1e308), ("1e309", None), ("1e-999", 0.0), ("nan", None),
         ("NaN", None), ("inf", None), ("-inf", None), ("infinity", None), ("N/A", None), ("1_000", None),
         ("0x10", None), ("1,2,3", None), ("１", None), ("1" * 41, None), ("", None), (None, None)]


@pytest.mark.parametrize(("text", "expected"), REALS)
def test_parse_real(text: str | None, expected: float | None) -> None:
    assert parse_real(text) == expected


def test_progress_of_checks_each_figure_alone() -> None:
    assert progress_of({"step": "5", "loss": "2.5", "tokens_per_s": "1,000", "mfu_pct": "41.5", "tflops": "3"}) \
        == Progress(5, 2.5, 1000.0, 0.415, 3.0)
    assert progress_of({"step": "5", "loss": "nan", "tokens_per_s": "-1", "mfu_pct": "101", "tflops": "-2"}) \
        == Progress(5)
    assert progress_of({"step": "5", "mfu": "0.4", "mfu_pct": "90"}) == Progress(5, mfu=0.4)  # the fraction first
    assert progress_of({"step": "5", "mfu": "1.5"}) == Progress(5)
    assert progress_of({"loss": "2.5"}) == Progress(loss=2.5)  # no step said: unknown, not 0
    assert progress_of({"step": "x", "loss": "2.5"}) is None  # a step said wrong: nothing placed
    assert progress_of({"step": None, "loss": "2.5"}) is None
    assert progress_of({"loss": "nan"}) is None
    assert progress_of({}) is None


def test_a_sample_is_frozen_and_unknown_by_default() -> None:
    sample = Progress()
    assert sample.is_empty() and sample.step is None and sample.loss is None
    assert not Progress(step=0).is_empty()
    with pytest.raises(dataclasses.FrozenInstanceError):
        sample.step = 1  # type: ignore[misc]
