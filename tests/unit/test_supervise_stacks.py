"""The stack classifier (slurmkit.supervise.stacks) over real dumps of real gloo ranks.

Every file under tests/data/stacks/ was captured on the development machine by
tests/data/stacks/capture_stacks.py: rank 0 inside a collective, rank 1 asleep in ``load_batch``
(a data loader stuck on a file system), each dumped by faulthandler (SIGUSR2) and by py-spy.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from slurmkit.supervise.stacks import (
    STACK_LINES, StackPlace, StackReading, Verdict, bounded_lines, evidence_root, main_thread, node_verdicts,
    parse_stack, read_stack,
)

DATA = Path(__file__).resolve().parent.parent / "data" / "stacks"
P = StackPlace

# (file, where the rank is, the collective frame's function or "", the innermost main frame)
TABLE = [
    ("all_reduce.rank0.faulthandler.txt", P.COLLECTIVE, "all_reduce", "all_reduce"),
    ("all_reduce.rank0.pyspy.txt", P.COLLECTIVE, "all_reduce", "all_reduce"),
    ("all_reduce.rank1.faulthandler.txt", P.OUTSIDE, "", "load_batch"),
    ("all_reduce.rank1.pyspy.txt", P.OUTSIDE, "", "load_batch"),
    ("barrier.rank0.faulthandler.txt", P.COLLECTIVE, "barrier", "barrier"),
    ("barrier.rank0.pyspy.txt", P.COLLECTIVE, "barrier", "barrier"),
    ("barrier.rank1.pyspy.txt", P.OUTSIDE, "", "load_batch"),
    ("broadcast.rank0.faulthandler.txt", P.COLLECTIVE, "broadcast", "broadcast"),
    ("broadcast.rank0.pyspy.txt", P.COLLECTIVE, "broadcast", "broadcast"),
    ("broadcast.rank1.faulthandler.txt", P.OUTSIDE, "", "load_batch"),
    # DDP all-reduces gradients inside autograd's engine: Python shows only the backward call.
    ("ddp_backward.rank0.faulthandler.txt", P.COLLECTIVE, "_engine_run_backward", "_engine_run_backward"),
    ("ddp_backward.rank0.pyspy.txt", P.COLLECTIVE, "_engine_run_backward", "_engine_run_backward"),
    ("ddp_backward.rank1.pyspy.txt", P.OUTSIDE, "", "load_batch"),
]


@pytest.mark.parametrize("name, place, wait, innermost", TABLE)
def test_real_dumps_are_read_where_the_rank_is(name: str, place: StackPlace, wait: str, innermost: str) -> None:
    got = read_stack((DATA / name).read_text(), stopped=False)
    assert got.place == place, got
    assert got.wait.startswith(wait) if wait else got.wait == ""
    assert got.where.startswith(innermost + " ("), got.where


def test_every_captured_dump_is_in_the_table() -> None:
    captured = {p.name for p in DATA.glob("*.txt")}
    assert captured == {row[0] for row in TABLE} | {
        "all_reduce.rank1.stopped.pyspy.txt", "barrier.rank1.faulthandler.txt",
        "broadcast.rank1.pyspy.txt", "ddp_backward.rank1.faulthandler.txt"}
    for name in captured:
        assert read_stack((DATA / name).read_text(), stopped=False).place in (P.COLLECTIVE, P.OUTSIDE)


def test_the_main_thread_decides_not_a_helper_thread() -> None:
    # Both dumps hold a "metrics" thread asleep in its own loop: the main thread is found by
    # name (py-spy) and by not being started by threading (faulthandler).
    for name in ("all_reduce.rank0.faulthandler.txt", "all_reduce.rank0.pyspy.txt"):
        threads = parse_stack((DATA / name).read_text())
        assert len(threads) == 2
        main = main_thread(threads)
        assert main is not None and main.frames[0].function == "all_reduce"


def test_a_stopped_rank_is_stopped_whatever_its_stack() -> None:
    # py-spy cannot suspend a stopped process; --nonblocking reads it as it lies.
    got = read_stack((DATA / "all_reduce.rank1.stopped.pyspy.txt").read_text(), stopped=True)
    assert got.place == P.STOPPED and got.where.startswith("load_batch (worker.py:14)")


def test_no_dump_is_unknown_and_an_error_message_is_kept_as_text() -> None:
    error = "Error: Failed to get stack traces\n\nCaused by:\n    0: Failed to suspend process\n"
    assert read_stack("", stopped=False).place == P.UNKNOWN
    assert read_stack(error, stopped=False).place == P.UNKNOWN
    assert bounded_lines(error) == ["Error: Failed to get stack traces", "Caused by:",
                                    "    0: Failed to suspend process"]


def test_the_ledger_copy_is_bounded_and_starts_with_the_main_thread() -> None:
    text = (DATA / "all_reduce.rank0.faulthandler.txt").read_text()
    lines = bounded_lines(text)
    assert lines[0] == "main thread:" and "all_reduce" in lines[1]
    deep = "Current thread 0x00007f00 (most recent call first):\n" + "".join(
        f'  File "/x/deep.py", line {i} in f{i}\n' for i in range(300))
    assert len(bounded_lines(deep)) == STACK_LINES


def _reading(place: StackPlace) -> StackReading:
    return StackReading(place, "f (x.py:1)", "")


def test_a_node_posts_at_most_its_most_suspect_rank_and_one_waiting_rank() -> None:
    readings = [(r, _reading(P.COLLECTIVE)) for r in range(8)]
    readings[5] = (5, _reading(P.OUTSIDE))
    readings[6] = (6, _reading(P.STOPPED))
    assert [(r, v.place) for r, v in node_verdicts(readings)] == [(6, P.STOPPED), (0, P.COLLECTIVE)]
    assert node_verdicts([(3, _reading(P.UNKNOWN))]) == []


@pytest.mark.parametrize("places, root", [
    ({0: P.COLLECTIVE, 1: P.OUTSIDE, 2: P.COLLECTIVE}, 1),
    ({0: P.OUTSIDE, 1: P.STOPPED, 2: P.COLLECTIVE}, 1),  # stopped first
    ({0: P.STOPPED}, 0),  # a stopped rank needs no witness
    ({0: P.OUTSIDE, 1: P.OUTSIDE}, None),  # all stuck elsewhere: the stacks do not tell
    ({0: P.COLLECTIVE, 1: P.COLLECTIVE}, None),
    ({0: P.OUTSIDE, 1: P.UNKNOWN}, None),
    ({}, None),
])
def test_the_root_is_the_rank_the_stacks_name(places: dict[int, StackPlace], root: int | None) -> None:
    verdicts = [Verdict(f"n{r // 2}", r, p, 100.0 - r) for r, p in places.items()]
    got = evidence_root(verdicts)
    assert (got.rank if got is not None else None) == root
