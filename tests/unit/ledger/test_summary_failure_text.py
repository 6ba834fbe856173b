"""The newest failure's line in the report data and as one terminal line: the ledger is
untrusted, so control characters, ANSI escapes, bidi overrides and huge lines are defused."""

from __future__ import annotations

import pytest

from slurmkit.ledger.events import EventError, validate
from slurmkit.ledger.summary import LINE_CHARS, SHOWN_CHARS, failure_text, summarize

T0 = 1_800_000_000.0


def _events(**failure: object) -> list[dict[str, object]]:
    return [{"t": T0, "event": "submitted", "job_id": "1"},
            {"t": T0 + 5, "event": "failure", "cls": "rank_crash", "rank": 0, "node": "n0",
             "evidence": "returncode -9", "time_of_fault": T0 + 4},
            {"t": T0 + 9, "event": "failure", "cls": "user_error", "rank": 3, "node": "node2",
             "evidence": "returncode 2", "time_of_fault": T0 + 8, **failure}]


def test_the_newest_failure_with_its_line() -> None:
    said = "python: can't open file '/x/train.py': [Errno 2] No such file or directory"
    report = summarize(_events(line=said))
    assert [f.line for f in report.failures] == ["", said]
    assert failure_text(report.failures[-1]) == f"user_error, rank 3 on node2 (returncode 2): {said}"
    assert failure_text(report.failures[0]) == "rank_crash, rank 0 on n0 (returncode -9)"


def test_a_node_failure_names_the_node_alone() -> None:
    (f,) = summarize([{"t": T0, "event": "failure", "cls": "node_loss", "rank": -1, "node": "node7",
                       "evidence": "agent did not answer"}]).failures
    assert failure_text(f) == "node_loss, on node7 (agent did not answer)"


@pytest.mark.parametrize("line,shown,absent", [
    ("\x1b[2J\x1b[31mValueError: x\x1b[0m", "\\x1b[2J\\x1b[31mValueError: x\\x1b[0m", "\x1b"),
    ("\x1b]0;owned\x07RuntimeError", "\\x1b]0;owned\\x07RuntimeError", "\x07"),
    ("a\rb\nc\x00d\x9be", "a\\x0db\\x0ac\\x00d\\x9be", "\r"),
    ("KeyError \u202eevil\u2028x", "KeyError \\u202eevil\\u2028x", "\u202e"),
    ("[bold red]not markup[/]", "[bold red]not markup[/]", "\x1b"),
])
def test_hostile_lines_are_escaped(line: str, shown: str, absent: str) -> None:
    text = failure_text(summarize(_events(line=line)).failures[-1])
    assert text.endswith(": " + shown) and absent not in text
    assert text.isprintable()


def test_long_lines_are_bounded() -> None:
    (f,) = summarize(_events(line="E" * 1_000_000)).failures[-1:]
    assert len(f.line) == LINE_CHARS
    text = failure_text(f)
    assert len(text) == SHOWN_CHARS and text.endswith("...") and text.startswith("user_error, rank 3 on node2")
    # escaping lengthens a line (one control character -> four): the bound is on what is shown
    assert len(failure_text(summarize(_events(line="\x1b" * 400)).failures[-1])) == SHOWN_CHARS
    # a long evidence leaves room for the line
    (g,) = summarize(_events(evidence="NCCL error: " + "v" * 400, line="the why")).failures[-1:]
    assert failure_text(g).endswith("...): the why")


def test_a_line_that_is_not_text_is_ignored() -> None:
    assert summarize(_events(line=["not", "text"])).failures[-1].line == ""


def test_the_ledger_schema_takes_the_line_as_text() -> None:
    validate("failure", {"cls": "user_error", "line": "ValueError: boom"})
    with pytest.raises(EventError):
        validate("failure", {"cls": "user_error", "line": 3})
