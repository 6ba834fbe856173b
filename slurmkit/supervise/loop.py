"""The supervisor loop: drives the state machine over generations and applies decisions.

One :class:`Supervisor` runs in every node agent. Each generation it asks its node
(slurmkit.launch.agent.NodeAgent: start, watch, stop this node's ranks) to run, and talks to
the other agents only through the typed channel (slurmkit.supervise.channel). When a
generation fails every node stops its ranks and posts its evidence; node 0 classifies it,
calls the pure ``decide`` and posts the decision; every node applies it: restart, continue on a
spare, requeue without the bad nodes, or stop with exit code 93.

What it needs from outside is given to it (channel, node, ledger, Slurm client, clock), so the
whole loop runs in one process in the unit tests against a real in-process store and the fake
Slurm controller. Every Slurm call goes through the client it is given (None: no Slurm, local
mode, where a requeue becomes a stop).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from slurmkit import EXIT_NO_REQUEUE
from slurmkit.config import SlurmkitConfig
from slurmkit.errors import SlurmkitError
from slurmkit.launch.cancel_request import read_cancel_request
from slurmkit.slurm.client import SlurmClient
from slurmkit.slurm.errors import SlurmError
from slurmkit.store.config import run_identity
from slurmkit.slurm.hostlist import expand_hostlist
from slurmkit.supervise.channel import COMPLETED, SIGNALLED, Channel, ChannelError
from slurmkit.supervise.classes import FailureClass
from slurmkit.supervise.classify import Evidence, bad_nodes, root_cause
from slurmkit.supervise.monitor import EXIT_CHECKPOINTED_ON_SIGNAL
from slurmkit.supervise.policy import (Action, Decision, History, Limits, State, StateMachine, after_warning,
                                       decide, requeue_refusal)
from slurmkit.supervise.preemption import requeue_after_preemption
from slurmkit.supervise.previous import previous_attempt, record_previous
from slurmkit.supervise.requeue import job_ref, refused_by_slurm, requeue_now
from slurmkit.supervise.slurmview import (DECISION_RETRY, DECISION_TIMEOUT_S, SlurmdProbe, node_health,
                                          slurmd_answers)
from slurmkit.supervise.succession import (Claim, Done, Watched, clear_done, read_done, succeed,
                                           write_done)
from slurmkit.supervise.liveness import Liveness, Lost, client_node_states, slurm_says_dead
from slurmkit.supervise.straggler_move import StragglerActions
from slurmkit.supervise.stragglers import NodeWindow, StragglerDetector
from slurmkit.supervise.timeouts import beat_interval_s, liveness_deadline_s

log = logging.getLogger(__name__)

FAILED = "failed"
#: One empty marker file per requeue a failure caused (named by the attempt that requeued, so a
#: successor deciding again adds none): their count is what supervisor.max_requeues limits.
REQUEUE_MARKS = "requeues"
#: How long node 0 keeps its store up at the end for agents that have not seen the end yet.
#: One that comes later finds the store gone and node 0's done marker (succession.py).
EXIT_WAIT_S = 10.0
#: How long a node waits, on a hang, for every node to take its ranks' stacks before it kills its
#: own (each capture is bounded by a few seconds: slurmkit.launch.stackdump).
STACKS_BARRIER_S = 15.0
#: Classes that end the allocation, not the run: their requeues are the plan, not failures.
_PLANNED_REQUEUE = frozenset({FailureClass.TIME_LIMIT, FailureClass.PREEMPTION})


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


class Supervisor:
    def __init__(self, cfg: SlurmkitConfig, where: Where, channel: Channel, node: Node, ledger: Ledger, *,
                 train_nodes: int, run_dir: str, env: Mapping[str, str] | None = None,
                 slurm: SlurmClient | None = None,
                 ckpt_step: Callable[[], int | None] = lambda: None,
                 ckpt_seen: Callable[[], int | None] | None = None,
                 free_port: Callable[[], int] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep,
                 probe_slurmd: SlurmdProbe = slurmd_answers) -> None:
        self.cfg, self.where, self.channel, self.node, self.ledger = cfg, where, channel, node, ledger
        self.probe_slurmd = probe_slurmd
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

    # ------------------------------------------------------------------ main loop
    def run(self) -> int:
        self.channel.post_addr(self.where.node_rank, self.where.addr or self.where.master_addr)
        if self.is_node0:
            clear_done(self.run_dir, self.where.attempt)  # one left by an earlier run of this name
            self.channel.seed_beats(range(len(self.where.nodes)))
            self.channel.seed_step_windows(range(len(self.where.nodes)))
            # a requeued job: what ended the previous attempt, Slurm's own requeues included
            record_previous(self.ledger, previous_attempt(self.run_dir, self.where.job_id,
                                                          self.where.restart_count, self.slurm), time.time())
            self.ledger.append("allocation_start", job_id=self.where.job_id, attempt=self.where.attempt,
                               restart_count=self.where.restart_count, nodes=list(self.where.nodes),
                               train_nodes=self.node_map, spares=self.spares, executor=self.where.executor)
        gen = 0
        while True:
            self.gen = gen
            try:
                code = self.run_generation(gen)
            except Node0Lost as exc:
                return self.after_node0_loss(gen, str(exc))
            if code is not None:
                return self.finish(code)
            gen += 1

    def run_or_report(self) -> int:
        """``run``, and if this agent fails on an unexpected exception, ``agent_error``."""
        try:
            return self.run()
        except Exception as exc:  # noqa: BLE001 - the agent must never die silently
            return self.agent_error(exc)

    def run_generation(self, gen: int) -> int | None:
        """One generation; returns the agent's exit code, or None to run the next generation."""
        me = self.where.node_name
        slot = self.node_map.index(me) if me in self.node_map else None
        participants = [self._rank_of[n] for n in self.node_map]  # not nodes.index: O(N^2) at 2,048
        if self.sm.state != State.STARTING:
            self.sm.to(State.STARTING, f"generation {gen}")
        h = self.cfg.health
        if self.is_node0 and h.straggler_action != "off":
            self.stragglers = StragglerDetector(threshold=h.straggler_threshold, windows=h.straggler_windows)
        if slot is not None:
            # The ranks' rendezvous follows slot 0: after a replacement it may be a spare's.
            slot0 = self._rank_of[self.node_map[0]]
            if slot == 0:
                self.channel.post_port(gen, self._free_port() if self._free_port else 29500 + gen)
            port = self.channel.wait_port(gen, self.cfg.supervisor.startup_timeout_s)
            master = self.where.master_addr if slot0 == 0 else self.channel.addr(slot0)
            self.node.start(gen, slot, port, master)
        self.sm.to(State.RUNNING, f"generation {gen}")
        outcome = self.watch(gen, slot is not None)
        if outcome.kind == COMPLETED:
            self.sm.to(State.COMPLETED)
            if self.is_node0:
                self.ledger.append("end", status="completed", exit_code=0, generation=gen)
            return 0
        if outcome.kind == SIGNALLED:
            return self.after_signal(gen)
        self.sm.to(State.STOPPING, f"generation {gen}")
        if slot is not None:
            # A hang: the ranks' stacks before they are killed (first: the channel keeps 64 items),
            # and no node kills its ranks before every node has its own ranks' stacks.
            stacks: list[Evidence] = []
            if self._failed_by(gen) == FailureClass.HANG:
                stacks = self.node.capture_stacks(gen)
                if not self.channel.stacks_taken(gen, len(self.node_map), STACKS_BARRIER_S):
                    log.warning("not every node took its ranks' stacks within %.0f s", STACKS_BARRIER_S)
            self.channel.post_evidence(gen, self.where.node_rank, stacks + self.node.stop())
            self.channel.post_stopped(gen)
            self._stopped_gen = gen
        if self.is_node0:
            self.sm.to(State.DECIDING, f"generation {gen}")
            d = self.node0_decide(gen, participants)
            self.channel.post_decision(gen, d)
        return self.apply_decision(self.wait_decision(gen), gen)

    def _failed_by(self, gen: int) -> FailureClass | None:
        """The class of the failure that ended ``gen`` as posted (one read, on the failure path)."""
        try:
            notice = self.channel.failure(gen)
        except (ChannelError, RuntimeError) as exc:  # forged, or the store is failing: no stacks
            log.error("%s", exc)
            return None
        return notice.cls if notice is not None else None

    def wait_decision(self, gen: int) -> Decision:
        """Wait for node 0's decision as long as node 0 beats (a decision may take a while:
        slow agents are waited for). Each wait is one blocking store wait on the decision key,
        woken by node 0's post (so every follower holds it one round trip after it is posted,
        with no polling load on the store), bounded by one beat interval so that node 0's
        beat is looked at between waits."""
        node0 = Liveness({0: self.where.nodes[0]}, beat_interval_s=self.beat_interval_s,
                         floor_s=self.cfg.supervisor.node_timeout_s, first_beat_s=self.cfg.supervisor.node_timeout_s,
                         clock=self.clock)
        while True:
            try:
                try:
                    d = self.channel.wait_decision(gen, self.beat_interval_s)
                except ChannelError as exc:  # forged: deleted by the channel; node 0's still comes
                    log.error("%s", exc)
                    d = None
                    self.sleep(min(self.beat_interval_s, 0.05))  # a squatter rewriting it is not a hot loop
                if d is not None:
                    return d
                if not self.is_node0:
                    node0.observe(self.channel.beats([0]))
                    gone = node0.lost()
                    if gone:
                        raise Node0Lost(f"node 0 ({self.where.nodes[0]}) stopped beating for "
                                        f"{gone[0].silent_s:.0f} s while deciding about generation {gen}")
                self._store_ok()
            except (ChannelError, Node0Lost):
                raise
            except RuntimeError as exc:  # torch's DistStoreError/DistNetworkError: maybe transient
                self._store_failed(exc)
                self.sleep(self.beat_interval_s)

    def watch(self, gen: int, has_ranks: bool) -> Outcome:
        """Poll this node's ranks and the generation's shared state until it ends. One store
        round trip per poll in the steady state: the generation's change counter; the failure
        and the finish counts are read only after it moved (node 0 adds its liveness scan)."""
        n_slots = len(self.node_map)
        reported = False
        seen = 0  # the change counter when the failure and finish counts were last read
        done = sig = 0
        while True:
            trigger = self.node.poll(gen) if has_ranks else None
            codes = self.node.exit_codes() if has_ranks else []
            try:
                if trigger is not None:
                    self.channel.post_failure(gen, trigger.node, trigger.rank, trigger.cls)
                if self.is_node0:
                    self.check_peers(gen)
                self.exchange_step_windows(gen, has_ranks)
                if not reported and codes and all(c is not None for c in codes):
                    kind = COMPLETED if all(c == 0 for c in codes) else (
                        SIGNALLED if all(c in (0, EXIT_CHECKPOINTED_ON_SIGNAL) for c in codes) else None)
                    if kind is not None:
                        self.channel.post_finished(gen, kind)
                        reported = True
                changes = self.channel.changes(gen)
                if changes != seen:
                    try:
                        failed = self.channel.failure(gen) is not None
                    except ChannelError as exc:  # a forged value at the failure key: refused, deleted
                        log.error("%s", exc)
                        failed = False
                    if failed:
                        return Outcome(FAILED, gen)
                    done, sig = self.channel.finished(gen)
                    seen = changes
                self._store_ok()
            except ChannelError:
                raise
            except RuntimeError as exc:  # torch's DistStoreError/DistNetworkError: maybe transient
                self._store_failed(exc)
                self.sleep(self.cfg.supervisor.poll_interval_s)
                continue
            if done + sig >= n_slots:
                if has_ranks:
                    self.node.join_output()
                return Outcome(COMPLETED if sig == 0 else SIGNALLED, gen)
            self.sleep(self.cfg.supervisor.poll_interval_s)

    def exchange_step_windows(self, gen: int, has_ranks: bool) -> None:
        """Once per beat interval: post this node's newest step-time window (one set), and on
        node 0 read every train node's newest (one multi_get) and name the nodes that stay slow
        (slurmkit.supervise.stragglers): O(1) round trips per agent and interval at any N."""
        if self.cfg.health.straggler_action == "off" or self.clock() - self._windows_at < self.beat_interval_s:
            return
        self._windows_at = self.clock()
        w = self.node.step_window() if has_ranks else None
        if w is not None:
            self.channel.post_step_window(self.where.node_rank, w)
        if self.stragglers is None:
            return
        got = self.channel.step_windows(gen, [self._rank_of[n] for n in self.node_map])
        for x in self.stragglers.observe({w.node: w for w in got.values()}):
            self.straggler_actions.named(x, gen, threshold=self.stragglers.threshold, spares=len(self.spares))
        move = self.straggler_actions.due(gen, spares=len(self.spares))
        if move is not None:  # its checkpoint is committed: stop here, the decision moves it out
            self.channel.post_failure(gen, move.named.node, -1, FailureClass.STRAGGLER)

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

    # ------------------------------------------------------------------ liveness (node 0)
    def lost_agents(self) -> list[Lost]:
        """Agents (train nodes and spares) confirmed lost since the last call."""
        members = {*self.node_map, *self.spares}  # a set: this runs every poll, over N agents
        watched = [nr for nr, name in enumerate(self.where.nodes)
                   if nr != 0 and nr not in self._lost and name in members]
        self.liveness.observe(self.channel.beats(watched))
        new = [x for x in self.liveness.lost() if x.node_rank in watched]
        for x in new:
            self._lost[x.node_rank] = x
        return new

    def check_peers(self, gen: int) -> None:
        for x in self.lost_agents():
            name = self.where.nodes[x.node_rank]
            if name in self.spares:  # a lost spare ends nothing; it is no longer a spare
                self.spares.remove(name)
                self.ledger.append("spare_lost", node=name, why=x.why, silent_s=round(x.silent_s, 1))
                continue
            ev = Evidence(time.time(), name, -1, "agent", FailureClass.NODE_LOSS,
                          f"agent on {name} silent for {x.silent_s:.1f} s ({x.why})")
            self.channel.post_evidence(gen, x.node_rank, [ev])
            self.channel.post_failure(gen, name, -1, FailureClass.NODE_LOSS)

    # ------------------------------------------------------------------ deciding (node 0)
    def gather_evidence(self, gen: int, participants: list[int]) -> tuple[list[Evidence], list[str]]:
        """Wait for every participating agent's evidence, then read it all in one round trip.
        Each poll costs node 0 a fixed number of round trips whatever N: its liveness scan (one
        multi_get), the stopped counter, and once that counter says every live agent has
        stopped, one check of all evidence keys. A slow agent that still beats is waited for (up
        to a bound); one that stops beating is lost, confirmed as in watch (node 0 posts its
        evidence). Only past the bound are the missing keys looked up one by one."""
        bound = self.clock() + max(60.0, 4 * liveness_deadline_s(self.beat_interval_s,
                                                                 self.cfg.supervisor.node_timeout_s))
        me = self.where.node_rank
        others = [nr for nr in participants if nr != me]
        present = list(participants)
        while True:
            lost_here = sum(1 for nr in others if nr in self._lost)
            if (self.channel.stopped(gen) + lost_here >= len(participants)
                    and self.channel.has_all_evidence(gen, participants)):
                break
            if self.clock() >= bound:
                present = [nr for nr in participants if self.channel.has_evidence(gen, nr)]
                break
            self.check_peers(gen)
            self.sleep(min(self.cfg.supervisor.poll_interval_s, 0.05))
        got = self.channel.all_evidence(gen, present)
        evidence: list[Evidence] = []
        lost: list[str] = []
        for nr in participants:
            name = self.where.nodes[nr]
            ev = got.get(nr)
            if isinstance(ev, ChannelError):  # refused, not believed: the node counts as silent
                log.error("%s", ev)
                self.ledger.append("channel_refused", generation=gen, node=name, detail=str(ev))
                ev = None
            if ev is not None:
                evidence += ev
                if any(e.cls == FailureClass.NODE_LOSS for e in ev):
                    lost.append(name)
            else:
                lost.append(name)
                evidence.append(Evidence(time.time(), name, -1, "agent", FailureClass.NODE_LOSS,
                                         f"agent on {name} did not answer the stop request"))
        return evidence, sorted(set(lost))

    def node0_decide(self, gen: int, participants: list[int]) -> Decision:
        evidence, lost = self.gather_evidence(gen, participants)
        evidence += self.straggler_actions.evidence(gen)  # a straggler node 0 stopped it to move
        # What Slurm said about them came with the liveness confirmation: never asked again here.
        slurm_view = [Evidence(time.time(), self.where.nodes[nr], -1, "slurm", FailureClass.NODE_LOSS,
                               f"slurm: {self.where.nodes[nr]} state={x.slurm_state}")
                      for nr, x in self._lost.items() if x.slurm_state and self.where.nodes[nr] in lost]
        failure = root_cause(evidence + slurm_view)
        if failure is None:
            self.history = self.history.restarted()
            return Decision(Action.RESTART, "generation stopped without evidence")
        # After a warning or a SIGTERM the allocation is ending: a rank that died of it, or any
        # failure a restart could fix, is the allocation's end, not a crash (policy.after_warning).
        warned = self.node.signal_kind
        failure = after_warning(failure, warned)
        self.ledger.append("failure", generation=gen, cls=failure.cls.value, rank=failure.rank,
                           node=failure.node, evidence=failure.evidence, time_of_fault=failure.time,
                           ranks_affected=list(failure.ranks_affected),
                           slurm_view=[e.detail for e in slurm_view],
                           **({"stack": failure.stack, "in_collective": failure.in_collective}
                              if failure.stack else {}))
        self.straggler_actions.decided(gen, failure)
        spares = [n for n in self.spares if n not in lost]
        kept = self.agents_lost_on_healthy_nodes(gen, evidence, lost)
        can_requeue = (self.cfg.job.requeue and self.slurm is not None
                       and (warned is None or read_cancel_request(self.run_dir) is None))
        decision, self.history = decide(failure, self.history, self._ckpt_step(), self.limits, spares, lost,
                                        agent_lost=kept, warned=warned, can_requeue=can_requeue,
                                        bad_nodes=bad_nodes(evidence))
        if decision.action == Action.REQUEUE and self.slurm is None:
            decision = Decision(Action.STOP, decision.reason + "; no Slurm to requeue with (local mode)")
        if decision.action == Action.REQUEUE:
            planned = failure.cls in _PLANNED_REQUEUE
            refusal = self.requeue_refused(gen, decision.exclude, failure=not planned)
            if refusal is not None:
                return Decision(Action.STOP, f"{decision.reason}; requeue refused: {refusal}", decision.exclude)
            self._failure_requeue = not planned
        return decision

    def agents_lost_on_healthy_nodes(self, gen: int, evidence: list[Evidence], lost: list[str]) -> list[str]:
        """The lost nodes whose agent is gone while the node itself is fine. A SIGKILLed agent
        with slurmd alive is one: excluding its node would throw a healthy node away (seen in a
        chaos campaign). Fine means: Slurm does not call it dead (DOWN, DRAIN, NOT_RESPONDING,
        FAIL), asked again now, and either its slurmd answers (slurmctld calls a dead node
        MIXED until SlurmdTimeout, so its state alone would keep a dead node) or the agent
        reported its own error (agent_error). One bounded query for the lost nodes not already
        known dead, one probe per node: decisions are rare."""
        if not lost:
            return []
        seen = {self.where.nodes[nr]: x.slurm_state for nr, x in self._lost.items()}
        ask = [n for n in lost if not slurm_says_dead(seen.get(n) or "")]  # dead stays dead
        health = node_health(ask, self.slurm, self.probe_slurmd) if self.slurm is not None else {}
        reported = {e.node for e in evidence if e.kind == "agent_error"}
        kept = []
        for name in lost:
            state, answers = health.get(name, (seen.get(name), None))
            if state is not None and slurm_says_dead(state):
                continue
            if not answers and name not in reported:
                continue  # nothing says the node is fine: a lost node, as before
            why = (f"agent on {name} lost but the node is healthy"
                   + (f" (Slurm says {state})" if state is not None else "")
                   + (": its slurmd answers" if answers else "")
                   + (": the agent reported its own error" if name in reported else "")
                   + ": not excluded")
            self.ledger.append("node_kept", node=name, why=why, generation=gen, slurm_state=state)
            kept.append(name)
        return kept

    # ------------------------------------------------------------------ requeue caps (node 0)
    def failure_requeues(self) -> int:
        """Earlier requeues of this run that a failure caused (this attempt's own not counted)."""
        try:
            names = os.listdir(os.path.join(self.run_dir, REQUEUE_MARKS))
        except OSError:
            return 0
        mine = f"failure.{self.where.attempt}"
        return sum(1 for n in names if n.startswith("failure.") and n != mine)

    def _mark_failure_requeue(self) -> None:
        marks = os.path.join(self.run_dir, REQUEUE_MARKS)
        os.makedirs(marks, exist_ok=True)
        with open(os.path.join(marks, f"failure.{self.where.attempt}"), "a"):
            pass

    def requeue_refused(self, gen: int, exclude: tuple[str, ...], *, failure: bool) -> str | None:
        """Why this requeue must stop the run instead (Detected/Requirement/Fix), or None.

        A failure's requeue counts against supervisor.max_requeues; one that excludes nodes is
        checked against the partition, with one bounded query of the job (its partition and
        ExcNodeList) and of the partitions: decisions are rare. Slurm not answering checks
        nothing (the requeue goes ahead: a slow controller must not stop a run)."""
        max_requeues = self.cfg.supervisor.max_requeues
        done = self.failure_requeues() if failure else 0
        partition: str | None = None
        members: list[str] | None = None
        excluded = list(exclude)
        if exclude and self.slurm is not None and done < max_requeues:
            try:
                client = self.slurm.bounded(DECISION_RETRY, DECISION_TIMEOUT_S)
                info = client.job(job_ref(self.where.job_id, self.env))
                excluded = sorted({*info.excluded_nodes, *exclude})
                partition = info.partition
                for p in client.partitions():
                    if p.name == partition and p.nodes and p.nodes.upper() != "ALL":
                        members = expand_hostlist(p.nodes)
            except SlurmError as exc:
                log.warning("could not check the requeue against the partition: %s", exc)
        why = requeue_refusal(failure_requeues=done if failure else None, max_requeues=max_requeues,
                              excluded=excluded, partition=partition, partition_nodes=members,
                              needed=len(self.where.nodes))
        if why is not None:
            self.ledger.append("requeue_refused", reason=why, generation=gen, failure_requeues=done,
                               max_requeues=max_requeues, excluded=excluded, partition=partition,
                               partition_nodes=len(members) if members is not None else None,
                               needed=len(self.where.nodes))
        return why

    # ------------------------------------------------------------------ applying (every node)
    def apply_replacement(self, bad: tuple[str, ...]) -> None:
        for name in bad:
            if name in self.node_map:
                spare = self.spares.pop(0)
                self.node_map[self.node_map.index(name)] = spare
            if name in self.spares:
                self.spares.remove(name)

    def requeue(self, reason: str, exclude: tuple[str, ...]) -> int:
        """Node 0: requeue this job without the bad nodes and make it eligible at once. Returns
        the agent's exit code: 0, or 93 when Slurm refused the requeue (said, never a crash)."""
        self.ledger.append("requeue", job_id=self.where.job_id, reason=reason, exclude=list(exclude))
        if self._failure_requeue:
            self._mark_failure_requeue()
        if self.slurm is None:
            return 0
        try:
            requeue_now(self.slurm, self.where.job_id, exclude, env=self.env, run_dir=self.run_dir)
        except SlurmError as exc:
            run_id = run_identity(self.cfg.store, {**self.env, "SLURMKIT_RUN_DIR": self.run_dir})
            why = refused_by_slurm(self.where.job_id, exc, run_id)
            self.ledger.append("requeue_refused", reason=why, generation=self.gen)
            print(f"slurmkit supervisor: stopping, exit {EXIT_NO_REQUEUE} (not requeued): {why}",
                  file=sys.stderr, flush=True)
            self.ledger.append("end", status="stopped", exit_code=EXIT_NO_REQUEUE, reason=why)
            return EXIT_NO_REQUEUE
        return 0

    def apply_decision(self, d: Decision, gen: int) -> int | None:
        self.decisions.append((gen, d))
        if self.is_node0:
            self.ledger.append("decision", generation=gen, action=d.action.value, reason=d.reason,
                               exclude=list(d.exclude), **self.straggler_actions.decision_fields(gen))
        if d.action == Action.RESTART:
            self.sm.to(State.RESTARTING, d.reason)
            return None
        if d.action == Action.REPLACE_NODE:
            self.sm.to(State.REPLACING, d.reason)
            self.apply_replacement(d.exclude)
            if self.is_node0:
                self.ledger.append("exclusion", nodes=list(d.exclude), how="spare", train_nodes=self.node_map)
            return None
        if d.action == Action.REQUEUE:
            self.sm.to(State.REQUEUEING, d.reason)
            if self.is_node0:
                if d.exclude:
                    self.ledger.append("exclusion", nodes=list(d.exclude), how="requeue")
                return self.requeue(d.reason, d.exclude)
            return 0
        self.sm.to(State.STOPPED, d.reason)
        print(f"slurmkit supervisor: stopping, exit {EXIT_NO_REQUEUE} (do not requeue): {d.reason}",
              file=sys.stderr, flush=True)
        if self.is_node0:
            self.ledger.append("end", status="stopped", exit_code=EXIT_NO_REQUEUE, reason=d.reason)
        return EXIT_NO_REQUEUE

    def after_signal(self, gen: int) -> int:
        """Every rank saved a final checkpoint on the warning and left."""
        kind = self.node.signal_kind
        if read_cancel_request(self.run_dir) is not None:
            kind = self.node.signal_kind = "cancel"  # slurmkit cancel --checkpoint: end here, never requeue
        self.sm.to(State.CHECKPOINTING, kind or "signal")
        if self.is_node0:
            self.ledger.append("checkpointed_on_signal", generation=gen, signal=kind, step=self._ckpt_step())
        if kind == "time_limit" and self.cfg.job.requeue and self.slurm is not None:
            self.sm.to(State.REQUEUEING, "time limit")
            if self.is_node0:
                return self.requeue("time limit warning: final checkpoint saved", ())
            return 0
        if kind == "preemption" and self.is_node0 and self.cfg.job.requeue and self.slurm is not None:
            # a job that ends inside GraceTime is not requeued by Slurm: requeue it now
            why = requeue_after_preemption(self.slurm, self.where.job_id)
            if why is not None:
                self.sm.to(State.REQUEUEING, "preempted")
                return self.requeue(why, ())
        # scancel, an admin or PreemptMode=CANCEL: the SIGTERM ends the run. Local: nothing to requeue.
        self.sm.to(State.COMPLETED, "left on signal")
        if self.is_node0:
            cancelled = kind == "cancel"
            self.ledger.append("end", status="cancelled" if cancelled else "signalled", signal=kind, exit_code=0)
            if cancelled and self.slurm is not None:
                self.slurm.cancel(self.where.job_id)  # Slurm ends the job CANCELLED (no requeue)
        return 0

    def after_node0_loss(self, gen: int, why: str) -> int:
        """Node 0 (store, decider, batch host) is gone. Every surviving agent stops its ranks; the
        successor (node rank 1, or the next surviving one; another one if it dies in turn:
        slurmkit.supervise.succession) records the failure and requeues the job without node 0,
        so the job never sits RUNNING with nothing running (with --no-kill Slurm would keep it
        so, even with a spare: the batch script died with node 0). Without Slurm it stops.

        Node 0 that ended the attempt itself (completed, stopped, requeued) left its done marker
        before its store went: an agent that comes late to the end finds it and leaves with
        node 0's exit code, never requeueing a finished job. Exit code otherwise: 0 after a
        requeue (the requeue ends the job), 1 else."""
        self.node.stop()
        done = read_done(self.run_dir, self.where.attempt)
        if done is not None and done.node_rank == 0:
            log.warning("node 0's store is gone, but node 0 ended this attempt first (%s, exit %d): "
                        "not a loss", done.outcome, done.exit_code)
            return done.exit_code
        log.error("node 0 lost: %s", why)
        grace_s = liveness_deadline_s(self.beat_interval_s, self.cfg.supervisor.node_timeout_s)
        won = succeed(self.run_dir, self.where.attempt, self.where.node_rank, self.where.node_name,
                      len(self.where.nodes), grace_s=grace_s, stall_s=2 * grace_s, clock=self.clock,
                      sleep=self.sleep)
        if isinstance(won, Watched):
            print(f"slurmkit supervisor: {why}; {won.done.node} (node rank {won.done.node_rank}) succeeded "
                  f"node 0 and ended this attempt ({won.done.outcome})", file=sys.stderr, flush=True)
            return 1
        won.keep_fresh(min(max(grace_s / 4, 0.01), 1.0))
        try:
            return self._succeed_node0(gen, why, won)
        finally:
            won.release()

    def _succeed_node0(self, gen: int, why: str, claim: Claim) -> int:
        node0 = self.where.nodes[0]
        me = f"{self.where.node_name}, node rank {self.where.node_rank}"
        if claim.generation:
            why += f" (successor claim {claim.generation - 1} made no progress: taken over by {me})"
            if self._requeued_in_slurm():
                # The successor before this one requeued, then died before its marker.
                self._leave_done(State.REQUEUEING.value, 0)
                print(f"slurmkit supervisor: {why}; Slurm requeued the job already: nothing to do",
                      file=sys.stderr, flush=True)
                return 0
        if claim.superseded():
            return 1
        self.ledger.append("failure", generation=gen, cls=FailureClass.NODE_LOSS.value, rank=-1, node=node0,
                           evidence=f"{why} (recorded by {me})",
                           time_of_fault=time.time(), ranks_affected=[], slurm_view=[])
        if self.slurm is None:
            reason = f"node_loss of node 0 ({node0}): {why}; no Slurm to requeue with (local mode)"
            self.ledger.append("decision", generation=gen, action=Action.STOP.value, reason=reason, exclude=[node0])
            self.ledger.append("end", status="stopped", exit_code=1, reason=reason)
            self._leave_done(State.STOPPED.value, 1)
            return 1
        reason = f"node_loss of node 0 ({node0}): {why}; requeue without it"
        refusal = self.requeue_refused(gen, (node0,), failure=True)
        if refusal is not None:
            code = self.stop_unrequeued(gen, f"{reason}; requeue refused: {refusal}", [node0])
            self._leave_done(State.STOPPED.value, code)
            return code
        if claim.superseded():  # stalled in the Slurm queries: the one that took over requeues
            return 1
        self.ledger.append("decision", generation=gen, action=Action.REQUEUE.value, reason=reason, exclude=[node0])
        self.ledger.append("exclusion", nodes=[node0], how="requeue")
        self._failure_requeue = True
        code = self.requeue(reason, (node0,))
        self._leave_done(State.REQUEUEING.value if code == 0 else State.STOPPED.value, code)
        return code

    def _requeued_in_slurm(self) -> bool:
        """One bounded query: has Slurm requeued this job past this attempt (or is it pending)?
        Unknown (no Slurm, no answer): False, the successor acts."""
        if self.slurm is None:
            return False
        try:
            info = self.slurm.bounded(DECISION_RETRY, DECISION_TIMEOUT_S).job(job_ref(self.where.job_id, self.env))
        except SlurmError as exc:
            log.warning("could not ask Slurm whether the job was requeued: %s", exc)
            return False
        return info.restart_cnt > self.where.restart_count or info.state == "PENDING"

    def _leave_done(self, outcome: str, code: int) -> None:
        write_done(self.run_dir, self.where.attempt,
                   Done(outcome, code, self.where.node_name, self.where.node_rank))

    def stop_unrequeued(self, gen: int, reason: str, exclude: list[str]) -> int:
        """Outside the state machine (node 0 lost, or this agent failing): stop with exit 93,
        said in the ledger and in the job's log."""
        print(f"slurmkit supervisor: stopping, exit {EXIT_NO_REQUEUE} (do not requeue): {reason}",
              file=sys.stderr, flush=True)
        self.ledger.append("decision", generation=gen, action=Action.STOP.value, reason=reason, exclude=exclude)
        self.ledger.append("end", status="stopped", exit_code=EXIT_NO_REQUEUE, reason=reason)
        return EXIT_NO_REQUEUE

    # ------------------------------------------------------------------ this agent failing
    def agent_error(self, exc: BaseException) -> int:
        """This agent itself failed (an exception in slurmkit, not in a rank: a full disk under
        the run root, a store reply it could not read): its ranks are stopped, never orphaned,
        and it says so before leaving, so that node 0 decides at once instead of waiting for its
        beats to go silent, and keeps the node (agent_lost, not node_loss). Node 0's own agent
        holds the store: when it fails the followers would take that for node 0's loss and
        exclude a healthy node, so it requeues itself, keeping every node. Exit code: 0 after a
        requeue, 93 when a cap refused one, 1 else."""
        me, gen = self.where.node_name, self.gen
        detail = f"agent on {me} failed: {type(exc).__name__}: {exc}"[:500]
        log.error("%s", detail, exc_info=exc)
        print(f"slurmkit agent: {detail}", file=sys.stderr, flush=True)
        evidence: list[Evidence] = []
        try:
            evidence = self.node.stop()
        except Exception:  # noqa: BLE001 - the report below matters more than this error
            log.exception("stopping this node's ranks after the agent error")
        try:
            self.ledger.append("agent_error", node=me, error=detail, generation=gen,
                               node_rank=self.where.node_rank)
        except Exception:  # noqa: BLE001 - e.g. the disk that failed the agent: the channel still tells
            log.exception("ledger")
        if self.is_node0:
            return self._node0_agent_error(gen, detail)
        try:
            # A spare (or a retired node) runs no rank of this generation: its loss fails nothing
            # (node 0 finds it silent and drops it from the spares).
            if self._stopped_gen != gen and me in self.node_map:
                ev = Evidence(time.time(), me, -1, "agent_error", FailureClass.NODE_LOSS, detail)
                self.channel.post_evidence(gen, self.where.node_rank, [*evidence, ev])
                self.channel.post_failure(gen, me, -1, FailureClass.NODE_LOSS)
                self.channel.post_stopped(gen)
            self.channel.arrive_exit()
        except Exception:  # noqa: BLE001 - then node 0 finds this agent lost by its silence
            log.exception("could not tell node 0 about this agent's error")
        return 1

    def _node0_agent_error(self, gen: int, detail: str) -> int:
        reason = f"{detail}; node 0's agent (the agents' store) cannot go on: requeue keeping every node"
        if self.slurm is None:
            reason = f"{detail}; no Slurm to requeue with (local mode)"
            self.ledger.append("decision", generation=gen, action=Action.STOP.value, reason=reason, exclude=[])
            self.ledger.append("end", status="stopped", exit_code=1, reason=reason)
            self._leave_done(State.STOPPED.value, 1)
            return 1
        refusal = self.requeue_refused(gen, (), failure=True)
        if refusal is not None:
            code = self.stop_unrequeued(gen, f"{reason}; requeue refused: {refusal}", [])
            self._leave_done(State.STOPPED.value, code)
            return code
        self.ledger.append("node_kept", node=self.where.node_name, generation=gen,
                           why=f"node 0's own agent failed ({detail}): the node is not to blame: not excluded")
        self.ledger.append("decision", generation=gen, action=Action.REQUEUE.value, reason=reason, exclude=[])
        self._failure_requeue = True
        code = self.requeue(reason, ())
        self._leave_done(State.REQUEUEING.value if code == 0 else State.STOPPED.value, code)
        return code

    def finish(self, code: int) -> int:
        """Leave together: node 0 keeps the store alive until every agent has read what it needs,
        and leaves its done marker first, for an agent later than that."""
        if self.is_node0:
            self._leave_done(self.sm.state.value, code)
        try:
            n = self.channel.arrive_exit()
            if self.is_node0:
                # Every agent still alive, not only the train nodes: a spare or a retired node that
                # has not seen the end yet would take the closed store for node 0's loss and requeue.
                deadline = self.clock() + EXIT_WAIT_S
                while n < len(self.where.nodes) - len(self._lost) and self.clock() < deadline:
                    self.sleep(0.1)
                    n = self.channel.exited()
        except (RuntimeError, OSError):  # node 0 already gone: nothing left to sync
            pass
        return code

