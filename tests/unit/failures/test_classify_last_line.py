"""A crashed rank's own last word (``telling_line``): which line is kept, how it is bounded, and
how it rides from the exit's evidence over the channel into the root cause."""

from __future__ import annotations

import pytest

from slurmkit.failures.classes import FailureClass
from slurmkit.failures.classify import DETAIL_LIMIT, Evidence, root_cause, telling_line

F = FailureClass

TRACEBACK = ["Traceback (most recent call last):", '  File "/w/train.py", line 3, in <module>',
             '    raise ValueError("boom")', "ValueError: boom"]


@pytest.mark.parametrize("lines,said", [
    (["step 1", "python: can't open file '/x/train.py': [Errno 2] No such file or directory"],
     "python: can't open file '/x/train.py': [Errno 2] No such file or directory"),
    (TRACEBACK, "ValueError: boom"),
    # torch's prefix, then a tear-down warning that says nothing
    (["[rank1]: Traceback (most recent call last):", "[rank1]: RuntimeError: shapes differ", "",
      "[rank1]:[W101 12:00:00 ProcessGroupNCCL.cpp:1250] Warning: process group was not destroyed"],
     "[rank1]: RuntimeError: shapes differ"),
    (["/usr/bin/python: No module named trainr"], "/usr/bin/python: No module named trainr"),
    (["./run.sh: line 3: trainx: command not found"], "./run.sh: line 3: trainx: command not found"),
    (["terminate called after throwing an instance of 'c10::Error'", "  what():  CUDA error"],
     "what():  CUDA error"),
    (["loading", "step 10 loss 2.3", "   "], "step 10 loss 2.3"),  # nothing telling: the last line
    (["", "  "], ""),
    ([], ""),
])
def test_the_line_that_says_why(lines: list[str], said: str) -> None:
    assert telling_line(lines) == said


def test_hostile_lines_are_made_printable_and_bounded() -> None:
    assert telling_line(["\x1b[31mValueError: red\x1b[0m\r\x07"]) == "?[31mValueError: red?[0m??"
    assert telling_line(["RuntimeError: " + "x" * 10_000]) == ("RuntimeError: " + "x" * 10_000)[:DETAIL_LIMIT]
    assert telling_line(["ok\u2028KeyError: 'a'\u202e"]) == "ok?KeyError: 'a'?"


def _exit(rank: int, code: int, t: float, last: str = "") -> Evidence:
    return Evidence(t, "node1", rank, "exit", F.USER_ERROR if code > 0 else F.RANK_CRASH,
                    f"returncode {code}", code, last_line=last)


def test_the_root_carries_its_ranks_last_word() -> None:
    said = "python: can't open file '/x/train.py': [Errno 2] No such file or directory"
    failure = root_cause([_exit(1, 2, 10.0, said), _exit(0, -9, 12.0, "step 4")])
    assert failure is not None and (failure.rank, failure.cls, failure.evidence) == (1, F.USER_ERROR,
                                                                                     "returncode 2")
    assert failure.line == said


def test_a_traceback_decides_the_class_and_the_exit_brings_the_line() -> None:
    line = Evidence(10.0, "node1", 1, "line", F.USER_ERROR, "Traceback (most recent call last):")
    failure = root_cause([line, _exit(1, 1, 10.5, "ValueError: boom")])
    assert failure is not None and failure.evidence == "Traceback (most recent call last):"
    assert failure.line == "ValueError: boom"
    assert root_cause([_exit(1, 1, 10.5)]).line == ""  # type: ignore[union-attr]


def test_the_line_crosses_the_channel_bounded() -> None:
    ev = _exit(1, 2, 10.0, "KeyError: 'lr'")
    assert Evidence.from_json(ev.to_json()) == ev
    assert "last_line" not in _exit(1, 2, 10.0).to_json()  # older agents' records look the same
    hostile = {**ev.to_json(), "last_line": "\x1b]0;title\x07" + "y" * 5000}
    back = Evidence.from_json(hostile)
    assert back.last_line.startswith("?]0;title?") and len(back.last_line) == DETAIL_LIMIT


def test_the_decisions_words_carry_the_ranks_last_word() -> None:
    """A traceback's header decides user_error; the decision and end reasons used to quote only
    it ("... (node2): Traceback (most recent call last):"), not what went wrong."""
    from slurmkit.failures.classify import Failure

    f = Failure(cls=F.USER_ERROR, rank=1, node="node2", time=0.0,
                evidence="Traceback (most recent call last):", ranks_affected=(1,), line="ValueError: boom")
    assert f.where() == "user_error on rank 1 (node2): Traceback (most recent call last): -> ValueError: boom"
    same = Failure(cls=F.RANK_CRASH, rank=0, node="n", time=0.0, evidence="x", ranks_affected=(0,), line="x")
    assert same.where() == "rank_crash on rank 0 (n): x"
