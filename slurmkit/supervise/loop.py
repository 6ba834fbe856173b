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

The class is built in parts, one file each: its state (slurmkit.supervise.loopbase), node 0's
decision (slurmkit.supervise.deciding), how a decision or an end is carried out
(slurmkit.supervise.endings) and, here, the generations themselves.
"""

from __future__ import annotations

import logging
import time

from slurmkit.supervise.channel import COMPLETED, SIGNALLED, ChannelError
from slurmkit.failures.classes import FailureClass
from slurmkit.failures.classify import Evidence
from slurmkit.contract import EXIT_CHECKPOINTED_ON_SIGNAL
from slurmkit.supervise.policy import Decision, State
from slurmkit.supervise.previous import previous_attempt, record_previous
from slurmkit.supervise.succession import clear_done
from slurmkit.supervise.successor import PREDECESSOR_ATTEMPT_ENV, PREDECESSOR_ENV
from slurmkit.supervise.liveness import Liveness
from slurmkit.supervise.endings import Endings
from slurmkit.supervise.loopbase import (EXIT_WAIT_S, FAILED, REQUEUE_MARKS, STACKS_BARRIER_S, Ledger, Node,
                                         Node0Lost, Outcome, Where)
from slurmkit.supervise.stragglers import StragglerDetector
from slurmkit.supervise.timeouts import liveness_deadline_s

log = logging.getLogger(__name__)

__all__ = ["EXIT_WAIT_S", "FAILED", "REQUEUE_MARKS", "STACKS_BARRIER_S", "Ledger", "Node", "Node0Lost",
           "Outcome", "Supervisor", "Where"]


class Supervisor(Endings):
    """One node agent's supervisor: runs generations until the run ends (its exit code)."""

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
                               train_nodes=self.node_map, spares=self.spares, executor=self.where.executor,
                               **({"predecessor": self.env[PREDECESSOR_ENV]}
                                  if self.env.get(PREDECESSOR_ENV, "").isdigit() else {}))
        gen = self.first_generation  # 0, or the generation a relaunched agent rejoins
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
                self._store_ok()
            except (ChannelError, Node0Lost):
                raise
            except RuntimeError as exc:  # torch's DistStoreError/DistNetworkError: maybe transient
                self._store_failed(exc)
                self.sleep(self.beat_interval_s)

    def watch(self, gen: int, has_ranks: bool) -> Outcome:
        """Poll this node's ranks until the generation ends. The generation's shared state costs
        no store round trip per poll: the agent's EndWatch is woken by the store when a failure
        or the last finish is posted, and only then are the failure and the finish counts read.
        A follower reads node 0's beat once per beat interval (a store gone is found so);
        node 0 scans every agent's beat each poll (one multi_get). Without a working EndWatch
        the generation's change counter is polled instead (one round trip per poll)."""
        n_slots = len(self.node_map)
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
                if self.is_node0:
                    self.check_peers(gen)
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
        got = self.channel.step_windows(gen, [self._rank_of[n] for n in self.node_map])
        for x in self.stragglers.observe({w.node: w for w in got.values()}):
            self.straggler_actions.named(x, gen, threshold=self.stragglers.threshold, spares=len(self.spares))
        move = self.straggler_actions.due(gen, spares=len(self.spares))
        if move is not None:  # its checkpoint is committed: stop here, the decision moves it out
            self.channel.post_failure(gen, move.named.node, -1, FailureClass.STRAGGLER)
