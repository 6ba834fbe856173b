"""The failure classifier over captured log lines, exit codes and multi-rank scenarios."""

from __future__ import annotations

import json
import os

import pytest

from slurmkit.failures.classes import CLASS_INFO, FailureClass
from slurmkit.failures.classify import Evidence, classify_exit, classify_line, root_cause

F = FailureClass
DATA = os.path.join(os.path.dirname(__file__), "..", "..", "data", "failures")
T0 = 1_796_000_000.0  # an epoch second; scenario times are offsets from it


def captured(name: str) -> list[str]:
    """The lines of tests/data/failures/<name>.txt (comments and blanks dropped)."""
    with open(os.path.join(DATA, f"{name}.txt"), encoding="utf-8") as f:
        return [ln.rstrip("\n") for ln in f if ln.strip() and not ln.startswith("# ")]


# These print nothing: a hang and a crash are seen from outside, a pre-flight by the agent itself,
# a straggler by node 0 from the step times.
LINE_CLASSES = [c for c in FailureClass if c not in (F.HANG, F.RANK_CRASH, F.PREFLIGHT, F.STRAGGLER)]
TABLE = [(cls, line) for cls in LINE_CLASSES for line in captured(cls.value)]


@pytest.mark.parametrize(("cls", "line"), TABLE, ids=[f"{c.value}-{i}" for i, (c, _) in enumerate(TABLE)])
def test_captured_line_classifies_as_its_file(cls: FailureClass, line: str) -> None:
    assert classify_line(line) == cls


@pytest.mark.parametrize("line", captured("none"))
def test_lookalike_lines_do_not_classify(line: str) -> None:
    assert classify_line(line) is None


def test_every_class_that_prints_has_captured_lines() -> None:
    for cls in LINE_CLASSES:
        assert len(captured(cls.value)) >= 1, cls


@pytest.mark.parametrize(("returncode", "expected"), [
    (0, None),
    (1, F.USER_ERROR),  # uncaught Python exception
    (2, F.USER_ERROR),
    (-9, F.RANK_CRASH),  # SIGKILL (killed, host OOM)
    (-11, F.RANK_CRASH),  # SIGSEGV
    (-7, F.RANK_CRASH),  # SIGBUS
    (-6, F.RANK_CRASH),  # SIGABRT: NCCL tear-down, but also any C++ terminate at exit
    (-15, F.RANK_CRASH),
    (137, F.RANK_CRASH),  # shell status of SIGKILL (a rank behind a shell wrapper)
    (134, F.RANK_CRASH),  # shell status of SIGABRT
    (128, F.USER_ERROR),
    (200, F.USER_ERROR),
])
def test_classify_exit(returncode: int, expected: FailureClass | None) -> None:
    assert classify_exit(returncode) == expected


# ------------------------------------------------------------------ root cause

def line_ev(t: float, rank: int, line: str, node: str = "node1") -> Evidence:
    cls = classify_line(line)
    assert cls is not None, line
    return Evidence(T0 + t, node, rank, "line", cls, line)


def exit_ev(t: float, rank: int, code: int, node: str = "node1") -> Evidence:
    cls = classify_exit(code)
    assert cls is not None
    return Evidence(T0 + t, node, rank, "exit", cls, f"returncode {code}", code)


GLOO_CLOSED = ("[rank{r}]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] "
               "Connection closed by peer [127.0.0.1]:27296")


def peer_traceback(t: float, rank: int, node: str) -> list[Evidence]:
    """What a surviving gloo rank shows: its traceback, the peer line, exit 1."""
    return [line_ev(t, rank, f"[rank{rank}]: Traceback (most recent call last):", node),
            line_ev(t + 0.0001, rank, GLOO_CLOSED.format(r=rank), node),
            exit_ev(t + 0.5, rank, 1, node)]


def test_first_failure_in_time_wins_over_later_peer_errors() -> None:
    nccl = captured("nccl_error")[2]  # "NCCL error: remote process exited ..."
    ev = [line_ev(12.0, 0, nccl), exit_ev(12.5, 0, -6),
          line_ev(10.0, 2, nccl, "node2"), exit_ev(10.4, 2, -6, "node2"),
          line_ev(11.0, 3, nccl, "node2")]
    failure = root_cause(ev)
    assert failure is not None
    assert (failure.rank, failure.node, failure.cls) == (2, "node2", F.NCCL_ERROR)
    assert failure.time == T0 + 10.0
    assert failure.ranks_affected == (0, 2, 3)


@pytest.mark.parametrize("peer_offset_s", [-0.010, 0.010])
def test_sigkilled_rank_is_root_not_peers_connection_closed(peer_offset_s: float) -> None:
    ev = [exit_ev(5.0, 1, -9)]
    ev += peer_traceback(5.0 + peer_offset_s, 0, "node1")
    ev += peer_traceback(5.0 + peer_offset_s / 2, 2, "node2")
    failure = root_cause(ev)
    assert failure is not None
    assert (failure.rank, failure.cls, failure.evidence) == (1, F.RANK_CRASH, "returncode -9")


