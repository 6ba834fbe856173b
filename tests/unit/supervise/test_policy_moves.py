"""The pure policy moving nodes out: several bad nodes in one decision, a failed pre-flight that
is no crash, and a straggler moved onto a spare (slurmkit.supervise.policy.decide)."""

from __future__ import annotations

import pytest

from slurmkit.failures.classes import CLASS_INFO, FailureClass
from slurmkit.failures.classify import Evidence, bad_nodes, root_cause
from slurmkit.supervise.policy import Action, History, Limits, after_warning, decide
from tests.unit.supervise.test_policy import LIMITS, Track, failure, run

F = FailureClass


def preflight(node: str) -> Evidence:
    return Evidence(10.0, node, -1, "agent", F.PREFLIGHT, f"pre-flight failed on {node}: nvme full")


# ------------------------------------------------------------------ several bad nodes at once
def test_bad_nodes_are_every_node_the_evidence_proves_bad() -> None:
    ev = [preflight("node3"), preflight("node1"), Evidence(9.0, "node2", 0, "exit", F.RANK_CRASH, "returncode 1"),
          Evidence(11.0, "node4", 1, "line", F.GPU_FAULT, "NVRM: Xid 79"), preflight("node1")]
    assert bad_nodes(ev) == ["node1", "node3", "node4"]
    assert bad_nodes([Evidence(1.0, "node2", 0, "exit", F.RANK_CRASH, "returncode -9")]) == []


def test_every_node_failing_preflight_gets_a_spare_in_one_decision() -> None:
    ev = [preflight("node1"), preflight("node3"), preflight("node2")]
    root = root_cause(ev)
    assert root is not None and root.cls == F.PREFLIGHT
    d, h = decide(root, History(), None, LIMITS, ["node7", "node8", "node9"], [], bad_nodes=bad_nodes(ev))
    assert d.action == Action.REPLACE_NODE and d.exclude == ("node1", "node2", "node3"), d
    assert "3 spares" in d.reason and h.retired == {"node1", "node2", "node3"}


def test_bad_nodes_and_lost_nodes_leave_together() -> None:
    d, h = decide(failure(F.NODE_LOSS, node="node2"), History(), 40, LIMITS, ["node8", "node9"], ["node2"],
                  bad_nodes=["node5"])
    assert d.action == Action.REPLACE_NODE and d.exclude == ("node2", "node5") and h.retired == {"node2", "node5"}


def test_too_few_spares_requeue_without_every_bad_node() -> None:
    d, _ = decide(failure(F.PREFLIGHT, node="node1"), History(), None, LIMITS, ["node9"], [],
                  bad_nodes=["node1", "node3"])
    assert d.action == Action.REQUEUE and d.exclude == ("node1", "node3"), d
    assert "1 spare(s) for 2 nodes" in d.reason and "without them" in d.reason


def test_a_retired_node_and_a_healthy_lost_agent_are_no_bad_node() -> None:
    h = History(retired=frozenset({"node4"}))
    d, _ = decide(failure(F.PREFLIGHT, node="node1"), h, None, LIMITS, ["node9"], ["node2"], agent_lost=["node2"],
                  bad_nodes=["node1", "node4", "node2"])
    # node4 left already; node2's agent was lost on a healthy node: kept, never excluded
    assert d.action == Action.REQUEUE and d.exclude == ("node1",) and "keeping node2" in d.reason, d


# ------------------------------------------------------------------ a failed pre-flight is no crash
def test_preflight_failures_do_not_count_toward_the_crash_loop() -> None:
    # Two generations end in a failed pre-flight (each spare in turn is bad), without checkpoint
    # progress: the nodes leave, the program did not crash. The healthy restarts after them
    # still get the whole crash-loop budget (3): the old code stopped at the first crash.
    t = Track()
    assert run(F.PREFLIGHT, t, None, node="node1", spares=["node8", "node9"]).action == Action.REPLACE_NODE
    assert run(F.PREFLIGHT, t, None, node="node8", spares=["node9"]).action == Action.REPLACE_NODE
    assert t.restarts_without_progress == 0
    actions = [run(F.USER_ERROR, t, None, node="node2").action for _ in range(3)]
    assert actions == [Action.RESTART, Action.RESTART, Action.STOP]


