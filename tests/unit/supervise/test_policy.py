"""Recovery policy (decide) and the supervisor's state machine."""

from __future__ import annotations

from collections import deque

import pytest

from slurmkit.errors import SlurmkitError
from slurmkit.failures.classes import CLASS_INFO, FailureClass
from slurmkit.failures.classify import Failure
from slurmkit.supervise.policy import (TRANSITIONS, Action, Decision, History, Limits, State,
                                       StateMachine, after_warning, decide, requeue_refusal)

F = FailureClass
LIMITS = Limits(max_restarts=5, max_restarts_without_progress=3)


def failure(cls: FailureClass, node: str = "node2", rank: int = 3) -> Failure:
    return Failure(cls=cls, rank=rank, node=node, time=0.0, evidence="line", ranks_affected=(0, 1, 2, 3))


class Track:
    """The caller's side of the pure ``decide``: keeps the history each decision returns."""

    def __init__(self, h: History | None = None) -> None:
        self.h = h or History()

    def __getattr__(self, name: str) -> object:
        return getattr(self.h, name)


def run(cls: FailureClass, h: "Track | History", ckpt: int | None = 100, *, spares: list[str] | None = None,
        lost: list[str] | None = None, node: str = "node2", limits: Limits = LIMITS) -> Decision:
    t = h if isinstance(h, Track) else Track(h)
    d, t.h = decide(failure(cls, node), t.h, ckpt, limits, spares or [], lost or [])
    return d


def test_decide_is_pure() -> None:
    before = History(restarts=1, failures_per_node=(("node2", 1),))
    d, after = decide(failure(F.NCCL_ERROR), before, 50, LIMITS, ["node9"], [])
    assert before == History(restarts=1, failures_per_node=(("node2", 1),))
    assert d.action == Action.REPLACE_NODE and after.retired == {"node2"} and after.failures_on("node2") == 2
    # The same inputs give the same answer (a successor that decides again agrees).
    assert decide(failure(F.NCCL_ERROR), before, 50, LIMITS, ["node9"], []) == (d, after)


@pytest.mark.parametrize("cls", [F.GPU_OOM, F.HOST_OOM, F.CONFIG_ERROR])
def test_non_restartable_class_stops(cls: FailureClass) -> None:
    d = run(cls, History())
    assert d.action == Action.STOP
    assert cls.value in d.reason and "resubmit" in d.reason


@pytest.mark.parametrize("cls", [F.TIME_LIMIT, F.PREEMPTION])
def test_allocation_end_requeues_instead_of_stopping(cls: FailureClass) -> None:
    # Exit 93 (STOP) would forbid the requeue that resumes the job from its checkpoint.
    d = run(cls, History())
    assert d.action == Action.REQUEUE and d.exclude == ()


def test_restartable_failure_restarts_and_counts() -> None:
    h = Track()
    d = run(F.USER_ERROR, h, ckpt=20)
    assert d.action == Action.RESTART and h.restarts == 1
    assert "restart 1" in d.reason


def test_crash_loop_without_checkpoint_progress_stops() -> None:
    h = Track()
    actions = [run(F.USER_ERROR, h, ckpt=None).action for _ in range(3)]
    assert actions == [Action.RESTART, Action.RESTART, Action.STOP]
    assert h.restarts_without_progress == 3


def test_crash_loop_at_the_same_checkpoint_stops() -> None:
    h = Track()
    actions = [run(F.RANK_CRASH, h, ckpt=40).action for _ in range(4)]
    # The first failure after step 40 is progress (nothing seen before); then 3 without.
    assert actions == [Action.RESTART, Action.RESTART, Action.RESTART, Action.STOP]
    d = run(F.RANK_CRASH, History(restarts_without_progress=2, ckpt_step_at_last_failure=40), ckpt=40)
    assert d.action == Action.STOP and "crash loop" in d.reason


