"""The recovery policy as an explicit state machine.

States and allowed transitions are a table; every transition is logged and written to the
ledger. ``decide`` is pure: given the root cause, the history of this allocation and what the
allocation still has (spare nodes), it says what to do next and returns the history that
follows; the caller keeps it. A decision that is thrown away (node 0 lost mid-decision, a
successor deciding again) therefore leaves no trace in the counters.
"""

from __future__ import annotations

import logging
import signal
from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import dataclass, field, replace
from enum import Enum

from slurmkit.errors import SlurmkitError
from slurmkit.failures.classes import CLASS_INFO, FailureClass
from slurmkit.failures.classify import Failure

log = logging.getLogger(__name__)


class State(str, Enum):
    STARTING = "starting"  # agents joined, ranks being started
    RUNNING = "running"
    STOPPING = "stopping"  # a failure was seen: every node stops its ranks
    DECIDING = "deciding"  # node 0 classifies the evidence and picks an action
    RESTARTING = "restarting"  # same nodes, next generation
    REPLACING = "replacing"  # a spare node takes a lost node's place, next generation
    CHECKPOINTING = "checkpointing"  # a time-limit/preemption warning: ranks save and exit
    REQUEUEING = "requeueing"  # ask Slurm for a new allocation (bad nodes excluded)
    STOPPED = "stopped"  # gave up: exit 93, no requeue
    COMPLETED = "completed"


TRANSITIONS: dict[State, frozenset[State]] = {
    State.STARTING: frozenset({State.RUNNING, State.STOPPING, State.CHECKPOINTING}),
    State.RUNNING: frozenset({State.STOPPING, State.CHECKPOINTING, State.COMPLETED}),
    # Node 0 decides; the other nodes wait for its decision and apply it straight from STOPPING.
    State.STOPPING: frozenset({State.DECIDING, State.RESTARTING, State.REPLACING, State.REQUEUEING,
                               State.STOPPED}),
    State.DECIDING: frozenset({State.RESTARTING, State.REPLACING, State.REQUEUEING, State.STOPPED}),
    State.RESTARTING: frozenset({State.STARTING}),
    State.REPLACING: frozenset({State.STARTING}),
    State.CHECKPOINTING: frozenset({State.REQUEUEING, State.STOPPED, State.COMPLETED, State.DECIDING,
                                    State.STOPPING}),
    State.REQUEUEING: frozenset(),
    State.STOPPED: frozenset(),
    State.COMPLETED: frozenset(),
}


# Classes that end the allocation but not the job: a new allocation continues it.
_ALLOCATION_ENDS = frozenset({FailureClass.TIME_LIMIT, FailureClass.PREEMPTION})


#: The stop signal an agent forwards to its ranks, by its ``signal_kind``: SIGUSR1 is the
#: time-limit warning (Slurm's --signal=B:USR1@lead); SIGTERM a preemption or a cancel (scancel
#: sends it too: the agent cannot tell them apart).
FORWARDED = {"time_limit": signal.SIGUSR1, "preemption": signal.SIGTERM}


def _killed_by(failure: Failure, signum: int) -> bool:
    """The root is a rank's exit by ``signum`` (Popen's -N, or a shell wrapper's 128+N)."""
    return failure.evidence in (f"returncode {-signum}", f"returncode {128 + signum}")


def after_warning(failure: Failure, warned: str | None) -> Failure:
    """The failure of a generation once a stop signal came, as the caller records and decides it.

    Once the time-limit warning or a SIGTERM came, the allocation is ending: a rank that died of
    the very signal its agent forwarded (a program without a handler, or one still starting up
    before it installed its own) stopped on the warning, and any other failure that a restart
    could fix cannot be restarted into an allocation with a minute left. Both are the
    allocation's end (TIME_LIMIT or PREEMPTION: never a crash counted toward a crash loop or
    toward supervisor.max_requeues). A lost or bad node stays what it is: it must leave the
    job (``decide`` requeues without it). ``failure`` is not changed."""
    sig = FORWARDED.get(warned or "")
    info = CLASS_INFO[failure.cls]
    if (sig is None or failure.cls in _ALLOCATION_ENDS or not info.restartable or info.bad_node
            or failure.cls == FailureClass.NODE_LOSS):
        return failure
    cls = FailureClass.TIME_LIMIT if sig == signal.SIGUSR1 else FailureClass.PREEMPTION
    what = f"stopped by the {signal.Signals(sig).name} its agent forwarded" if _killed_by(failure, sig) else (
        f"after the {'time-limit warning' if sig == signal.SIGUSR1 else 'SIGTERM'}")
    return replace(failure, cls=cls, evidence=f"{failure.evidence} ({what}; was {failure.cls.value})")


