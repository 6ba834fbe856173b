"""The ways out of an allocation, on every node (a part of slurmkit.supervise.loop.Supervisor):
a decision that ends it carried out (a requeue in place or as a successor job, a stop), the end
after a signal (a time limit's or a preemption's requeue, a cancel), node 0's loss and its
successor, this agent's own failure, and leaving together. Every Slurm call goes through the
client it is given; the Slurm side of each way out is in slurmkit.supervise.exits."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Mapping

from slurmkit import EXIT_NO_REQUEUE
from slurmkit.config import SlurmkitConfig
from slurmkit.failures.classes import FailureClass
from slurmkit.failures.classify import Evidence
from slurmkit.slurm.capabilities import read_run_dir_copy
from slurmkit.slurm.client import SlurmClient
from slurmkit.slurm.errors import SlurmError
from slurmkit.store.config import run_identity
from slurmkit.supervise.cancel_request import read_cancel_request
from slurmkit.supervise.channel import Channel
from slurmkit.supervise.exits.caps import RequeueCaps
from slurmkit.supervise.exits.preemption import requeue_after_preemption
from slurmkit.supervise.exits.requeue import job_ref, refused_by_slurm, requeue_now, requeued_already
from slurmkit.supervise.exits.succession import Claim, Done, Watched, read_done, succeed, write_done
from slurmkit.supervise.exits.successor import SuccessorUnavailable, submit_successor
from slurmkit.supervise.liveness import slurm_says_dead
from slurmkit.supervise.policy import Action, Decision, State, StateMachine
from slurmkit.supervise.shared import EXIT_WAIT_S, Ledger, Node, Where
from slurmkit.supervise.slurmview import DECISION_RETRY, DECISION_TIMEOUT_S, SlurmdProbe, node_health
from slurmkit.supervise.timeouts import liveness_deadline_s

log = logging.getLogger(__name__)


class Endings:
    """Every node's ways out; node 0's, or its successor's, go through Slurm.

    ``sm`` is the loop's state machine (an end is a transition too) and ``caps`` the requeue
    caps node 0's decider shares; ``node``, ``ledger`` and ``probe_slurmd`` are the
    supervisor's, handed on again when the supervisor's are replaced."""

    def __init__(self, cfg: SlurmkitConfig, where: Where, channel: Channel, node: Node, ledger: Ledger,
                 sm: StateMachine, caps: RequeueCaps, *, slurm: SlurmClient | None, run_dir: str,
                 env: Mapping[str, str], ckpt_step: Callable[[], int | None], probe_slurmd: SlurmdProbe,
                 beat_interval_s: float, clock: Callable[[], float], sleep: Callable[[float], None]) -> None:
        self.cfg, self.where, self.channel, self.node, self.ledger = cfg, where, channel, node, ledger
        self.sm, self.caps, self.slurm, self.run_dir, self.env = sm, caps, slurm, run_dir, env
        self._ckpt_step, self.probe_slurmd = ckpt_step, probe_slurmd
        self.beat_interval_s, self.clock, self.sleep = beat_interval_s, clock, sleep
        #: The successor job this agent handed the run to (slurmkit.supervise.exits.successor), if any.
        self.handed_to: str | None = None

    @property
    def is_node0(self) -> bool:
        return self.where.node_rank == 0

    # ------------------------------------------------------------------ requeueing (node 0, or its successor)
    def requeue(self, gen: int, reason: str, exclude: tuple[str, ...]) -> int:
        """Node 0: requeue this job without the bad nodes and make it eligible at once. Returns
        the agent's exit code: 0, or 93 when Slurm refused the requeue (said, never a crash)."""
        self.ledger.append("requeue", job_id=self.where.job_id, reason=reason, exclude=list(exclude))
        self.caps.mark_if_failure()
        if self.slurm is None:
            return 0
        if self._as_successor(exclude):
            try:
                if not requeued_already(self.slurm, self.where.job_id, self.env):
                    new = submit_successor(self.slurm, self.where.job_id, exclude, env=self.env,
                                           run_dir=self.run_dir, attempt=self.where.attempt)
                    self.ledger.append("successor", job_id=new, predecessor=self.where.job_id,
                                       exclude=list(exclude), reason=reason)
                    self.handed_to = new
                    print(f"slurmkit supervisor: job {self.where.job_id} hands the run over to job {new}"
                          + (f" (excluding {','.join(exclude)})" if exclude else ""), file=sys.stderr, flush=True)
                    return 0
            except SuccessorUnavailable as exc:
                self.ledger.append("successor_refused", reason=str(exc), fallback="in_place",
                                   generation=gen)
                print(f"slurmkit supervisor: no successor job ({exc}): requeueing in place instead",
                      file=sys.stderr, flush=True)
        try:
            requeue_now(self.slurm, self.where.job_id, exclude, env=self.env, run_dir=self.run_dir)
        except SlurmError as exc:
            run_id = run_identity(self.cfg.store, {**self.env, "SLURMKIT_RUN_DIR": self.run_dir})
            why = refused_by_slurm(self.where.job_id, exc, run_id)
            self.ledger.append("requeue_refused", reason=why, generation=gen)
            print(f"slurmkit supervisor: stopping, exit {EXIT_NO_REQUEUE} (not requeued): {why}",
                  file=sys.stderr, flush=True)
            self.ledger.append("end", status="stopped", exit_code=EXIT_NO_REQUEUE, reason=why)
            return EXIT_NO_REQUEUE
        return 0

    def _as_successor(self, exclude: tuple[str, ...]) -> bool:
        """supervisor.requeue_as: auto takes a successor job where an in-place requeue would need
        a helper outliving the job (nodes to exclude), or where cgroups would kill its release
        helper (read from the run directory's capabilities.json: the failure path only)."""
        mode = self.cfg.supervisor.requeue_as
        if mode != "auto":
            return mode == "successor"
        if exclude:
            return True
        caps = read_run_dir_copy(self.run_dir)
        return caps is not None and caps.proctrack == "cgroup"

    def leave_on(self, d: Decision, gen: int) -> int:
        """A decision that ends this allocation (a requeue or a stop) carried out: the exit code."""
        if d.action == Action.REQUEUE:
            self.sm.to(State.REQUEUEING, d.reason)
            if self.is_node0:
                if d.exclude:
                    self.ledger.append("exclusion", nodes=list(d.exclude), how="requeue")
                return self.requeue(gen, d.reason, d.exclude)
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
                return self.requeue(gen, "time limit warning: final checkpoint saved", ())
            return 0
        if kind == "preemption" and self.is_node0 and self.cfg.job.requeue and self.slurm is not None:
            # a job that ends inside GraceTime is not requeued by Slurm: requeue it now
            why = requeue_after_preemption(self.slurm, self.where.job_id)
            if why is not None:
                self.sm.to(State.REQUEUEING, "preempted")
                return self.requeue(gen, why, ())
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
        slurmkit.supervise.exits.succession) records the failure and requeues the job without node 0,
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
        exclude = [] if self._node0_healthy(gen, node0) else [node0]
        reason = f"node_loss of node 0 ({node0}): {why}; " + (
            "requeue without it" if exclude else "requeue keeping it (its agent died, the node is healthy)")
        refusal = self.caps.refused(self.ledger, gen, tuple(exclude), failure=True)
        if refusal is not None:
            code = self.stop_unrequeued(gen, f"{reason}; requeue refused: {refusal}", exclude)
            self._leave_done(State.STOPPED.value, code)
            return code
        if claim.superseded():  # stalled in the Slurm queries: the one that took over requeues
            return 1
        self.ledger.append("decision", generation=gen, action=Action.REQUEUE.value, reason=reason, exclude=exclude)
        if exclude:
            self.ledger.append("exclusion", nodes=exclude, how="requeue")
        self.caps.failure_pending = True
        code = self.requeue(gen, reason, tuple(exclude))
        self._leave_done(State.REQUEUEING.value if code == 0 else State.STOPPED.value, code)
        if self.handed_to is not None:
            self._end_for_successor()
        return code

    def _end_for_successor(self) -> None:
        """The run went to a successor job that waits for this one to end, but node 0 (the batch
        script) died: without --no-kill Slurm ends this job only after SlurmdTimeout, with it
        never (it stays RUNNING without its batch host until the time limit). So this job is
        cancelled now; its own agents, this one included, end with it. Everything this agent
        had to say is in the ledger (``successor`` is written at once) and the done marker."""
        assert self.slurm is not None  # noqa: S101 - a successor job needs Slurm
        try:
            self.slurm.cancel(job_ref(self.where.job_id, self.env))
        except SlurmError as exc:
            log.warning("could not cancel job %s after handing the run to job %s: %s", self.where.job_id,
                        self.handed_to, exc)

    def _node0_healthy(self, gen: int, node0: str) -> bool:
        """Whether node 0 lost only its agent (SIGKILLed, OOM-killed) while the node is fine:
        Slurm does not call it dead and its slurmd answers (one bounded query, one probe).
        Excluding it would throw a healthy node away (seen in a chaos campaign: node 0's agent
        SIGKILLed, the requeue without it). Its ranks died with the agent (slurmkit.launch.tether)."""
        if self.slurm is None:
            return False
        state, answers = node_health([node0], self.slurm, self.probe_slurmd).get(node0, (None, None))
        if state is None or slurm_says_dead(state) or not answers:
            return False
        self.ledger.append("node_kept", node=node0, generation=gen, slurm_state=state,
                           why=f"node 0's agent on {node0} lost but the node is healthy (Slurm says {state}): "
                               "its slurmd answers: not excluded")
        return True

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
    def agent_error(self, exc: BaseException, gen: int, *, owes_evidence: bool) -> int:
        """This agent itself failed (an exception in slurmkit, not in a rank: a full disk under
        the run root, a store reply it could not read): its ranks are stopped, never orphaned,
        and it says so before leaving, so that node 0 decides at once instead of waiting for its
        beats to go silent, and keeps the node (agent_lost, not node_loss). Node 0's own agent
        holds the store: when it fails the followers would take that for node 0's loss and
        exclude a healthy node, so it requeues itself, keeping every node. Exit code: 0 after a
        requeue, 93 when a cap refused one, 1 else."""
        me = self.where.node_name
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
            # Not owed by a spare (or a retired node), which runs no rank of this generation: its
            # loss fails nothing (node 0 finds it silent and drops it from the spares); nor by an
            # agent that posted its evidence for this generation already.
            if owes_evidence:
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
        refusal = self.caps.refused(self.ledger, gen, (), failure=True)
        if refusal is not None:
            code = self.stop_unrequeued(gen, f"{reason}; requeue refused: {refusal}", [])
            self._leave_done(State.STOPPED.value, code)
            return code
        self.ledger.append("node_kept", node=self.where.node_name, generation=gen,
                           why=f"node 0's own agent failed ({detail}): the node is not to blame: not excluded")
        self.ledger.append("decision", generation=gen, action=Action.REQUEUE.value, reason=reason, exclude=[])
        self.caps.failure_pending = True
        code = self.requeue(gen, reason, ())
        self._leave_done(State.REQUEUEING.value if code == 0 else State.STOPPED.value, code)
        return code

    def finish(self, code: int, lost: int) -> int:
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
                while n < len(self.where.nodes) - lost and self.clock() < deadline:
                    self.sleep(0.1)
                    n = self.channel.exited()
        except (RuntimeError, OSError):  # node 0 already gone: nothing left to sync
            pass
        return code
