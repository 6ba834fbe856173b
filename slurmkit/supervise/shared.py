"""What the supervisor's parts share (slurmkit.supervise.loop).

The supervisor is one object per node agent made of parts, each given only what it uses: the
generation loop (:class:`slurmkit.supervise.loop.Supervisor`, every node), node 0's decider
(:class:`slurmkit.supervise.deciding.Decider`: liveness, evidence, the decision, the failure
history) and the ways out (:class:`slurmkit.supervise.endings.Endings`: a requeue, a
successor job, a preemption's requeue, a stop, node 0's loss, leaving together). Here is what
more than one of them holds: where this agent is, the train slots and spares, the protocols of
the node and the ledger, and how a failing store is borne.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar, cast, overload

from slurmkit.errors import SlurmkitError
from slurmkit.failures.classes import FailureClass
from slurmkit.failures.classify import Evidence
from slurmkit.runfiles import REQUEUE_MARKS
from slurmkit.supervise.stragglers import NodeWindow
from slurmkit.supervise.timeouts import liveness_deadline_s

log = logging.getLogger(__name__)

__all__ = ["EXIT_WAIT_S", "FAILED", "PLANNED_REQUEUE", "REQUEUE_MARKS", "STACKS_BARRIER_S", "HandedOn", "Ledger",
           "Node", "Node0Lost", "Outcome", "Slots", "StoreTrouble", "Where"]

T = TypeVar("T")

FAILED = "failed"
#: How long node 0 keeps its store up at the end for agents that have not seen the end yet.
#: One that comes later finds the store gone and node 0's done marker (exits/succession.py).
EXIT_WAIT_S = 10.0
#: How long a node waits, on a hang, for every node to take its ranks' stacks before it kills its
#: own (each capture is bounded by a few seconds: slurmkit.launch.stackdump).
STACKS_BARRIER_S = 15.0
#: Classes that end the allocation, not the run: their requeues are the plan, not failures.
PLANNED_REQUEUE = frozenset({FailureClass.TIME_LIMIT, FailureClass.PREEMPTION})


class Node0Lost(SlurmkitError):
    """Node 0's agent (the store, the decider) is gone: seen by a follower."""


@dataclass(frozen=True)
class Outcome:
    kind: str  # completed | failed | signalled
    gen: int


class Node(Protocol):
    """What the loop needs from the node's launcher (slurmkit.launch.agent.NodeAgent)."""

    signal_kind: str | None

    def start(self, gen: int, slot: int, port: int, master_addr: str) -> None: ...
    def poll(self, gen: int) -> Evidence | None: ...  # the trigger of a failure seen on this node
    def exit_codes(self) -> list[int | None]: ...
    def stop(self) -> list[Evidence]: ...  # kill the ranks at once, return this node's evidence
    def capture_stacks(self, gen: int) -> list[Evidence]: ...  # a hang: stacks, before stop()
    def join_output(self) -> None: ...
    def step_window(self) -> NodeWindow | None: ...  # this node's next step-time window, if complete


class Ledger(Protocol):
    def append(self, event: str, **fields: Any) -> Any: ...


@dataclass(frozen=True)
class Where:
    """Where this agent is (a subset of slurmkit.launch.context.NodeContext)."""

    node_rank: int
    nodes: tuple[str, ...]
    attempt: str
    job_id: str
    executor: str  # "slurm" | "local"
    master_addr: str  # node 0's address (the store's)
    restart_count: int = 0
    addr: str = ""  # this node's address as the others reach it ("": master_addr, node 0)

    @property
    def node_name(self) -> str:
        return self.nodes[self.node_rank]


class Slots:
    """The train slots (slot -> node name) and the spares, as every agent holds them: one object
    the loop and node 0's decider share, so that a spare node 0 finds lost (the decider) is gone
    from the spares the loop applies the next replacement with."""

    def __init__(self, nodes: tuple[str, ...], train_nodes: int) -> None:
        # Spares are the allocation's nodes beyond the train nodes.
        self.node_map: list[str] = list(nodes[:train_nodes])
        self.spares: list[str] = list(nodes[train_nodes:])
        self.rank_of = {name: nr for nr, name in enumerate(nodes)}  # O(1) lookups at N=2,048

    def replace(self, bad: tuple[str, ...]) -> None:
        """A decision's replacement: each bad train node's slot goes to the next spare."""
        for name in bad:
            if name in self.node_map:
                spare = self.spares.pop(0)
                self.node_map[self.node_map.index(name)] = spare
            if name in self.spares:
                self.spares.remove(name)


class HandedOn(Generic[T]):
    """An attribute of the supervisor that its parts hold too (the node, the ledger, where the
    agent is, ...). The agent's entry point and the tests replace some after construction; the
    new value then reaches every part in the supervisor's ``parts`` that holds the attribute by
    the same name, so no part keeps acting on the one replaced."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> HandedOn[T]: ...
    @overload
    def __get__(self, obj: object, owner: type | None = None) -> T: ...

    def __get__(self, obj: object | None, owner: type | None = None) -> HandedOn[T] | T:
        if obj is None:
            return self
        return cast(T, vars(obj)[self.name])

    def __set__(self, obj: object, value: T) -> None:
        vars(obj)[self.name] = value
        for part in vars(obj).get("parts", ()):
            if self.name in vars(part):
                setattr(part, self.name, value)


class StoreTrouble:
    """How the loop bears a failing store: each error is retried on the next poll, and only two
    liveness deadlines of trouble without an answer are fatal (for a follower: node 0 is lost)."""

    def __init__(self, where: Where, *, beat_interval_s: float, node_timeout_s: float,
                 clock: Callable[[], float]) -> None:
        self.where, self.beat_interval_s, self.node_timeout_s, self.clock = where, beat_interval_s, node_timeout_s, clock
        self._since: float | None = None

    def ok(self) -> None:
        if self._since is not None:
            log.warning("agents' store answers again after %.1f s", self.clock() - self._since)
        self._since = None

    def failed(self, exc: BaseException) -> None:
        now = self.clock()
        if self._since is None:
            self._since = now
            log.warning("agents' store error (retrying): %s", exc)
        budget = 2 * liveness_deadline_s(self.beat_interval_s, self.node_timeout_s)
        if now - self._since > budget:
            if self.where.node_rank == 0:  # its own store: nothing to succeed to
                raise SlurmkitError(
                    f"Detected: this agent's own store has not answered for {now - self._since:.0f} s "
                    f"({exc}). Requirement: a working TCPStore on node 0. Fix: see this agent's log.") from exc
            raise Node0Lost(f"the agents' store on node 0 ({self.where.nodes[0]}) has not answered for "
                            f"{now - self._since:.0f} s ({exc})") from exc