def test_checkpoint_progress_resets_the_counter() -> None:
    h = Track()
    run(F.USER_ERROR, h, ckpt=None)
    run(F.USER_ERROR, h, ckpt=None)
    assert h.restarts_without_progress == 2
    d = run(F.USER_ERROR, h, ckpt=20)
    assert d.action == Action.RESTART and h.restarts_without_progress == 0
    run(F.USER_ERROR, h, ckpt=20)
    run(F.USER_ERROR, h, ckpt=20)
    assert run(F.USER_ERROR, h, ckpt=20).action == Action.STOP


def test_lost_node_with_a_spare_is_replaced() -> None:
    d = run(F.NODE_LOSS, History(), spares=["node3"], lost=["node2"])
    assert d.action == Action.REPLACE_NODE and d.exclude == ("node2",)


def test_lost_node_without_a_spare_requeues_excluding_it() -> None:
    d = run(F.NODE_LOSS, History(), spares=[], lost=["node2"])
    assert d.action == Action.REQUEUE and d.exclude == ("node2",)
    assert "no spare" in d.reason


def test_two_lost_nodes_one_spare_requeues_excluding_both() -> None:
    d = run(F.NODE_LOSS, History(), spares=["node5"], lost=["node3", "node2"])
    assert d.action == Action.REQUEUE and d.exclude == ("node2", "node3")


def test_node_failing_twice_with_suspect_class_is_excluded() -> None:
    assert CLASS_INFO[F.NCCL_TIMEOUT].suspect_node
    h = Track()
    assert run(F.NCCL_TIMEOUT, h, ckpt=10, node="node2").action == Action.RESTART
    d = run(F.NCCL_TIMEOUT, h, ckpt=20, node="node2")
    assert d.action == Action.REQUEUE and d.exclude == ("node2",)
    h2 = Track()
    run(F.WATCHDOG_STUCK, h2, ckpt=10, node="node2")
    d2 = run(F.HANG, h2, ckpt=20, node="node2", spares=["node9"])
    assert d2.action == Action.REPLACE_NODE and d2.exclude == ("node2",)


def test_non_suspect_failures_never_exclude_a_node() -> None:
    h = Track()
    for step in (10, 20, 30, 40):
        d = run(F.USER_ERROR, h, ckpt=step, node="node2")
        assert d.action == Action.RESTART and d.exclude == ()
    assert h.failures_on("node2") == 0


def test_replaced_node_is_not_excluded_again() -> None:
    h = Track()
    run(F.NCCL_ERROR, h, ckpt=10, node="node2")
    d = run(F.NCCL_ERROR, h, ckpt=20, node="node2", spares=["node3"])
    assert d.action == Action.REPLACE_NODE
    # node2 is out of the job: a later failure elsewhere must not ask for a spare for it again.
    d = run(F.USER_ERROR, h, ckpt=30, node="node1", spares=[])
    assert d.action == Action.RESTART and d.exclude == ()


def test_max_restarts_requeues() -> None:
    h = Track()
    limits = Limits(max_restarts=2, max_restarts_without_progress=3)
    actions = [run(F.USER_ERROR, h, ckpt=10 * (i + 1), limits=limits).action for i in range(3)]
    assert actions == [Action.RESTART, Action.RESTART, Action.REQUEUE]
    assert h.restarts == 2


# ------------------------------------------------------------------ an agent lost on a healthy node
def test_an_agent_lost_on_a_healthy_node_requeues_keeping_the_node() -> None:
    # A SIGKILLed agent, slurmd alive (Slurm says MIXED): the node is not to blame.
    d, h = decide(failure(F.NODE_LOSS), History(), 100, LIMITS, [], ["node2"], agent_lost=["node2"])
    assert d.action == Action.REQUEUE and d.exclude == ()
    assert "keeping the node" in d.reason
    assert h.failures_on("node2") == 0  # not a suspect failure either
    # The same loss without Slurm's word that the node is fine: excluded, as before.
    d, _ = decide(failure(F.NODE_LOSS), History(), 100, LIMITS, [], ["node2"])
    assert d.action == Action.REQUEUE and d.exclude == ("node2",)


