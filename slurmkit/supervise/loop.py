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

The supervisor is made of parts it holds, each given only what it uses (slurmkit.supervise.shared):
node 0's :class:`~slurmkit.supervise.deciding.Decider` (lost agents, the evidence, the decision,
the failure history; node 0's supervisor alone has one), the
:class:`~slurmkit.supervise.endings.Endings` (the ways out: requeue, successor job, preemption,
stop, node 0's loss, leaving together) and, shared by both, the requeue caps
(slurmkit.supervise.exits.caps). The loop itself, here, runs the generations: start, watch, wait
for the decision, apply it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import ClassVar

from slurmkit.config import SlurmkitConfig
from slurmkit.contract import EXIT_CHECKPOINTED_ON_SIGNAL
from slurmkit.failures.classes import FailureClass
from slurmkit.failures.classify import Evidence
from slurmkit.failures.programs import exit0_is_completion
from slurmkit.slurm.client import SlurmClient
from slurmkit.supervise.channel import COMPLETED, SIGNALLED, Channel, ChannelError, FailureNotice, Rejoin
from slurmkit.supervise.deciding import Decider
from slurmkit.supervise.endings import Endings
from slurmkit.supervise.endwatch import EndWatch
from slurmkit.supervise.exits.caps import RequeueCaps
from slurmkit.supervise.exits.previous import previous_attempt, record_previous
from slurmkit.supervise.exits.succession import clear_done
from slurmkit.supervise.exits.successor import PREDECESSOR_ATTEMPT_ENV, PREDECESSOR_ENV
from slurmkit.supervise.liveness import Beater, Liveness, Lost
from slurmkit.supervise.policy import Action, Decision, History, State, StateMachine
from slurmkit.supervise.relaunch import Relauncher
from slurmkit.supervise.shared import (EXIT_WAIT_S, FAILED, REQUEUE_MARKS, STACKS_BARRIER_S, HandedOn, Ledger,
                                       Node, Node0Lost, Outcome, Slots, StoreTrouble, Where)
from slurmkit.supervise.slurmview import SlurmdProbe, slurmd_answers
from slurmkit.supervise.stepsended import StepsEnded
from slurmkit.supervise.straggler_move import StragglerActions
from slurmkit.supervise.stragglers import StragglerDetector
from slurmkit.supervise.timeouts import beat_interval_s, liveness_deadline_s

log = logging.getLogger(__name__)

__all__ = ["EXIT_WAIT_S", "FAILED", "REQUEUE_MARKS", "STACKS_BARRIER_S", "Ledger", "Node", "Node0Lost",
           "Outcome", "Supervisor", "Where"]


class Supervisor:
    """One node agent's supervisor: runs generations until the run ends (its exit code)."""

    #: Node 0's decider (a subclass may record its steps: tools/bench/control_plane.py).
    decider_type: ClassVar[type[Decider]] = Decider
    # What the parts hold too: the agent's entry point and the tests replace some after construction.
    where: HandedOn[Where] = HandedOn()
    node: HandedOn[Node] = HandedOn()
    ledger: HandedOn[Ledger] = HandedOn()
    probe_slurmd: HandedOn[SlurmdProbe] = HandedOn()
    beat_interval_s: HandedOn[float] = HandedOn()
    sleep: HandedOn[Callable[[float], None]] = HandedOn()

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
        self._free_port = free_port
        self.clock, self.sleep = clock, sleep
        sup = cfg.supervisor
        self.sm = StateMachine(self._on_transition)
        self.slots = Slots(where.nodes, train_nodes)
        self.beat_interval_s = beat_interval_s(len(where.nodes), sup.poll_interval_s)
        self.decisions: list[tuple[int, Decision]] = []  # what this agent applied, per generation
        self.gen = 0  # the generation under way (for an agent error's report)
        self.first_generation = 0  # the one ``run`` starts with: 0, or the one a relaunched agent rejoins
        self._stopped_gen: int | None = None  # the last generation this agent posted "stopped" for
        # Straggler detection (health.straggler_*): windows posted and read once per beat interval.
        self.stragglers: StragglerDetector | None = None  # node 0, one per generation
        # ckpt_seen: the newest committed step without waiting (CheckpointProgress.peek).
        self.straggler_actions = StragglerActions(cfg.health.straggler_action, ledger,
                                                  committed=ckpt_seen or ckpt_step)
        self._windows_at = float("-inf")
        self._build_parts(ckpt_step)

    def _build_parts(self, ckpt_step: Callable[[], int | None]) -> None:
        """The parts, each given what it uses: the store-trouble budget, the requeue caps, node
        0's decider (node 0 only) and the exits."""
        cfg, where, slurm = self.cfg, self.where, self.slurm
        self.store_trouble = StoreTrouble(where, beat_interval_s=self.beat_interval_s,
                                          node_timeout_s=cfg.supervisor.node_timeout_s, clock=self.clock)
        caps = RequeueCaps(where, run_dir=self.run_dir, max_requeues=cfg.supervisor.max_requeues, env=self.env,
                           slurm=slurm)
        self.decider: Decider | None = None
        if where.node_rank == 0:
            self.decider = self.decider_type(
                cfg, where, self.channel, self.node, self.ledger, self.slots, caps, self.straggler_actions,
                slurm=slurm, run_dir=self.run_dir, ckpt_step=ckpt_step, probe_slurmd=self.probe_slurmd,
                beat_interval_s=self.beat_interval_s, clock=self.clock, sleep=self.sleep)
        self.exits = Endings(cfg, where, self.channel, self.node, self.ledger, self.sm, caps, slurm=slurm,
                             run_dir=self.run_dir, env=self.env, ckpt_step=ckpt_step,
                             probe_slurmd=self.probe_slurmd, beat_interval_s=self.beat_interval_s,
                             clock=self.clock, sleep=self.sleep)
        #: The parts a HandedOn attribute reaches when it is replaced.
        self.parts: tuple[object, ...] = tuple(p for p in (self.store_trouble, caps, self.decider, self.exits)
                                               if p is not None)

    # ------------------------------------------------------------------ node 0's, set by the agent and tests
    @property
    def relauncher(self) -> Relauncher | None:
        """Node 0 with Slurm: relaunches a lost agent on a healthy node (None elsewhere)."""
        return self.decider.relauncher if self.decider is not None else None

    @relauncher.setter
    def relauncher(self, relauncher: Relauncher | None) -> None:
        self._node0_decider().relauncher = relauncher

    @property
    def steps_ended(self) -> StepsEnded | None:
        """Node 0 in a batch script: the agents' srun steps it says ended (None elsewhere)."""
        return self.decider.steps_ended if self.decider is not None else None

    @steps_ended.setter
    def steps_ended(self, steps_ended: StepsEnded | None) -> None:
        self._node0_decider().steps_ended = steps_ended

    @property
    def history(self) -> History:
        """The failure history of this allocation (node 0's decider keeps it)."""
        return self.decider.history if self.decider is not None else History()

    @property
    def is_node0(self) -> bool:
        return self.where.node_rank == 0

    def _node0_decider(self) -> Decider:
        if self.decider is None:
            raise TypeError(f"node rank {self.where.node_rank} decides nothing: only node 0 has a decider")
        return self.decider

    def _on_transition(self, old: State, new: State, why: str) -> None:
        if self.is_node0:
            self.ledger.append("state", old=old.value, new=new.value, why=why)

    # ------------------------------------------------------------------ node 0's decider
    def lost_agents(self) -> list[Lost]:
        return self._node0_decider().lost_agents()

    def node0_decide(self, gen: int, participants: list[int]) -> Decision:
        return self._node0_decider().decision(gen, participants)

    def failure_requeues(self) -> int:
        """Earlier requeues of this run that a failure caused (this attempt's own not counted)."""
        return self.exits.caps.failure_requeues()

    # ------------------------------------------------------------------ main loop
    def run(self) -> int:
        self.channel.post_addr(self.where.node_rank, self.where.addr or self.where.master_addr)
        if self.is_node0:
            clear_done(self.run_dir, self.where.attempt)  # one left by an earlier run of this name
            self.channel.seed_beats(range(len(self.where.nodes)))
            self.channel.seed_step_windows(range(len(self.where.nodes)))
            # a requeued job: what ended the previous attempt, Slurm's own requeues included
            record_previous(self.ledger, previous_attempt(
                self.run_dir, self.where.job_id, self.where.restart_count, self.slurm,
                predecessor=self.env.get(PREDECESSOR_ATTEMPT_ENV, "")), time.time())
            self.ledger.append("allocation_start", job_id=self.where.job_id, attempt=self.where.attempt,
                               restart_count=self.where.restart_count, nodes=list(self.where.nodes),
                               train_nodes=self.slots.node_map, spares=self.slots.spares,
                               executor=self.where.executor,
                               **({"predecessor": self.env[PREDECESSOR_ENV]}
                                  if self.env.get(PREDECESSOR_ENV, "").isdigit() else {}))
        gen = self.first_generation  # 0, or the generation a relaunched agent rejoins
        while True:
            self.gen = gen
            try:
                code = self.run_generation(gen)
            except Node0Lost as exc:
                return self.exits.after_node0_loss(gen, str(exc))
            if code is not None:
                return self.finish(code)
            gen += 1

    def run_or_report(self) -> int:
        """``run``, and if this agent fails on an unexpected exception, ``agent_error``."""
        try:
            return self.run()
        except Exception as exc:  # noqa: BLE001 - the agent must never die silently
            return self.agent_error(exc)

    def finish(self, code: int) -> int:
        """Leave together (slurmkit.supervise.endings.Endings.finish): node 0 waits for every
        agent it has not found lost."""
        return self.exits.finish(code, self.decider.lost_count if self.decider is not None else 0)

    def agent_error(self, exc: BaseException) -> int:
        """This agent itself failed (slurmkit.supervise.endings.Endings.agent_error): its exit code.
        It owes node 0 its evidence unless it posted it already or runs no rank of the generation."""
        me = self.where.node_name
        return self.exits.agent_error(exc, self.gen, owes_evidence=self._stopped_gen != self.gen
                                      and me in self.slots.node_map)

    def run_generation(self, gen: int) -> int | None:
        """One generation; returns the agent's exit code, or None to run the next generation."""
        me = self.where.node_name
        slots = self.slots
        slot = slots.node_map.index(me) if me in slots.node_map else None
        participants = [slots.rank_of[n] for n in slots.node_map]  # not nodes.index: O(N^2) at 2,048
        if self.sm.state != State.STARTING:
            self.sm.to(State.STARTING, f"generation {gen}")
        h = self.cfg.health
        if self.is_node0 and h.straggler_action != "off":
            self.stragglers = StragglerDetector(threshold=h.straggler_threshold, windows=h.straggler_windows)
        if slot is not None:
            # The ranks' rendezvous follows slot 0: after a replacement it may be a spare's.
            slot0 = slots.rank_of[slots.node_map[0]]
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
            return self.exits.after_signal(gen)
        self.sm.to(State.STOPPING, f"generation {gen}")
        if slot is not None:
            # A hang: the ranks' stacks before they are killed (first: the channel keeps 64 items),
            # and no node kills its ranks before every node has its own ranks' stacks.
            stacks: list[Evidence] = []
            if self._failed_by(gen) == FailureClass.HANG:
                stacks = self.node.capture_stacks(gen)
                if not self.channel.stacks_taken(gen, len(slots.node_map), STACKS_BARRIER_S):
                    log.warning("not every node took its ranks' stacks within %.0f s", STACKS_BARRIER_S)
            self.channel.post_evidence(gen, self.where.node_rank, stacks + self.node.stop())
            self.channel.post_stopped(gen)
            self._stopped_gen = gen
        if self.is_node0:
            self.sm.to(State.DECIDING, f"generation {gen}")
            d = self.node0_decide(gen, participants)
            self.channel.post_decision(gen, d)
        return self.apply_decision(self.wait_decision(gen), gen)

    def apply_decision(self, d: Decision, gen: int) -> int | None:
        """Every node: a restart or a spare goes on to the next generation (None); a requeue or a
        stop ends this allocation (the exits): its exit code."""
        self.decisions.append((gen, d))
        if self.is_node0:
            self.ledger.append("decision", generation=gen, action=d.action.value, reason=d.reason,
                               exclude=list(d.exclude), **self.straggler_actions.decision_fields(gen))
        if d.action == Action.RESTART:
            self.sm.to(State.RESTARTING, d.reason)
            return None
        if d.action == Action.REPLACE_NODE:
            self.sm.to(State.REPLACING, d.reason)
            self.slots.replace(d.exclude)
            if self.is_node0:
                self.ledger.append("exclusion", nodes=list(d.exclude), how="spare", train_nodes=self.slots.node_map)
            return None
        return self.exits.leave_on(d, gen)

    def rejoin(self, r: Rejoin) -> None:
        """This agent was relaunched by node 0 (slurmkit.supervise.relaunch): it takes its old slot
        from generation ``r.generation`` on, with the slots and spares as node 0 has them now."""
        self.slots.node_map = [self.where.nodes[nr] for nr in r.slots]
        self.slots.spares = [self.where.nodes[nr] for nr in r.spares]
        self.first_generation = self.gen = r.generation
        log.warning("relaunched agent (relaunch %d) rejoins attempt %s at generation %d in slot %d",
                    r.relaunch, r.attempt, r.generation, r.slot)

    def _failed_by(self, gen: int) -> FailureClass | None:
        """The class of the failure that ended ``gen`` as posted: the notice the watch read (no
        second round trip), else one read, on the failure path."""
        notice = self._notice if self._notice is not None and self._notice[0] == gen else None
        if notice is not None:
            return notice[1].cls
        try:
            got = self.channel.failure(gen)
        except (ChannelError, RuntimeError) as exc:  # forged, or the store is failing: no stacks
            log.error("%s", exc)
            return None
        return got.cls if got is not None else None

    def wait_decision(self, gen: int) -> Decision:
        """Wait for node 0's decision as long as node 0 beats (a decision may take a while:
        slow agents are waited for). Each wait is one blocking store wait on the decision key,
        woken by node 0's post (so every follower holds it one round trip after it is posted,
        with no polling load on the store), bounded by node 0's liveness deadline so that node
        0's beat is looked at between waits (node 0 is lost only after two deadlines of silence,
        so a look per deadline finds it). Not one look per beat interval: while a decision is
        slow every follower's wait times out at once (each timeout an exception and a log line
        in torch), and at N=2,048 on a loaded machine those timeouts took the CPU the decision
        needed (the control-plane bench: a 30 s fan-out at load 360)."""
        node0 = Liveness({0: self.where.nodes[0]}, beat_interval_s=self.beat_interval_s,
                         floor_s=self.cfg.supervisor.node_timeout_s, first_beat_s=self.cfg.supervisor.node_timeout_s,
                         clock=self.clock)
        look_s = liveness_deadline_s(self.beat_interval_s, self.cfg.supervisor.node_timeout_s)
        while True:
            try:
                try:
                    d = self.channel.wait_decision(gen, look_s)
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
                self.store_trouble.ok()
            except (ChannelError, Node0Lost):
                raise
            except RuntimeError as exc:  # torch's DistStoreError/DistNetworkError: maybe transient
                self.store_trouble.failed(exc)
                self.sleep(self.beat_interval_s)

    def watch(self, gen: int, has_ranks: bool) -> Outcome:
        """Poll this node's ranks until the generation ends. The generation's shared state costs
        no store round trip per poll: the agent's EndWatch is woken by the store when a failure
        or the last finish is posted, and only then are the failure and the finish counts read.
        A follower reads node 0's beat once per beat interval (a store gone is found so);
        node 0 scans every agent's beat each poll (one multi_get). Without a working EndWatch
        the generation's change counter is polled instead (one round trip per poll)."""
        n_slots = len(self.slots.node_map)
        reported = False
        seen = 0  # the change counter when the failure and finish counts were last read
        done = sig = 0
        if self.end_watch is not None:
            self.end_watch.arm(gen)
        while True:
            trigger = self.node.poll(gen) if has_ranks else None
            codes = self.node.exit_codes() if has_ranks else []
            try:
                if trigger is not None:
                    self.channel.post_failure(gen, trigger.node, trigger.rank, trigger.cls)
                if self.decider is not None:  # node 0
                    self.decider.check_peers(gen)
                self.exchange_step_windows(gen, has_ranks)
                if not reported and codes and all(c is not None for c in codes):
                    kind = COMPLETED if all(c == 0 for c in codes) else (
                        SIGNALLED if all(c in (0, EXIT_CHECKPOINTED_ON_SIGNAL) for c in codes) else None)
                    if kind == COMPLETED and self.node.signal_kind is not None and not self.exit0_done:
                        kind = SIGNALLED  # exit 0 on the signal: left on it (supervisor.exit0_after_signal)
                    if kind is not None:
                        self.channel.post_finished(gen, kind, n_slots)
                        reported = True
                ended = self.end_watch.ended(gen) if self.end_watch is not None else None
                if ended is None:
                    changes = self.channel.changes(gen)
                    look = changes != seen
                else:
                    changes, look = seen, ended
                    if not self.is_node0:
                        self._watch_node0(gen)
                if look:
                    try:
                        notice = self.channel.failure(gen)
                    except ChannelError as exc:  # a forged value at the failure key: refused, deleted
                        log.error("%s", exc)
                        notice = None
                    if notice is not None:
                        self._notice = (gen, notice)  # what ended it, for the stop (_failed_by)
                        return Outcome(FAILED, gen)
                    done, sig = self.channel.finished(gen)
                    seen = changes
                self.store_trouble.ok()
            except ChannelError:
                raise
            except RuntimeError as exc:  # torch's DistStoreError/DistNetworkError: maybe transient
                self.store_trouble.failed(exc)
                self.sleep(self.cfg.supervisor.poll_interval_s)
                continue
            if done + sig >= n_slots:
                if has_ranks:
                    self.node.join_output()
                return Outcome(COMPLETED if sig == 0 else SIGNALLED, gen)
            if self.end_watch is not None and ended is False:
                self.end_watch.pause(gen, self.cfg.supervisor.poll_interval_s)  # cut short by the end
            else:
                self.sleep(self.cfg.supervisor.poll_interval_s)

    def _watch_node0(self, gen: int) -> None:
        """A follower whose EndWatch waits makes no other round trip per poll; what finds a store
        that is gone is its alive thread's beats, which reach the same store once per beat
        interval anyway: while they fail, their error goes to the store-trouble path (Node0Lost
        after two liveness deadlines of trouble), as the change counter's poll did, at no round
        trip of the main loop. Without that thread (``beater`` None) the main loop reads node
        0's beat counter once per beat interval instead. Node 0's beat value is not judged here:
        node 0 stalled while its store still answers (CPU starvation, a long pause) must not be
        taken for lost, which would requeue without a healthy node; it is judged while a
        follower waits for node 0's decision (wait_decision), where node 0 must act."""
        if self.beater is not None:
            failing = self.beater.failing
            if failing is not None:
                raise RuntimeError(f"this agent's beats fail: {failing}")
            return
        now = self.clock()
        if now - self._node0_seen_at < self.beat_interval_s:
            return
        self._node0_seen_at = now
        self.channel.beats([0])

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
        got = self.channel.step_windows(gen, [self.slots.rank_of[n] for n in self.slots.node_map])
        for x in self.stragglers.observe({w.node: w for w in got.values()}):
            self.straggler_actions.named(x, gen, threshold=self.stragglers.threshold, spares=len(self.slots.spares))
        move = self.straggler_actions.due(gen, spares=len(self.slots.spares))
        if move is not None:  # its checkpoint is committed: stop here, the decision moves it out
            self.channel.post_failure(gen, move.named.node, -1, FailureClass.STRAGGLER)