def test_a_lost_node_replaced_is_no_crash_but_a_lost_agent_on_a_healthy_node_is() -> None:
    d, h = decide(failure(F.NODE_LOSS), History(restarts_without_progress=1, ckpt_step_at_last_failure=5), 5,
                  LIMITS, ["node9"], ["node2"])
    assert d.action == Action.REPLACE_NODE and h.restarts_without_progress == 1
    d, h = decide(failure(F.NODE_LOSS), History(restarts_without_progress=1, ckpt_step_at_last_failure=5), 5,
                  LIMITS, ["node9"], ["node2"], agent_lost=["node2"])
    assert d.action == Action.REPLACE_NODE and h.restarts_without_progress == 2


# ------------------------------------------------------------------ a straggler moved onto a spare
def test_the_straggler_class_is_no_bad_node_and_no_suspect() -> None:
    info = CLASS_INFO[F.STRAGGLER]
    assert info.restartable and not info.bad_node and not info.suspect_node and not info.secondary


def test_a_straggler_takes_a_spare_without_counting_as_a_crash() -> None:
    before = History(restarts=2, restarts_without_progress=2, ckpt_step_at_last_failure=20)
    d, h = decide(failure(F.STRAGGLER), before, 30, LIMITS, ["node9"], [])
    assert d.action == Action.REPLACE_NODE and d.exclude == ("node2",), d
    assert "straggler node2 onto a spare at checkpoint step 30" in d.reason
    assert h.retired == {"node2"} and h.restarts == 2 and h.failures_on("node2") == 0
    assert h.restarts_without_progress == 0 and h.ckpt_step_at_last_failure == 30  # 30 > 20: progress
    # At the crash-loop limit and without progress, still a move, never a stop
    at_limit = History(restarts_without_progress=LIMITS.max_restarts_without_progress, ckpt_step_at_last_failure=30)
    d, h = decide(failure(F.STRAGGLER), at_limit, 30, LIMITS, ["node9"], [])
    assert d.action == Action.REPLACE_NODE and h.restarts_without_progress == LIMITS.max_restarts_without_progress


def test_a_straggler_without_a_spare_stays_and_never_requeues() -> None:
    before = History(restarts=Limits(1, 3).max_restarts, ckpt_step_at_last_failure=20)
    d, h = decide(failure(F.STRAGGLER), before, 30, Limits(1, 3), [], [])
    assert d.action == Action.RESTART and d.exclude == () and "no spare node left" in d.reason, d
    assert h.restarts == before.restarts and h.retired == frozenset()  # not counted
    # A straggler that a spare replaced already is never moved twice
    d, _ = decide(failure(F.STRAGGLER), History(retired=frozenset({"node2"})), 30, LIMITS, ["node9"], [])
    assert d.action == Action.RESTART


@pytest.mark.parametrize(("kind", "cls"), [("time_limit", F.TIME_LIMIT), ("preemption", F.PREEMPTION)])
def test_after_a_warning_a_straggler_move_is_the_allocation_end_and_excludes_nobody(kind: str,
                                                                                   cls: FailureClass) -> None:
    f = after_warning(failure(F.STRAGGLER), kind)
    assert f.cls == cls
    d, _ = decide(f, History(), 30, LIMITS, ["node9"], [], warned=kind)
    assert d.exclude == () and d.action in (Action.REQUEUE, Action.STOP)


def test_a_straggler_stop_loses_to_a_real_failure_that_came_first() -> None:
    stop = Evidence(100.0, "node2", -1, "agent", F.STRAGGLER, "moved at checkpoint step 30")
    killed = [Evidence(100.5, "node1", 2, "exit", F.RANK_CRASH, "returncode -9"),
              Evidence(100.6, "node1", 3, "line", F.NCCL_ERROR, "Connection closed by peer")]
    root = root_cause([stop, *killed])
    assert root is not None and root.cls == F.STRAGGLER and root.node == "node2"
    crash = Evidence(99.0, "node3", 4, "exit", F.RANK_CRASH, "returncode 1")
    root = root_cause([stop, *killed, crash])
    assert root is not None and root.cls == F.RANK_CRASH and root.node == "node3"
