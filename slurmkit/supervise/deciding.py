"""Node 0's decider: which agents are lost, the evidence, the decision and the failure history
(a part of slurmkit.supervise.loop.Supervisor, held only by node 0's).

The decision itself is the pure ``slurmkit.supervise.policy.decide``; the decider gathers what
it decides on (every agent's evidence, what Slurm said about the lost ones, whether a lost
agent's node is healthy), keeps the history it returns, relaunches a lost agent where that is
the better way (slurmkit.supervise.relaunch), and checks a requeue against the caps
(slurmkit.supervise.exits.caps) before it says so.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace

from slurmkit.config import SlurmkitConfig
from slurmkit.failures.classes import FailureClass
from slurmkit.failures.classify import Evidence, Failure, bad_nodes, root_cause
from slurmkit.slurm.client import SlurmClient
from slurmkit.supervise.cancel_request import read_cancel_request
from slurmkit.supervise.channel import Channel, ChannelError
from slurmkit.supervise.exits.caps import RequeueCaps
from slurmkit.supervise.liveness import Liveness, Lost, client_node_states, slurm_says_dead
from slurmkit.supervise.policy import Action, Decision, History, Limits, after_warning, decide
from slurmkit.supervise.relaunch import Relauncher
from slurmkit.supervise.shared import PLANNED_REQUEUE, Ledger, Node, Slots, Where
from slurmkit.supervise.slurmview import SlurmdProbe, node_health
from slurmkit.supervise.stepsended import StepsEnded
from slurmkit.supervise.straggler_move import StragglerActions
from slurmkit.supervise.timeouts import liveness_deadline_s

log = logging.getLogger(__name__)


class Decider:
    """Node 0: lost agents, the evidence, the decision; owns the failure history and liveness.

    ``slots`` is the loop's own (a lost spare leaves it here); ``node``, ``ledger`` and
    ``probe_slurmd`` are the supervisor's, handed on again when the supervisor's are replaced."""

    def __init__(self, cfg: SlurmkitConfig, where: Where, channel: Channel, node: Node, ledger: Ledger,
                 slots: Slots, caps: RequeueCaps, straggler_actions: StragglerActions, *,
                 slurm: SlurmClient | None, run_dir: str, ckpt_step: Callable[[], int | None],
                 probe_slurmd: SlurmdProbe, beat_interval_s: float, clock: Callable[[], float],
                 sleep: Callable[[float], None]) -> None:
        self.cfg, self.where, self.channel, self.node, self.ledger = cfg, where, channel, node, ledger
        self.slots, self.caps, self.straggler_actions = slots, caps, straggler_actions
        self.slurm, self.run_dir, self._ckpt_step, self.probe_slurmd = slurm, run_dir, ckpt_step, probe_slurmd
        self.beat_interval_s, self.clock, self.sleep = beat_interval_s, clock, sleep
        sup = cfg.supervisor
        self.limits = Limits(sup.max_restarts, sup.max_restarts_without_progress)
        self.history = History()
        self.liveness = Liveness({nr: n for nr, n in enumerate(where.nodes) if nr != where.node_rank},
                                 beat_interval_s=beat_interval_s, floor_s=sup.node_timeout_s,
                                 first_beat_s=sup.startup_timeout_s,
                                 node_states=client_node_states(slurm) if slurm is not None else None,
                                 clock=clock)
        self._lost: dict[int, Lost] = {}  # agents found lost, with how
        #: Relaunches a lost agent on a healthy node (Slurm; set by the agent's entry point).
        self.relauncher: Relauncher | None = None
        #: In a batch script: the agents' srun steps it says ended (set by the agent's entry point).
        self.steps_ended: StepsEnded | None = None

    @property
    def lost_count(self) -> int:
        """How many agents were found lost (not waited for at the end)."""
        return len(self._lost)

    # ------------------------------------------------------------------ liveness (node 0)
    def lost_agents(self) -> list[Lost]:
        """Agents (train nodes and spares) confirmed lost since the last call: silent (liveness),
        or in an srun step the batch script says ended with a non-zero code (stepsended)."""
        members = {*self.slots.node_map, *self.slots.spares}  # a set: runs every poll, over N agents
        watched = [nr for nr, name in enumerate(self.where.nodes)
                   if nr != 0 and nr not in self._lost and name in members]
        self.liveness.observe(self.channel.beats(watched))
        watching = set(watched)
        new = [x for x in self.liveness.lost() if x.node_rank in watching]
        for step in self.steps_ended.new() if self.steps_ended is not None else []:
            for nr in step.node_ranks:
                # a node whose agent node 0 relaunched runs in a step of node 0's, not this one
                if nr in watching and all(x.node_rank != nr for x in new) and not self._relaunched(nr):
                    new.append(Lost(nr, 0.0, f"its srun step (node ranks {step.first}-{step.first + step.count - 1}) "
                                    f"ended with code {step.code}", self.liveness.slurm_state(nr)))
        for x in new:
            self._lost[x.node_rank] = x
        return new

    def _relaunched(self, nr: int) -> bool:
        return self.relauncher is not None and self.relauncher.used(self.where.nodes[nr]) > 0

    def check_peers(self, gen: int) -> None:
        for x in self.lost_agents():
            name = self.where.nodes[x.node_rank]
            if name in self.slots.spares:  # a lost spare ends nothing; it is no longer a spare
                self.slots.spares.remove(name)
                self.ledger.append("spare_lost", node=name, why=x.why, silent_s=round(x.silent_s, 1))
                continue
            said = (f"silent for {x.silent_s:.1f} s ({x.why})" if x.silent_s > 0
                    else f"gone: {x.why}")  # the batch script's word (stepsended), no silence waited for
            ev = Evidence(time.time(), name, -1, "agent", FailureClass.NODE_LOSS, f"agent on {name} {said}")
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

    def decision(self, gen: int, participants: list[int]) -> Decision:
        """The decision on generation ``gen`` (``participants``: the node ranks of its slots)."""
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
                              if failure.stack else {}),
                           # the failing rank's last word (a crash's message), for status and the summary
                           **({"line": failure.line} if failure.line else {}))
        self.straggler_actions.decided(gen, failure)
        spares = [n for n in self.slots.spares if n not in lost]
        kept = self.agents_lost_on_healthy_nodes(gen, evidence, lost)
        can_requeue = (self.cfg.job.requeue and self.slurm is not None
                       and (warned is None or read_cancel_request(self.run_dir) is None))
        relaunched = self.relaunch_kept(gen, failure, evidence, lost, kept, spares)
        if relaunched is not None:
            return relaunched
        decision, self.history = decide(failure, self.history, self._ckpt_step(), self.limits, spares, lost,
                                        agent_lost=kept, warned=warned, can_requeue=can_requeue,
                                        bad_nodes=bad_nodes(evidence))
        if decision.action == Action.REQUEUE and self.slurm is None:
            decision = Decision(Action.STOP, decision.reason + "; no Slurm to requeue with (local mode)")
        if decision.action == Action.REQUEUE:
            planned = failure.cls in PLANNED_REQUEUE
            refusal = self.caps.refused(self.ledger, gen, decision.exclude, failure=not planned)
            if refusal is not None:
                return Decision(Action.STOP, f"{decision.reason}; requeue refused: {refusal}", decision.exclude)
            self.caps.failure_pending = not planned
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

    # ------------------------------------------------------------------ relaunching (node 0)
    def relaunch_kept(self, gen: int, failure: Failure, evidence: list[Evidence], lost: list[str],
                      kept: list[str], spares: list[str]) -> Decision | None:
        """A restart with the lost agents relaunched in their slots (slurmkit.supervise.relaunch),
        or None to decide as before (a spare, else a requeue keeping the node). Only when the
        root cause is the lost agents themselves (node_loss), no node is proven bad, the
        allocation is not ending, restarts are left, and each node's relaunch cap
        (supervisor.agent_relaunches) is not used up; and only once every new agent has beaten
        (a failed relaunch is said in the ledger, then decided as before).

        Lost nodes that are not kept (dead) come with the kept ones when they shared an srun
        step (launch.nodes_per_step > 1: a lost node ends its whole step, and Slurm kills the
        agents of the others). Spares then take the dead nodes' slots in the same decision and
        the kept nodes' agents are relaunched into the slots as they are after it; without a
        spare for each dead node (a requeue) nothing is relaunched."""
        r, rank_of = self.relauncher, self.slots.rank_of
        if (r is None or not kept or failure.cls != FailureClass.NODE_LOSS
                or bad_nodes(evidence) or self.node.signal_kind is not None
                or self.history.restarts >= self.limits.max_restarts
                or any(n not in self.slots.node_map for n in lost)):
            return None
        dead = [n for n in lost if n not in kept]
        moved: Decision | None = None
        after = self.history
        node_map, spares_after = list(self.slots.node_map), list(spares)
        if dead:
            if failure.node not in dead:  # the step's dead node is what failed, not its kept peers
                failure = replace(failure, node=dead[0])
            moved, after = decide(failure, self.history, self._ckpt_step(), self.limits, spares, dead,
                                  bad_nodes=bad_nodes(evidence))
            if moved.action != Action.REPLACE_NODE:
                return None
            for name in moved.exclude:  # as Slots.replace will do it
                if name in node_map:
                    node_map[node_map.index(name)] = spares_after.pop(0)
        used = [n for n in kept if r.left(n) == 0]
        for name in used:
            self.ledger.append("agent_relaunch_failed", node=name, node_rank=rank_of[name], generation=gen + 1,
                               why=f"supervisor.agent_relaunches={r.limit}: its relaunches in this allocation are "
                                   "used up")
        if used:
            return None
        result = r.relaunch(self.channel, self.where.attempt, gen + 1, [rank_of[n] for n in node_map],
                            [rank_of[n] for n in spares_after], [(n, rank_of[n]) for n in kept])
        if not result.ok:
            log.warning("relaunch of the agent on %s failed: %s", ",".join(kept), result.why)
            for name in kept:
                self.ledger.append("agent_relaunch_failed", node=name, node_rank=rank_of[name],
                                   generation=gen + 1, relaunch=r.used(name),
                                   why=f"{result.why}: a spare takes its slot, else the job requeues keeping it")
            return None
        for x in result.started:
            self.liveness.forget(x.node_rank)  # the new agent is judged by its own beats
            self._lost.pop(x.node_rank, None)
            self.ledger.append("agent_relaunched", node=x.node, node_rank=x.node_rank, generation=gen + 1,
                               relaunch=x.relaunch, slot=node_map.index(x.node),
                               first_beat_s=round(x.first_beat_s, 2), command=list(x.step.command), log=x.step.log)
        names = ",".join(sorted(kept))
        if moved is not None:  # the dead nodes' slots go to spares (the decision's history)
            self.history = after
            return Decision(Action.REPLACE_NODE, f"{moved.reason}; the agents of its srun step's healthy "
                            f"nodes relaunched on {names} (nodes kept)", moved.exclude)
        # The node's agent, not the program, failed: a restart, but not one more toward the crash loop.
        self.history = self.history.restarted()
        where = failure.where()
        return Decision(Action.RESTART, f"{where}; agent relaunched on {names} (node kept): "
                        f"restart {self.history.restarts} in the allocation")