class Action(str, Enum):
    RESTART = "restart"
    REPLACE_NODE = "replace_node"
    REQUEUE = "requeue"
    STOP = "stop"


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str
    exclude: tuple[str, ...] = ()  # nodes to exclude (requeue) or to retire (replace)


@dataclass(frozen=True)
class History:
    """What happened in this allocation so far (node 0's memory across generations); never
    changed in place: ``decide`` returns the next one."""

    restarts: int = 0
    restarts_without_progress: int = 0
    ckpt_step_at_last_failure: int | None = None
    failures_per_node: tuple[tuple[str, int], ...] = ()  # (node, suspect failures), sorted
    retired: frozenset[str] = field(default_factory=frozenset)  # nodes a spare already replaced

    def failures_on(self, node: str) -> int:
        return dict(self.failures_per_node).get(node, 0)

    def restarted(self) -> "History":
        return replace(self, restarts=self.restarts + 1)


@dataclass(frozen=True)
class Limits:
    max_restarts: int
    max_restarts_without_progress: int


def decide(failure: Failure, history: History, ckpt_step: int | None, limits: Limits,
           spare_nodes: list[str], lost_nodes: list[str],
           agent_lost: Collection[str] = (), *, warned: str | None = None,
           can_requeue: bool = True, bad_nodes: Collection[str] = ()) -> tuple[Decision, History]:
    """What to do about ``failure``, and the history after it (progress is checkpoint progress).

    ``bad_nodes``: every node this generation's evidence proves bad at once (its pre-flight
    failed, its GPU faulted: classify.bad_nodes), whichever failure is the root. One decision
    moves all of them and every lost node out: a spare each, or, when the spares run out, a
    requeue without them all (a generation cannot run with a slot empty). A failure that moves
    a node out is the node's, not the program's: it does not count toward the crash loop.

    ``agent_lost`` are lost nodes whose agent is gone while Slurm still calls the node healthy
    (SIGKILLed, or it reported its own error): the node is not to blame, so it is never
    excluded from a requeue, and its silence never counts as a suspect failure. Without its
    agent it cannot run this allocation's next generation: a spare takes its slot, else the job
    requeues with the node kept. Before this is called, node 0 first tries to relaunch such an
    agent inside the allocation, in its own slot (slurmkit.supervise.relaunch, from
    ``Decider.relaunch_kept``: a restart, with no call here); what reaches this function is
    the case where that was not possible or failed.

    A ``straggler`` (node 0 stopped the generation at a checkpoint to move a slow node out:
    health.straggler_action=replace) takes a spare, or restarts with the node kept when none is
    left; it never requeues and never counts as a crash (``_move_straggler``).

    ``warned``: the stop signal this allocation got (the agent's ``signal_kind``; pass the
    failure through ``after_warning`` first). The allocation is ending, so no new generation
    starts in it: no restart, no spare (one brought in with a minute left could not finish a
    generation). After the time-limit warning the job requeues (without its bad nodes) and
    resumes from its newest recovery point in the next allocation; ``can_requeue`` False (a
    cancel request on file, job.requeue=false, no Slurm) stops instead. After a SIGTERM it
    stops without a requeue from here: Slurm requeues a preempted job itself, and scancel sends
    the same signal (a requeue could bring back a job its user cancelled).

    ``history`` is not changed."""
    info = CLASS_INFO[failure.cls]
    where = failure.where()
    if warned is not None and (warned != "time_limit" or not can_requeue) and (
            info.restartable or failure.cls in _ALLOCATION_ENDS):
        why = ("SIGTERM (a preemption, which Slurm requeues itself, or a cancel): no requeue from here"
               if warned != "time_limit" else "the time-limit warning, and no requeue (cancel requested, "
               "job.requeue=false or no Slurm)")
        return Decision(Action.STOP, f"{where}; the allocation ends after {why}: resume from the last "
                        f"checkpoint (step {ckpt_step})"), history
    if failure.cls in _ALLOCATION_ENDS:
        # The allocation is ending, not the job: exit 93 here would forbid the requeue that
        # resumes it from its last checkpoint.
        return Decision(Action.REQUEUE, f"{where}; the allocation ends: requeue"), history
    if not info.restartable:
        return Decision(Action.STOP, f"{where}; restarting cannot fix {failure.cls.value}: fix the "
                        "configuration (memory, batch size, layout) and resubmit"), history
    if failure.cls == FailureClass.STRAGGLER and warned is None:
        return _move_straggler(failure, history, ckpt_step, spare_nodes, where)
    kept = set(agent_lost) & set(lost_nodes)
    at_once = ({failure.node} if info.bad_node and failure.node else set()) | (set(bad_nodes) - kept)
    # A node that is lost or proven bad (a GPU fault, a failed pre-flight) is not the program's
    # crash loop: it leaves (spare or requeue without it) however many failures came before,
    # and its failure is not one more toward the limit.
    hardware = ((set(lost_nodes) - kept) | at_once) - history.retired
    h = _after_failure(failure, history, ckpt_step, counts=not hardware, kept=kept)
    repeated = {n for n, k in h.failures_per_node if k >= 2}
    bad = sorted(((set(lost_nodes) - kept) | repeated | at_once) - h.retired)
    if warned is not None:  # the time-limit warning came: nothing more runs in this allocation
        tail = f" without {','.join(bad)}" if bad else ""
        return Decision(Action.REQUEUE, f"{where}; after the time-limit warning: requeue{tail}, "
                        "no restart or spare in an allocation that ends", tuple(bad)), h
    if h.restarts_without_progress >= limits.max_restarts_without_progress and not hardware:
        return Decision(Action.STOP, f"{where}; {h.restarts_without_progress} failures in a row "
                        f"without checkpoint progress (last checkpoint step {ckpt_step}): a crash loop"), h
    gone = sorted(kept - h.retired - set(bad))  # healthy nodes without an agent
    if bad or gone:
        return _move_out(where, h, bad, gone, spare_nodes)
    if h.restarts >= limits.max_restarts:
        return Decision(Action.REQUEUE, f"{where}; {h.restarts} restarts in this allocation"), h
    h = h.restarted()
    return Decision(Action.RESTART, f"{where}; restart {h.restarts} in the allocation"), h