def test_a_killed_agent_after_a_suspect_failure_is_no_repeat() -> None:
    # Chaos seed 1: an NCCL error on node2 (one suspect failure), then node2's agent SIGKILLed
    # with the node up. Two "suspect" failures on node2 excluded it; the second is not one.
    h = Track()
    assert run(F.NCCL_ERROR, h, ckpt=10, node="node2").action == Action.RESTART
    d, h.h = decide(failure(F.NODE_LOSS), h.h, 20, LIMITS, [], ["node2"], agent_lost=["node2"])
    assert d.action == Action.REQUEUE and d.exclude == ()
    assert h.failures_on("node2") == 1


def test_an_agent_lost_on_a_healthy_node_gives_its_slot_to_a_spare() -> None:
    d, h = decide(failure(F.NODE_LOSS), History(), 100, LIMITS, ["node9"], ["node2"], agent_lost=["node2"])
    assert d.action == Action.REPLACE_NODE and d.exclude == ("node2",) and "kept for later" in d.reason
    assert h.retired == {"node2"} and h.failures_on("node2") == 0


def test_a_dead_node_and_a_lost_agent_requeue_excluding_only_the_dead_node() -> None:
    d, _ = decide(failure(F.NODE_LOSS, node="node3"), History(), 100, LIMITS, ["node9"], ["node2", "node3"],
                  agent_lost=["node2"])
    assert d.action == Action.REQUEUE and d.exclude == ("node3",) and "keeping node2" in d.reason


def test_an_agent_lost_again_without_checkpoint_progress_is_still_a_crash_loop() -> None:
    h = History(restarts_without_progress=2, ckpt_step_at_last_failure=100)
    d, _ = decide(failure(F.NODE_LOSS), h, 100, LIMITS, [], ["node2"], agent_lost=["node2"])
    assert d.action == Action.STOP and "crash loop" in d.reason


# ------------------------------------------------------------------ requeue caps
def test_requeues_after_failures_stop_at_max_requeues() -> None:
    assert requeue_refusal(failure_requeues=19, max_requeues=20, excluded=(), partition=None,
                           partition_nodes=None, needed=2) is None
    why = requeue_refusal(failure_requeues=20, max_requeues=20, excluded=(), partition=None,
                          partition_nodes=None, needed=2)
    assert why is not None and why.startswith("Detected: 20 requeues") and "Requirement:" in why
    assert "Fix:" in why and "supervisor.max_requeues" in why
    # A time-limit requeue is not a failure's: never capped.
    assert requeue_refusal(failure_requeues=None, max_requeues=0, excluded=(), partition=None,
                           partition_nodes=None, needed=2) is None


def test_exclusions_that_leave_the_partition_too_small_stop() -> None:
    part = ["n0", "n1", "n2", "n3"]
    assert requeue_refusal(failure_requeues=0, max_requeues=20, excluded=["n1", "n2"], partition="debug",
                           partition_nodes=part, needed=2) is None
    why = requeue_refusal(failure_requeues=0, max_requeues=20, excluded=["n1", "n2", "n3"], partition="debug",
                          partition_nodes=part, needed=2)
    assert why is not None and "exclude 3 of the 4 nodes of partition debug" in why
    assert "leaving 1 for a job of 2 nodes" in why and "BadConstraints" in why and "Fix:" in why
    # Excluded nodes outside the partition take nothing from it.
    assert requeue_refusal(failure_requeues=0, max_requeues=20, excluded=["x1", "x2", "x3"], partition="debug",
                           partition_nodes=part, needed=4) is None
    # The partition unknown (Slurm did not answer): not checked.
    assert requeue_refusal(failure_requeues=0, max_requeues=20, excluded=part, partition=None,
                           partition_nodes=None, needed=2) is None


# ------------------------------------------------------------------ state machine

ALL_PAIRS = [(a, b) for a in State for b in State]


@pytest.mark.parametrize(("old", "new"), [(a, b) for a, b in ALL_PAIRS if b in TRANSITIONS[a]])
def test_every_allowed_transition_is_taken(old: State, new: State) -> None:
    seen: list[tuple[State, State, str]] = []
    sm = StateMachine(lambda o, n, why: seen.append((o, n, why)))
    sm.state = old
    sm.to(new, "because")
    assert sm.state == new and seen == [(old, new, "because")]