def test_peer_that_aborts_after_connection_closed_is_still_secondary() -> None:
    # The survivor's C++ threads may abort it (-6) at exit instead of a clean exit 1.
    ev = [line_ev(4.99, 0, GLOO_CLOSED.format(r=0)), exit_ev(5.3, 0, -6), exit_ev(5.0, 1, -9)]
    failure = root_cause(ev)
    assert failure is not None and (failure.rank, failure.cls) == (1, F.RANK_CRASH)


def test_only_secondary_evidence_reports_the_earliest_peer_failure() -> None:
    ev = peer_traceback(3.0, 0, "node1") + peer_traceback(2.0, 1, "node1")
    failure = root_cause(ev)
    assert failure is not None and (failure.rank, failure.cls) == (1, F.PEER_FAILURE)


def test_stopped_rank_hang_is_root() -> None:
    # Heartbeat evidence as RankMonitor writes it: the stopped rank is dated a second earlier.
    ev = [Evidence(T0 + 100.0, "node1", 0, "heartbeat", F.HANG, "no step after step 9 for 61.0 s"),
          Evidence(T0 + 99.0, "node2", 3, "heartbeat", F.HANG,
                   "no step after step 9 for 61.0 s (process stopped, state T)"),
          Evidence(T0 + 100.1, "node2", 2, "heartbeat", F.HANG, "no step after step 9 for 61.0 s"),
          exit_ev(161.5, 0, -15), exit_ev(161.6, 2, -15, "node2")]
    failure = root_cause(ev)
    assert failure is not None
    assert (failure.rank, failure.node, failure.cls) == (3, "node2", F.HANG)
    assert "state T" in failure.evidence


def test_node_loss_beats_everything() -> None:
    ev = [line_ev(1.0, 0, captured("nccl_timeout")[0]),
          line_ev(2.0, 1, captured("gpu_oom")[0]), exit_ev(2.5, 1, 1),
          Evidence(T0 + 30.0, "node2", -1, "agent", F.NODE_LOSS, "agent on node2 silent for over 5 s")]
    failure = root_cause(ev)
    assert failure is not None
    assert (failure.cls, failure.node, failure.rank) == (F.NODE_LOSS, "node2", -1)
    assert failure.ranks_affected == (0, 1)


def test_nccl_abort_with_error_line_is_nccl_error_from_the_line() -> None:
    line = captured("nccl_error")[2]
    ev = [line_ev(7.0, 1, line), exit_ev(7.2, 1, -6)] + peer_traceback(7.1, 0, "node1")
    failure = root_cause(ev)
    assert failure is not None
    assert (failure.rank, failure.cls, failure.evidence) == (1, F.NCCL_ERROR, line)


def test_nccl_timeout_outranks_the_teardown_lines_on_the_same_rank() -> None:
    timeout, teardown = captured("nccl_timeout")[0], captured("nccl_error")[-3]
    failure = root_cause([line_ev(1.0, 3, teardown), line_ev(1.0, 3, timeout), exit_ev(2.0, 3, -6)])
    assert failure is not None and (failure.cls, failure.evidence) == (F.NCCL_TIMEOUT, timeout)


def test_traceback_then_abort_is_a_user_error() -> None:
    ev = [line_ev(1.0, 2, "[rank2]: Traceback (most recent call last):"),
          Evidence(T0 + 1.01, "node1", 2, "line", F.USER_ERROR, "unused"),
          exit_ev(1.02, 2, -6)]
    failure = root_cause(ev)
    assert failure is not None and (failure.rank, failure.cls) == (2, F.USER_ERROR)


def test_no_evidence_no_failure() -> None:
    assert root_cause([]) is None


def test_evidence_json_round_trip() -> None:
    ev = Evidence(T0 + 0.123456, "node2", 3, "line", F.NCCL_TIMEOUT, "x" * 600)
    back = Evidence.from_json(json.loads(json.dumps(ev.to_json())))
    assert back == Evidence(ev.time, "node2", 3, "line", F.NCCL_TIMEOUT, "x" * 500)


# ------------------------------------------------------------------ real captures (gloo, this machine)

def replay(name: str) -> list[Evidence]:
    """Evidence a RankMonitor would have recorded from a capture_gloo.py recording."""
    with open(os.path.join(DATA, f"real_gloo_{name}.json"), encoding="utf-8") as f:
        record = json.load(f)
    out = []
    for e in record["events"]:
        if e["kind"] == "exit":
            cls = classify_exit(int(e["returncode"]))
        else:
            cls = classify_line(e["detail"])
        if cls is not None:
            out.append(Evidence(T0 + float(e["t"]), "localhost", int(e["rank"]), e["kind"], cls, e["detail"]))
    return out


def test_real_capture_sigkilled_peer() -> None:
    ev = replay("peer_killed")
    survivor = {e.cls for e in ev if e.rank == 0}
    assert F.PEER_FAILURE in survivor and F.USER_ERROR in survivor  # "[rank0]: Traceback" is seen
    failure = root_cause(ev)
    assert failure is not None
    assert (failure.rank, failure.cls, failure.evidence) == (1, F.RANK_CRASH, "returncode -9")
    assert CLASS_INFO[failure.cls].restartable


def test_real_capture_rank_raises() -> None:
    ev = replay("rank_raises")
    failure = root_cause(ev)
    assert failure is not None
    assert (failure.rank, failure.cls) == (1, F.USER_ERROR)
    assert not CLASS_INFO[failure.cls].suspect_node  # a user bug must never get a node excluded