def _after_failure(failure: Failure, history: History, ckpt_step: int | None, *, counts: bool,
                   kept: Collection[str]) -> History:
    """The history once ``failure`` happened: checkpoint progress resets the crash-loop count,
    a failure without progress adds one when it ``counts`` (not when it moves a node out), and
    a suspect class counts against its node (not one whose agent alone was lost)."""
    progressed = ckpt_step is not None and (history.ckpt_step_at_last_failure is None
                                            or ckpt_step > history.ckpt_step_at_last_failure)
    per_node = Counter(dict(history.failures_per_node))
    if CLASS_INFO[failure.cls].suspect_node and failure.node and failure.node not in kept:
        per_node[failure.node] += 1
    without = 0 if progressed else history.restarts_without_progress + (1 if counts else 0)
    return replace(history, restarts_without_progress=without, ckpt_step_at_last_failure=ckpt_step,
                   failures_per_node=tuple(sorted(per_node.items())))


def _move_out(where: str, h: History, bad: list[str], gone: list[str],
              spare_nodes: list[str]) -> tuple[Decision, History]:
    """Every bad node and every healthy node without an agent leaves in this one decision."""
    out = bad + gone
    if len(spare_nodes) >= len(out):
        why = f"replacing {','.join(out)} with {'a spare' if len(out) == 1 else f'{len(out)} spares'}" + (
            f" ({','.join(gone)}: agent lost, node healthy, kept for later allocations)" if gone else "")
        return (Decision(Action.REPLACE_NODE, f"{where}; {why}", tuple(out)),
                replace(h, retired=h.retired | frozenset(out)))
    if not bad:
        return Decision(Action.REQUEUE, f"{where}; agent lost on {','.join(gone)} while Slurm calls "
                        "the node healthy and no spare is left: requeue keeping the node"), h
    kept_note = f" (keeping {','.join(gone)}: agent lost, node healthy)" if gone else ""
    short = f"{len(spare_nodes)} spare(s) for {len(out)} nodes" if spare_nodes else "no spare node left"
    return Decision(Action.REQUEUE, f"{where}; {short} ({','.join(bad)}): requeue "
                    f"without {'it' if len(bad) == 1 else 'them'}{kept_note}", tuple(bad)), h


