"""The node agent: one per node, started by srun (or submitit's local executor).

It joins the other agents, starts this node's ranks with a torchrun-compatible environment
and their pinning plan, tees each rank's output to its own log, and watches them (lines,
exits, heartbeats). A failure anywhere ends the generation on every node; node 0 classifies
the evidence and decides (slurmkit.supervise.policy): restart, continue on a spare node,
requeue without the bad node, or stop with exit code 93.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from slurmkit import EXIT_NO_REQUEUE
from slurmkit.config import SlurmkitConfig, load_frozen
from slurmkit.launch.cancel_request import read_cancel_request
from slurmkit.launch.context import NodeContext, node_context
from slurmkit.launch.ranks import RankProcess, spawn_rank, stop_ranks
from slurmkit.launch.rendezvous import connect
from slurmkit.slurm.client import SlurmClient
from slurmkit.slurm.runner import SubprocessRunner
from slurmkit.supervise.classes import FailureClass
from slurmkit.supervise.classify import Evidence, root_cause
from slurmkit.supervise.ledger import LEDGER_NAME, Ledger, read_ledger
from slurmkit.supervise.monitor import EXIT_CHECKPOINTED_ON_SIGNAL, RankMonitor
from slurmkit.supervise.policy import Action, Decision, History, Limits, State, StateMachine, decide
from slurmkit.supervise.slurmview import kill_wait_warning, node_evidence
from slurmkit.supervise.timeouts import failure_env

log = logging.getLogger(__name__)

COMPLETED, FAILED, SIGNALLED = "completed", "failed", "signalled"


@dataclass(frozen=True)
class Outcome:
    kind: str  # completed | failed | signalled
    gen: int


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def rank_command(command: list[str]) -> list[str]:
    """`python` in job.command means this interpreter (the one the agent runs in)."""
    if command and command[0] in ("python", "python3"):
        return [sys.executable, *command[1:]]
    return list(command)


def latest_checkpoint_step(ledger_path: str) -> int | None:
    steps = [int(e["step"]) for e in read_ledger(ledger_path)
             if e.get("event") in ("ckpt_saved", "ckpt_durable") and e.get("step") is not None]
    return max(steps) if steps else None


class NodeAgent:
    def __init__(self, run_dir: str, cfg: SlurmkitConfig, ctx: NodeContext, store: dist.TCPStore,
                 env: Mapping[str, str], slurm: SlurmClient, *,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.run_dir, self.cfg, self.ctx, self.store = run_dir, cfg, ctx, store
        self.slurm = slurm  # every Slurm call of the supervisor goes through it
        self.env = dict(env)
        self.clock, self.sleep = clock, sleep
        self.ledger_path = os.path.join(run_dir, LEDGER_NAME)
        self.ledger = Ledger(self.ledger_path, source=f"agent:{ctx.node_name}")
        self.ranks_per_node = cfg.job.ranks_per_node or max(cfg.job.gpus_per_node or cfg.cluster.gpus_per_node, 1)
        self.train_nodes = cfg.job.nodes
        sup = cfg.supervisor
        self.limits = Limits(sup.max_restarts, sup.max_restarts_without_progress)
        self.history = History()
        self.sm = StateMachine(self._on_transition)
        self.signal_kind: str | None = None  # "time_limit" | "preemption" once a warning came
        self.procs: list[RankProcess] = []
        # Train slots -> node names. Spares are the allocation's nodes beyond the train nodes.
        self.node_map: list[str] = list(ctx.nodes[: self.train_nodes])
        self.spares: list[str] = list(ctx.nodes[self.train_nodes:])
        self._alive_seen: dict[int, tuple[str, float]] = {}

    # ------------------------------------------------------------------ helpers
    def _key(self, gen: int, name: str) -> str:
        return f"{self.ctx.attempt}/g{gen}/{name}"

    def _on_transition(self, old: State, new: State, why: str) -> None:
        if self.ctx.node_rank == 0:
            self.ledger.append("state", old=old.value, new=new.value, why=why)

    def _count(self, key: str) -> int:
        return int(self.store.add(key, 0))

    def _plans(self) -> list[object] | None:
        if not self.cfg.topology.enabled:
            return None
        from slurmkit.topology import discover, plan_node

        return list(plan_node(discover(), self.ranks_per_node, self.cfg.topology, env=self.env))

    def rank_env(self, gen: int, local_rank: int, slot: int, port: int) -> dict[str, str]:
        rank = slot * self.ranks_per_node + local_rank
        env = dict(self.env)
        # The batch script exports these on Slurm; local mode has no script, so set them here.
        env.update(self.cfg.cluster.env)
        env.update(self.cfg.job.env)
        env.update(failure_env(self.cfg, self.run_dir, env))
        env.update({
            "RANK": str(rank), "LOCAL_RANK": str(local_rank),
            "WORLD_SIZE": str(self.train_nodes * self.ranks_per_node),
            "LOCAL_WORLD_SIZE": str(self.ranks_per_node), "GROUP_RANK": str(slot),
            "MASTER_ADDR": self.ctx.master_addr, "MASTER_PORT": str(port),
            "SLURMKIT_RUN_DIR": self.run_dir,
            "SLURMKIT_CONFIG": os.path.join(self.run_dir, "config.yaml"),
            "SLURMKIT_LEDGER": self.ledger_path,
            "SLURMKIT_GENERATION": str(gen), "SLURMKIT_NODE": self.ctx.node_name,
            "SLURMKIT_ATTEMPT": self.ctx.attempt,
            "SLURMKIT_HEARTBEAT_FILE": os.path.join(self.run_dir, "heartbeat", f"rank{rank}.json"),
            "PYTHONUNBUFFERED": "1",
        })
        return env

    # ------------------------------------------------------------------ one generation
    def start_generation(self, gen: int, slot: int, monitor: RankMonitor) -> list[RankProcess]:
        if self.ctx.node_rank == 0:
            self.store.set(self._key(gen, "port"), str(free_port()))
        port = int(self.store.get(self._key(gen, "port")).decode())
        plans = self._plans()
        argv = rank_command(self.cfg.job.command)
        procs = []
        for lr in range(self.ranks_per_node):
            env = self.rank_env(gen, lr, slot, port)
            cmd = argv
            if plans is not None:
                from slurmkit.topology import pin_command, rank_env

                env.update(rank_env(plans[lr], plans, env, self.cfg.topology))  # type: ignore[arg-type]
                cmd = pin_command(plans[lr], argv, verify=self.cfg.topology.verify,  # type: ignore[arg-type]
                                  method=self.cfg.topology.apply_method)
            rank = int(env["RANK"])
            path = os.path.join(self.run_dir, "logs", f"rank{rank}.log")
            p = spawn_rank(cmd, env, rank=rank, local_rank=lr, log_path=path, cwd=self.run_dir,
                           sink=monitor.on_line, on_exit=monitor.on_exit)
            monitor.add_rank(rank, p.pid, env["SLURMKIT_HEARTBEAT_FILE"])
            procs.append(p)
        self.ledger.append("ranks_started", generation=gen, node=self.ctx.node_name, slot=slot,
                           ranks=[p.rank for p in procs], pids=[p.pid for p in procs])
        return procs

    def start_alive_thread(self) -> None:
        """Beat in the store from a thread with its own connection, so a busy main loop (stopping
        ranks, waiting for a decision) never looks like a lost node."""
        beat_store = dist.TCPStore(self.ctx.master_addr, self.store.port, self.ctx.num_nodes, False,
                                   timeout=timedelta(seconds=60), use_libuv=True)
        key = f"{self.ctx.attempt}/alive/{self.ctx.node_rank}"
        interval = self.cfg.supervisor.poll_interval_s

        def beat() -> None:
            tick = 0
            while True:
                tick += 1
                try:
                    beat_store.set(key, str(tick))
                except (RuntimeError, dist.DistStoreError):  # node 0 is gone: the job is ending
                    return
                time.sleep(interval)

        threading.Thread(target=beat, name="agent-alive", daemon=True).start()

    def _lost_agents(self) -> list[int]:
        """Node 0: agents whose alive counter stopped moving for supervisor.node_timeout_s."""
        now, lost = self.clock(), []
        for nr in (self.ctx.nodes.index(n) for n in self.node_map):
            if nr == 0:
                continue
            key = f"{self.ctx.attempt}/alive/{nr}"
            if not self.store.check([key]):
                continue
            val = self.store.get(key).decode()
            seen = self._alive_seen.get(nr)
            if seen is None or seen[0] != val:
                self._alive_seen[nr] = (val, now)
            elif now - seen[1] > self.cfg.supervisor.node_timeout_s:
                lost.append(nr)
        return lost

    def watch(self, gen: int, procs: list[RankProcess], monitor: RankMonitor) -> Outcome:
        fail_key = self._key(gen, "fail")
        n_slots = len(self.node_map)
        reported: str | None = None
        last_sample = self.clock()
        self._alive_seen.clear()
        while True:
            beats = monitor.poll()
            if self.clock() - last_sample >= self.cfg.supervisor.heartbeat_ledger_interval_s and beats:
                last_sample = self.clock()
                self.ledger.append("heartbeat", generation=gen, node=self.ctx.node_name,
                                   steps={str(r): b.get("step") for r, b in beats.items()})
            if monitor.triggered is not None:
                ev = monitor.triggered
                self.store.compare_set(fail_key, "", f"{ev.node}:{ev.rank}:{ev.cls.value}")
            if self.ctx.node_rank == 0:
                for nr in self._lost_agents():
                    name = self.ctx.nodes[nr]
                    ev = Evidence(time.time(), name, -1, "agent", FailureClass.NODE_LOSS,
                                  f"agent on {name} silent for over {self.cfg.supervisor.node_timeout_s:g} s")
                    self.store.set(self._key(gen, f"evidence/{nr}"), json.dumps([ev.to_json()]))
                    self.store.compare_set(fail_key, "", f"{name}:-1:node_loss")
            if self.store.check([fail_key]):
                return Outcome(FAILED, gen)
            codes = [p.poll() for p in procs]
            if reported is None and procs and all(c is not None for c in codes):
                reported = COMPLETED if all(c == 0 for c in codes) else (
                    SIGNALLED if all(c in (0, EXIT_CHECKPOINTED_ON_SIGNAL) for c in codes) else None)
                if reported is not None:
                    self.store.add(self._key(gen, reported), 1)
            done, sig = self._count(self._key(gen, COMPLETED)), self._count(self._key(gen, SIGNALLED))
            if done + sig >= n_slots:
                for p in procs:
                    p.reader.join(timeout=5)
                return Outcome(COMPLETED if sig == 0 else SIGNALLED, gen)
            self.sleep(self.cfg.supervisor.poll_interval_s)

    # ------------------------------------------------------------------ failure handling
    def stop_and_report(self, gen: int, procs: list[RankProcess], monitor: RankMonitor) -> None:
        # The generation is lost already: kill at once rather than let ranks that trap SIGTERM
        # try to checkpoint from inside a broken collective.
        stop_ranks(procs, grace_s=0.0, sleep=self.sleep, clock=self.clock)
        evidence = [e.to_json() for e in monitor.evidence]
        key = self._key(gen, f"evidence/{self.ctx.node_rank}")
        if not self.store.check([key]):
            self.store.set(key, json.dumps(evidence))
        self.store.add(self._key(gen, "stopped"), 1)

    def gather_evidence(self, gen: int, participants: list[int]) -> tuple[list[Evidence], list[str]]:
        """Node 0: wait (briefly) for every participating agent's evidence; silent ones are lost."""
        deadline = self.clock() + self.cfg.supervisor.node_timeout_s
        known_lost = [nr for nr in participants if self.store.check([self._key(gen, f"evidence/{nr}")])
                      and '"node_loss"' in self.store.get(self._key(gen, f"evidence/{nr}")).decode()]
        expected = len(participants) - len(known_lost)
        while self._count(self._key(gen, "stopped")) < expected and self.clock() < deadline:
            self.sleep(0.05)
        evidence: list[Evidence] = []
        lost: list[str] = []
        for nr in participants:
            key = self._key(gen, f"evidence/{nr}")
            if self.store.check([key]):
                evidence += [Evidence.from_json(d) for d in json.loads(self.store.get(key))]
                if any(Evidence.from_json(d).cls == FailureClass.NODE_LOSS
                       for d in json.loads(self.store.get(key))):
                    lost.append(self.ctx.nodes[nr])
            else:
                name = self.ctx.nodes[nr]
                lost.append(name)
                evidence.append(Evidence(time.time(), name, -1, "agent", FailureClass.NODE_LOSS,
                                         f"agent on {name} did not answer the stop request"))
        return evidence, sorted(set(lost))

    def node0_decide(self, gen: int, participants: list[int]) -> Decision:
        evidence, lost = self.gather_evidence(gen, participants)
        slurm_view = node_evidence(lost, self.slurm) if self.ctx.executor == "slurm" else []
        failure = root_cause(evidence + slurm_view)
        if failure is None:
            failure_d = Decision(Action.RESTART, "generation stopped without evidence")
            self.history.restarts += 1
            return failure_d
        self.ledger.append("failure", generation=gen, cls=failure.cls.value, rank=failure.rank,
                           node=failure.node, evidence=failure.evidence, time_of_fault=failure.time,
                           ranks_affected=list(failure.ranks_affected),
                           slurm_view=[e.detail for e in slurm_view])
        spares = [n for n in self.spares if n not in lost]
        decision = decide(failure, self.history, latest_checkpoint_step(self.ledger_path), self.limits,
                          spares, lost)
        if decision.action == Action.REQUEUE and self.ctx.executor != "slurm":
            decision = Decision(Action.STOP, decision.reason + "; no Slurm to requeue with (local mode)")
        return decision

    def apply_replacement(self, bad: tuple[str, ...]) -> None:
        for name in bad:
            if name in self.node_map:
                spare = self.spares.pop(0)
                self.node_map[self.node_map.index(name)] = spare
            if name in self.spares:
                self.spares.remove(name)

    def requeue(self, reason: str, exclude: tuple[str, ...]) -> None:
        """Node 0: requeue this job without the bad nodes and make it eligible at once."""
        from slurmkit.supervise.requeue import requeue_now

        self.ledger.append("requeue", job_id=self.ctx.job_id, reason=reason, exclude=list(exclude))
        requeue_now(self.slurm, self.ctx.job_id, exclude, env=self.env, run_dir=self.run_dir)

    # ------------------------------------------------------------------ signals
    def install_signal_handlers(self) -> None:
        def handler(signum: int, _frame: object) -> None:
            kind = "time_limit" if signum == signal.SIGUSR1 else "preemption"
            if self.signal_kind is None:
                self.signal_kind = kind
            for p in self.procs:
                p.signal(signum)

        signal.signal(signal.SIGUSR1, handler)
        signal.signal(signal.SIGTERM, handler)

    # ------------------------------------------------------------------ main loop
    def run(self) -> int:
        self.install_signal_handlers()
        self.start_alive_thread()
        if self.ctx.node_rank == 0 and self.ctx.executor == "slurm":
            warning = kill_wait_warning(self.cfg.cluster.kill_wait_s, self.slurm)
            if warning:
                log.warning(warning)
                self.ledger.append("config_warning", message=warning)
        if self.ctx.node_rank == 0:
            self.ledger.append("allocation_start", job_id=self.ctx.job_id, attempt=self.ctx.attempt,
                               restart_count=self.ctx.restart_count, nodes=list(self.ctx.nodes),
                               train_nodes=self.node_map, spares=self.spares, executor=self.ctx.executor)
        gen = 0
        while True:
            code = self.run_generation(gen)
            if code is not None:
                return self.finish(code)
            gen += 1

    def run_generation(self, gen: int) -> int | None:
        """One generation; returns the agent's exit code, or None to run the next generation."""
        slot = self.node_map.index(self.ctx.node_name) if self.ctx.node_name in self.node_map else None
        participants = [self.ctx.nodes.index(n) for n in self.node_map]
        monitor = RankMonitor(self.ctx.node_name, gen, heartbeat_timeout_s=self.cfg.supervisor.heartbeat_timeout_s,
                              startup_timeout_s=self.cfg.supervisor.startup_timeout_s)
        if self.sm.state != State.STARTING:
            self.sm.to(State.STARTING, f"generation {gen}")
        self.procs = self.start_generation(gen, slot, monitor) if slot is not None else []
        self.sm.to(State.RUNNING, f"generation {gen}")
        if self.signal_kind is not None:  # a warning arrived while the ranks were starting
            for p in self.procs:
                p.signal(signal.SIGUSR1 if self.signal_kind == "time_limit" else signal.SIGTERM)
        outcome = self.watch(gen, self.procs, monitor)
        if outcome.kind == COMPLETED:
            self.sm.to(State.COMPLETED)
            if self.ctx.node_rank == 0:
                self.ledger.append("end", status="completed", exit_code=0, generation=gen)
            return 0
        if outcome.kind == SIGNALLED:
            return self.after_signal(gen)
        self.sm.to(State.STOPPING, f"generation {gen}")
        if slot is not None:
            self.stop_and_report(gen, self.procs, monitor)
        decision_key = self._key(gen, "decision")
        self.sm.to(State.DECIDING, f"generation {gen}")
        if self.ctx.node_rank == 0:
            d = self.node0_decide(gen, participants)
            self.store.set(decision_key, json.dumps({"action": d.action.value, "reason": d.reason,
                                                     "exclude": list(d.exclude)}))
        else:
            self.store.wait([decision_key], timedelta(seconds=self.cfg.supervisor.node_timeout_s * 6 + 60))
        raw = json.loads(self.store.get(decision_key))
        d = Decision(Action(raw["action"]), raw["reason"], tuple(raw["exclude"]))
        return self.apply_decision(d, gen)

    def apply_decision(self, d: Decision, gen: int) -> int | None:
        if self.ctx.node_rank == 0:
            self.ledger.append("decision", generation=gen, action=d.action.value, reason=d.reason,
                               exclude=list(d.exclude))
        if d.action == Action.RESTART:
            self.sm.to(State.RESTARTING, d.reason)
            return None
        if d.action == Action.REPLACE_NODE:
            self.sm.to(State.REPLACING, d.reason)
            self.apply_replacement(d.exclude)
            if self.ctx.node_rank == 0:
                self.ledger.append("exclusion", nodes=list(d.exclude), how="spare", train_nodes=self.node_map)
            return None
        if d.action == Action.REQUEUE:
            self.sm.to(State.REQUEUEING, d.reason)
            if self.ctx.node_rank == 0:
                if d.exclude:
                    self.ledger.append("exclusion", nodes=list(d.exclude), how="requeue")
                self.requeue(d.reason, d.exclude)
            return 0
        self.sm.to(State.STOPPED, d.reason)
        print(f"slurmkit supervisor: stopping, exit {EXIT_NO_REQUEUE} (do not requeue): {d.reason}",
              file=sys.stderr, flush=True)
        if self.ctx.node_rank == 0:
            self.ledger.append("end", status="stopped", exit_code=EXIT_NO_REQUEUE, reason=d.reason)
        return EXIT_NO_REQUEUE

    def after_signal(self, gen: int) -> int:
        """Every rank saved a final checkpoint on the warning and left."""
        if read_cancel_request(self.run_dir) is not None:
            self.signal_kind = "cancel"  # slurmkit cancel --checkpoint: end here, never requeue
        self.sm.to(State.CHECKPOINTING, self.signal_kind or "signal")
        if self.ctx.node_rank == 0:
            self.ledger.append("checkpointed_on_signal", generation=gen, signal=self.signal_kind,
                               step=latest_checkpoint_step(self.ledger_path))
        if self.signal_kind == "time_limit" and self.cfg.job.requeue and self.ctx.executor == "slurm":
            self.sm.to(State.REQUEUEING, "time limit")
            if self.ctx.node_rank == 0:
                self.requeue("time limit warning: final checkpoint saved", ())
            return 0
        # Preemption: Slurm requeues a preempted job itself. Local mode: nothing to requeue.
        self.sm.to(State.COMPLETED, "left on signal")
        if self.ctx.node_rank == 0:
            cancelled = self.signal_kind == "cancel"
            self.ledger.append("end", status="cancelled" if cancelled else "signalled",
                               signal=self.signal_kind, exit_code=0)
            if cancelled and self.ctx.executor == "slurm":
                self.cancel_own_job()
        return 0

    def cancel_own_job(self) -> None:
        """Node 0, after a requested final checkpoint: Slurm ends the job CANCELLED (no requeue)."""
        self.slurm.cancel(self.ctx.job_id)

    def finish(self, code: int) -> int:
        """Leave together: node 0 keeps the store alive until every agent has read what it needs."""
        try:
            n = self.store.add(f"{self.ctx.attempt}/exit", 1)
            if self.ctx.node_rank == 0:
                deadline = self.clock() + 10
                while n < len(self.node_map) and self.clock() < deadline:
                    self.sleep(0.1)
                    n = self.store.add(f"{self.ctx.attempt}/exit", 0)
        except (RuntimeError, dist.DistStoreError):  # node 0 already gone: nothing left to sync
            pass
        return code


def agent_main(run_dir: str, env: Mapping[str, str] | None = None) -> int:
    """Entry point on every node (submitit callable and `python -m slurmkit.launch RUN_DIR`)."""
    env = dict(os.environ) if env is None else dict(env)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s agent %(levelname)s %(message)s")
    cfg = load_frozen(os.path.join(run_dir, "config.yaml"))
    ctx = node_context(env)
    store = connect(ctx, run_dir)
    return NodeAgent(run_dir, cfg, ctx, store, env, SlurmClient(SubprocessRunner(env=env))).run()


def submitit_entry(run_dir: str) -> None:
    """The tiny callable submitit pickles: exit with the agent's code (93 means do not requeue)."""
    code = agent_main(run_dir)
    sys.stdout.flush()
    sys.stderr.flush()
    if code:
        os._exit(code)