@pytest.mark.parametrize(("old", "new"), [(a, b) for a, b in ALL_PAIRS if b not in TRANSITIONS[a]])
def test_every_other_transition_is_refused(old: State, new: State) -> None:
    seen: list[tuple[State, State, str]] = []
    sm = StateMachine(lambda o, n, why: seen.append((o, n, why)))
    sm.state = old
    with pytest.raises(SlurmkitError, match=f"{old.value} -> {new.value}"):
        sm.to(new)
    assert sm.state == old and seen == []


def reachable(start: State) -> set[State]:
    seen, todo = {start}, deque([start])
    while todo:
        for nxt in TRANSITIONS[todo.popleft()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_table_covers_every_state_and_has_no_unreachable_state() -> None:
    assert set(TRANSITIONS) == set(State)
    assert reachable(State.STARTING) == set(State)


def test_every_state_can_end() -> None:
    terminal = {s for s, nxt in TRANSITIONS.items() if not nxt}
    assert terminal == {State.REQUEUEING, State.STOPPED, State.COMPLETED}
    for s in State:
        assert reachable(s) & terminal, s


def test_follower_node_applies_node0_decision_from_stopping() -> None:
    # Nodes other than 0 never decide: they go STOPPING -> (node 0's action) directly.
    for action_state in (State.RESTARTING, State.REPLACING, State.REQUEUEING, State.STOPPED):
        sm = StateMachine(lambda o, n, why: None)
        for s in (State.RUNNING, State.STOPPING, action_state):
            sm.to(s)
        assert sm.state == action_state


def test_a_generation_cycle_logs_one_callback_per_transition() -> None:
    seen: list[str] = []
    sm = StateMachine(lambda o, n, why: seen.append(f"{o.value}>{n.value}"))
    for s in (State.RUNNING, State.STOPPING, State.DECIDING, State.RESTARTING, State.STARTING,
              State.RUNNING, State.CHECKPOINTING, State.REQUEUEING):
        sm.to(s)
    assert seen == ["starting>running", "running>stopping", "stopping>deciding", "deciding>restarting",
                    "restarting>starting", "starting>running", "running>checkpointing",
                    "checkpointing>requeueing"]


@pytest.mark.parametrize("cls", [F.GPU_FAULT, F.PREFLIGHT])
def test_a_bad_node_leaves_even_after_failures_without_progress(cls: FailureClass) -> None:
    # Two failures without checkpoint progress, then a GPU fault: the node is the cause, not the
    # program; stopping with 93 would end a run a spare or a requeue without the node can save.
    t = Track(History(restarts_without_progress=LIMITS.max_restarts_without_progress - 1,
                      ckpt_step_at_last_failure=100))
    d = run(cls, t, 100, spares=["node9"])
    assert d.action == Action.REPLACE_NODE and d.exclude == ("node2",), d
    d = run(cls, Track(t.h), 100, node="node3")
    assert d.action == Action.REQUEUE and d.exclude == ("node3",), d


def test_a_crash_loop_still_stops_when_no_node_is_to_blame() -> None:
    t = Track(History(restarts_without_progress=LIMITS.max_restarts_without_progress - 1,
                      ckpt_step_at_last_failure=100))
    assert run(F.RANK_CRASH, t, 100, spares=["node9"]).action == Action.STOP


# ------------------------------------------------------------------ after a stop signal
def exited(code: int, node: str = "node2") -> Failure:
    """A rank's exit as root_cause reports it (the monitor's "returncode N" detail)."""
    return Failure(cls=F.RANK_CRASH, rank=3, node=node, time=0.0, evidence=f"returncode {code}",
                   ranks_affected=(3,))


@pytest.mark.parametrize(("kind", "code", "cls"), [("time_limit", -10, F.TIME_LIMIT),
                                                   ("time_limit", 138, F.TIME_LIMIT),
                                                   ("preemption", -15, F.PREEMPTION)])
def test_a_rank_killed_by_the_signal_its_agent_forwarded_stopped_on_the_warning(
        kind: str, code: int, cls: FailureClass) -> None:
    f = after_warning(exited(code), kind)
    assert f.cls == cls and "its agent forwarded" in f.evidence and "was rank_crash" in f.evidence
    assert after_warning(exited(code), None) == exited(code)  # no warning: a crash, as before


def test_other_restartable_failures_after_the_warning_are_the_allocation_end_but_nodes_stay_bad() -> None:
    f = after_warning(failure(F.USER_ERROR), "time_limit")
    assert f.cls == F.TIME_LIMIT and "after the time-limit warning" in f.evidence
    assert after_warning(failure(F.HANG), "preemption").cls == F.PREEMPTION
    for cls in (F.GPU_FAULT, F.PREFLIGHT, F.NODE_LOSS, F.GPU_OOM, F.CONFIG_ERROR):
        assert after_warning(failure(cls), "time_limit") == failure(cls)


def test_a_failure_after_the_warning_requeues_even_at_the_crash_loop_limit() -> None:
    # Two failures without progress, then the warning's SIGUSR1 kills a rank that had no handler
    # yet: that is the time limit, not the third failure of a crash loop (93, no requeue).
    h = History(restarts_without_progress=LIMITS.max_restarts_without_progress - 1, ckpt_step_at_last_failure=100)
    d, _ = decide(after_warning(exited(-10), "time_limit"), h, 100, LIMITS, ["node9"], [], warned="time_limit")
    assert d.action == Action.REQUEUE and d.exclude == ()


def test_after_the_warning_a_lost_agent_on_a_healthy_node_requeues_keeping_it_not_taking_a_spare() -> None:
    d, _ = decide(failure(F.NODE_LOSS), History(), 100, LIMITS, ["node9"], ["node2"], agent_lost=["node2"],
                  warned="time_limit")
    assert d.action == Action.REQUEUE and d.exclude == (), d
    # A dead node leaves with the requeue; the healthy one without an agent stays.
    d, _ = decide(failure(F.NODE_LOSS, node="node3"), History(), 100, LIMITS, ["node9"], ["node2", "node3"],
                  agent_lost=["node2"], warned="time_limit")
    assert d.action == Action.REQUEUE and d.exclude == ("node3",), d


def test_after_the_warning_nothing_restarts_in_the_allocation() -> None:
    # A bad node that a spare replaced earlier fails again: without the warning a restart;
    # after it, a requeue (a generation started now could not finish).
    h = History(retired=frozenset({"node2"}))
    assert decide(failure(F.GPU_FAULT), h, 100, LIMITS, [], [])[0].action == Action.RESTART
    d, _ = decide(failure(F.GPU_FAULT), h, 100, LIMITS, [], [], warned="time_limit")
    assert d.action == Action.REQUEUE


@pytest.mark.parametrize("cls", [F.RANK_CRASH, F.USER_ERROR, F.GPU_FAULT, F.NODE_LOSS, F.PREEMPTION])
def test_after_a_sigterm_no_restart_and_no_requeue_from_here(cls: FailureClass) -> None:
    # SIGTERM is a preemption (Slurm requeues the job itself) or a cancel (scancel sends it too).
    f = after_warning(failure(cls), "preemption")
    d, _ = decide(f, History(), 100, LIMITS, ["node9"], ["node2"] if cls == F.NODE_LOSS else [],
                  warned="preemption")
    assert d.action == Action.STOP and "SIGTERM" in d.reason and "step 100" in d.reason


def test_after_the_warning_without_a_possible_requeue_it_stops() -> None:
    f = after_warning(exited(-10), "time_limit")
    d, _ = decide(f, History(), 100, LIMITS, [], [], warned="time_limit", can_requeue=False)
    assert d.action == Action.STOP and "no requeue" in d.reason
    # A program bug after the warning (an OOM) still stops as the bug it is.
    d, _ = decide(failure(F.GPU_OOM), History(), 100, LIMITS, [], [], warned="time_limit")
    assert d.action == Action.STOP and "restarting cannot fix gpu_oom" in d.reason


def test_without_a_warning_decide_is_unchanged() -> None:
    assert run(F.PREEMPTION, History()).action == Action.REQUEUE
    assert run(F.RANK_CRASH, History()).action == Action.RESTART