def _move_straggler(failure: Failure, history: History, ckpt_step: int | None, spare_nodes: list[str],
                    where: str) -> tuple[Decision, History]:
    """Node 0 stopped the generation right after a checkpoint newer than the naming committed,
    to move the slow node onto a spare. Neither a crash nor a restart is counted: the training
    lost only the steps since that checkpoint. Without a spare left (lost since node 0 chose to
    stop) the node stays and the generation restarts from the checkpoint; never a requeue."""
    h = _after_failure(failure, history, ckpt_step, counts=False, kept=())
    if failure.node and failure.node not in history.retired and spare_nodes:
        return (Decision(Action.REPLACE_NODE, f"{where}; moving the straggler {failure.node} onto a spare "
                         f"at checkpoint step {ckpt_step}", (failure.node,)),
                replace(h, retired=h.retired | {failure.node}))
    return Decision(Action.RESTART, f"{where}; no spare node left: {failure.node} stays (reported only), "
                    f"restart from checkpoint step {ckpt_step}"), h


def requeue_refusal(*, failure_requeues: int | None, max_requeues: int, excluded: Collection[str],
                    partition: str | None, partition_nodes: Collection[str] | None,
                    needed: int) -> str | None:
    """Why a requeue must not happen (a Detected/Requirement/Fix message), or None.

    ``failure_requeues`` counts the earlier requeues of this run that a failure caused (None:
    this requeue is not a failure's; a time-limit requeue is the plan for a long run, and
    neither it nor any earlier one is counted).
    ``excluded`` is every node the requeued job would exclude (Slurm's ExcNodeList merged with
    the new ones); ``partition_nodes`` the partition's nodes (None: unknown, not checked). A job
    that excludes so many nodes that the partition cannot hold it would pend forever
    (BadConstraints); one that failed ``max_requeues`` times over is a crash loop across
    allocations. Both stop with exit 93 instead."""
    if failure_requeues is not None and failure_requeues >= max_requeues:
        return (f"Detected: {failure_requeues} requeues after failures already (supervisor.max_requeues="
                f"{max_requeues}). Requirement: a run that keeps failing across allocations stops "
                "instead of requeueing forever. Fix: read the failures in the ledger (slurmkit report), "
                "fix their cause and resubmit, or raise supervisor.max_requeues.")
    if partition_nodes is None:
        return None
    left = set(partition_nodes) - set(excluded)
    if len(left) < needed:
        return (f"Detected: the requeue would exclude {len(set(excluded) & set(partition_nodes))} of the "
                f"{len(set(partition_nodes))} nodes of partition {partition} ({','.join(sorted(excluded))}), "
                f"leaving {len(left)} for a job of {needed} nodes: it would pend forever (BadConstraints). "
                f"Requirement: at least {needed} nodes of the partition not excluded. Fix: repair or "
                "resume the excluded nodes, or resubmit with fewer nodes (or on a larger partition).")
    return None


class StateMachine:
    """Holds the state; ``to`` refuses transitions the table does not allow."""

    def __init__(self, on_transition: Callable[[State, State, str], None]) -> None:
        self.state = State.STARTING
        self._on_transition = on_transition

    def to(self, new: State, why: str = "") -> None:
        if new not in TRANSITIONS[self.state]:
            raise SlurmkitError(f"supervisor: illegal transition {self.state.value} -> {new.value} ({why})")
        old, self.state = self.state, new
        log.info("supervisor: %s -> %s %s", old.value, new.value, why)
        self._on_transition(old, new, why)
