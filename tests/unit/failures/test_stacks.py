"""The stack classifier (slurmkit.failures.stacks) over real dumps of real gloo ranks.

Every file under tests/data/stacks/ was captured on the development machine by
tests/data/stacks/capture_stacks.py: rank 0 inside a collective, rank 1 asleep in ``load_batch``
(a data loader stuck on a file system), each dumped by faulthandler (SIGUSR2) and by py-spy.

``h200_nccl.*`` come from the reference trainer on an H200 (torch 2.11, NCCL over its socket
transport, ``tools/bench/gpu_check.py``'s nccl section): rank 0 in a data_stall fault, rank 1
waiting for the gradient all-reduce that NCCL had queued on the device. The ledger kept them in
its bounded form; they are written back here in faulthandler's layout, and rank 1's innermost
frame is the trainer's ``wait_for_device``, the function its device sync moved into after that
run (then it was the sync line of ``train_step`` itself, and both ranks read as "outside": the
hang's root was not found and the waiting rank's node was blamed).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from slurmkit.failures.classes import FailureClass
from slurmkit.failures.classify import Evidence, root_cause
from slurmkit.failures.stacks import (
    STACK_LINES, StackPlace, StackReading, Verdict, bounded_lines, evidence_root, main_thread, node_verdicts,
    parse_stack, read_stack,
)

DATA = Path(__file__).resolve().parents[2] / "data" / "stacks"
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
    # A hook of its own stuck inside backward: Python above autograd's engine, no collective.
    ("backward_hook.rank0.faulthandler.txt", P.OUTSIDE, "", "slow_hook"),
    ("backward_hook.rank0.pyspy.txt", P.OUTSIDE, "", "slow_hook"),
    # The reference trainer under a NodeAgent: rank 0 in its DDP comm hook's all-to-all (under
    # backward), rank 1 in a data_stall fault.
    ("trainer.rank0.faulthandler.txt", P.COLLECTIVE, "all_to_all_single", "all_to_all_single"),
    ("trainer.rank1.faulthandler.txt", P.OUTSIDE, "", "stalled_data_loading"),
    # The same on a GPU: the waiting rank blocks in its device sync, behind NCCL's all-reduce.
    ("h200_nccl.rank0.faulthandler.txt", P.OUTSIDE, "", "stalled_data_loading"),
    ("h200_nccl.rank1.faulthandler.txt", P.COLLECTIVE, "wait_for_device", "wait_for_device"),
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
        "broadcast.rank1.pyspy.txt", "ddp_backward.rank1.faulthandler.txt",
        "backward_hook.rank1.faulthandler.txt", "backward_hook.rank1.pyspy.txt"}
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


# ------------------------------------------------------------------ root_cause with stacks
def _hang(node: str, rank: int, t: float, detail: str = "no step after step 5 for 8.0 s") -> Evidence:
    return Evidence(t, node, rank, "heartbeat", FailureClass.HANG, detail)


def _stack(node: str, rank: int, place: StackPlace, detail: str) -> Evidence:
    return Evidence(2000.0, node, rank, "stack", FailureClass.HANG, detail, place=place)


def test_root_cause_takes_the_rank_outside_a_collective_not_the_earliest_beat() -> None:
    evidence = [_hang("n0", 0, 1000.0), _hang("n0", 1, 1000.3), _hang("n1", 2, 1000.1),
                _stack("n0", 1, P.OUTSIDE, "not inside a collective: load_batch (data.py:14)"),
                _stack("n1", 2, P.COLLECTIVE, "inside a collective (all_reduce (distributed_c10d.py:3252))")]
    assert root_cause(evidence[:3]).rank == 0  # by beats alone: the earliest
    failure = root_cause(evidence)
    assert failure is not None and (failure.node, failure.rank) == ("n0", 1)
    assert failure.in_collective is False and failure.stack.endswith("load_batch (data.py:14)")
    assert failure.evidence == "no step after step 5 for 8.0 s; stack: not inside a collective: load_batch (data.py:14)"
    assert failure.time == 1000.3 and failure.ranks_affected == (0, 1, 2)


def test_root_cause_falls_back_to_the_earliest_beat_when_the_stacks_say_nothing() -> None:
    evidence = [_hang("n0", 0, 1000.0), _hang("n1", 2, 1000.1),
                _stack("n0", 0, P.COLLECTIVE, "inside a collective (all_reduce (x.py:1))"),
                _stack("n1", 2, P.COLLECTIVE, "inside a collective (all_reduce (x.py:1))")]
    failure = root_cause(evidence)
    assert failure is not None and failure.rank == 0 and failure.in_collective is True
    assert failure.evidence == "no step after step 5 for 8.0 s"  # the beat decided, as before


def test_stacks_never_turn_another_failure_into_a_hang() -> None:
    crash = Evidence(1000.0, "n0", 3, "exit", FailureClass.RANK_CRASH, "returncode -9", -9)
    failure = root_cause([crash, _stack("n0", 1, P.STOPPED, "process stopped (state T): f (x.py:1)")])
    assert failure is not None and failure.cls == FailureClass.RANK_CRASH and failure.rank == 3
    assert failure.stack == "" and failure.in_collective is None


def test_a_verdict_crosses_the_channel_as_json_and_a_forged_place_is_refused() -> None:
    ev = _stack("n0", 1, P.STOPPED, "process stopped (state T): f (x.py:1)")
    assert Evidence.from_json(ev.to_json()) == ev
    assert "place" not in _hang("n0", 1, 1.0).to_json()
    with pytest.raises(ValueError):
        Evidence.from_json({**ev.to_json(), "place": "elsewhere"})


def test_on_a_gpu_the_rank_outside_is_the_root_not_the_one_waiting_on_its_device() -> None:
    stalled = read_stack((DATA / "h200_nccl.rank0.faulthandler.txt").read_text(), stopped=False)
    waiting = read_stack((DATA / "h200_nccl.rank1.faulthandler.txt").read_text(), stopped=False)
    verdicts = [Verdict(node="local1", rank=1, place=waiting.place, time=10.0),
                Verdict(node="local0", rank=0, place=stalled.place, time=11.0)]
    root = evidence_root(verdicts)
    assert root is not None and root.rank == 0  # the earliest beat (rank 1) was blamed before


def test_a_torch_cuda_synchronize_is_a_wait_and_a_plain_train_step_line_is_not() -> None:
    sync = ('Current thread 0x1 (most recent call first):\n'
            '  File "/v/lib/python3.12/site-packages/torch/cuda/__init__.py", line 1083 in synchronize\n'
            '  File "/home/u/train.py", line 40 in step\n')
    assert read_stack(sync, stopped=False).place == P.COLLECTIVE
    plain = ('Current thread 0x1 (most recent call first):\n'
             '  File "/home/u/train.py", line 207 in train_step\n')
    assert read_stack(plain, stopped=False).place == P.OUTSIDE
