"""The supervisor's state and what every part of it shares (slurmkit.supervise.loop).

:class:`SupervisorBase` holds what one node agent's supervisor knows (its place, the train
slots and spares, liveness, history, limits) and how it handles a failing store; the parts
build on it: :mod:`slurmkit.supervise.deciding` (node 0: liveness, evidence, the decision and
the requeue caps), :mod:`slurmkit.supervise.endings` (every node: applying a decision, a
signal's end, node 0's loss, this agent's own failure, leaving together) and
:mod:`slurmkit.supervise.loop` (the generations: start, watch, wait for the decision).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from slurmkit.config import SlurmkitConfig
from slurmkit.errors import SlurmkitError
from slurmkit.runfiles import REQUEUE_MARKS
from slurmkit.slurm.client import SlurmClient
from slurmkit.supervise.channel import Channel, FailureNotice
from slurmkit.failures.classes import FailureClass
from slurmkit.failures.classify import Evidence
from slurmkit.supervise.endwatch import EndWatch
from slurmkit.failures.programs import exit0_is_completion
from slurmkit.supervise.policy import Decision, History, Limits, State, StateMachine
from slurmkit.supervise.slurmview import SlurmdProbe, slurmd_answers
from slurmkit.supervise.liveness import Beater, Liveness, Lost, client_node_states
from slurmkit.supervise.straggler_move import StragglerActions
from slurmkit.supervise.stragglers import NodeWindow, StragglerDetector
from slurmkit.supervise.timeouts import beat_interval_s, liveness_deadline_s

log = logging.getLogger(__name__)

FAILED = "failed"
#: One empty marker file per requeue a failure caused (named by the attempt that requeued, so a
#: successor deciding again adds none): their count is what supervisor.max_requeues limits.
#: How long node 0 keeps its store up at the end for agents that have not seen the end yet.
#: One that comes later finds the store gone and node 0's done marker (succession.py).
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


class SupervisorBase:
    """What one agent's supervisor knows and shares with its parts (see the module docstring)."""

    def __init__(self, cfg: SlurmkitConfig, where: Where, channel: Channel, node: Node, ledger: Ledger, *,
                 train_nodes: int, run_dir: str, env: Mapping[str, str] | None = None,
                 slurm: SlurmClient | None = None,
                 ckpt_step: Callable[[], int | None] = lambda: None,
                 ckpt_seen: Callable[[], int | None] | None = None,
                 free_port: Callable[[], int] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep,
                 probe_slurmd: SlurmdProbe = slurmd_answers,
                 end_watch: EndWatch | None = None,
                 beater: Beater | None = None) -> None:
        self.cfg, self.where, self.channel, self.node, self.ledger = cfg, where, channel, node, ledger
        self.probe_slurmd = probe_slurmd
        # The generation's end pushed by the store (None: poll the change counter every poll).
        self.end_watch = end_watch
        # This agent's alive thread: its failing beats tell a watching follower the store is gone.
        self.beater = beater
        # ranks that all exit 0 after a warning or SIGTERM: the run done, or left on the signal
        self.exit0_done = exit0_is_completion(cfg.supervisor.exit0_after_signal, cfg.job.command)
        self._node0_seen_at = float("-inf")  # a follower's last look at node 0's beat (watch)
        self._notice: tuple[int, FailureNotice] | None = None  # (generation, its failure) as watch read it
        self.run_dir = run_dir
        self.env = dict(env or {})
        self.slurm = slurm
        self._ckpt_step = ckpt_step
        self._free_port = free_port
        self.clock, self.sleep = clock, sleep
        sup = cfg.supervisor
        self.limits = Limits(sup.max_restarts, sup.max_restarts_without_progress)
        self.history = History()
        self.sm = StateMachine(self._on_transition)
        # Train slots -> node names. Spares are the allocation's nodes beyond the train nodes.
        self.node_map: list[str] = list(where.nodes[:train_nodes])
        self._rank_of = {name: nr for nr, name in enumerate(where.nodes)}  # O(1) lookups at N=2,048
        self.spares: list[str] = list(where.nodes[train_nodes:])
        self.beat_interval_s = beat_interval_s(len(where.nodes), sup.poll_interval_s)
        self.liveness = Liveness({nr: n for nr, n in enumerate(where.nodes) if nr != where.node_rank},
                                 beat_interval_s=self.beat_interval_s, floor_s=sup.node_timeout_s,
                                 first_beat_s=sup.startup_timeout_s,
                                 node_states=client_node_states(slurm) if slurm is not None else None,
                                 clock=clock)
        self._lost: dict[int, Lost] = {}  # node 0: agents found lost, with how
        self._store_trouble_since: float | None = None
        self.decisions: list[tuple[int, Decision]] = []  # what this agent applied, per generation
        self.gen = 0  # the generation under way (for an agent error's report)
        self._stopped_gen: int | None = None  # the last generation this agent posted "stopped" for
        self._failure_requeue = False  # node 0: the requeue it is about to make follows a failure
        # Straggler detection (health.straggler_*): windows posted and read once per beat interval.
        self.stragglers: StragglerDetector | None = None  # node 0, one per generation
        # ckpt_seen: the newest committed step without waiting (CheckpointProgress.peek).
        self.straggler_actions = StragglerActions(cfg.health.straggler_action, ledger,
                                                  committed=ckpt_seen or ckpt_step)
        self._windows_at = float("-inf")

    @property
    def is_node0(self) -> bool:
        return self.where.node_rank == 0

    def _on_transition(self, old: State, new: State, why: str) -> None:
        if self.is_node0:
            self.ledger.append("state", old=old.value, new=new.value, why=why)


    def _store_ok(self) -> None:
        if self._store_trouble_since is not None:
            log.warning("agents' store answers again after %.1f s", self.clock() - self._store_trouble_since)
        self._store_trouble_since = None

    def _store_failed(self, exc: BaseException) -> None:
        """A store error: retried on the next poll; fatal only after two liveness deadlines."""
        now = self.clock()
        if self._store_trouble_since is None:
            self._store_trouble_since = now
            log.warning("agents' store error (retrying): %s", exc)
        budget = 2 * liveness_deadline_s(self.beat_interval_s, self.cfg.supervisor.node_timeout_s)
        if now - self._store_trouble_since > budget:
            if self.is_node0:  # its own store: nothing to succeed to
                raise SlurmkitError(
                    f"Detected: this agent's own store has not answered for {now - self._store_trouble_since:.0f} s "
                    f"({exc}). Requirement: a working TCPStore on node 0. Fix: see this agent's log.") from exc
            raise Node0Lost(f"the agents' store on node 0 ({self.where.nodes[0]}) has not answered for "
                            f"{now - self._store_trouble_since:.0f} s ({exc})") from exc
