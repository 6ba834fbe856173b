"""The node agent: one per node, started by srun (or submitit's local executor).

It joins the other agents, starts this node's ranks with a torchrun-compatible environment
and their pinning plan, tees each rank's output to its own log, and watches them. A failure
on any node ends the generation on every node; what happens next (restart, requeue, stop) is
the supervisor's decision (slurmkit.supervise), taken through ``decide``.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch.distributed as dist

from slurmkit.config import SlurmkitConfig, load_frozen
from slurmkit.launch.context import NodeContext, node_context
from slurmkit.launch.ranks import RankProcess, spawn_rank, stop_ranks
from slurmkit.launch.rendezvous import connect
from slurmkit.supervise.ledger import LEDGER_NAME, Ledger

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerationResult:
    ok: bool  # every rank of every node exited 0
    exit_codes: dict[int, int]  # this node's ranks: global rank -> returncode


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def rank_command(command: list[str]) -> list[str]:
    """`python` in job.command means this interpreter (the one the agent runs in)."""
    if command and command[0] in ("python", "python3"):
        return [sys.executable, *command[1:]]
    return list(command)


class NodeAgent:
    def __init__(self, run_dir: str, cfg: SlurmkitConfig, ctx: NodeContext, store: dist.TCPStore,
                 env: Mapping[str, str], *, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.run_dir = run_dir
        self.cfg = cfg
        self.ctx = ctx
        self.store = store
        self.env = dict(env)
        self.clock = clock
        self.sleep = sleep
        self.ledger = Ledger(os.path.join(run_dir, LEDGER_NAME), source=f"agent:{ctx.node_name}")
        self.ranks_per_node = cfg.job.ranks_per_node or max(cfg.job.gpus_per_node or cfg.cluster.gpus_per_node, 1)
        self.train_nodes = cfg.job.nodes

    # ------------------------------------------------------------------ keys
    def _key(self, gen: int, name: str) -> str:
        return f"{self.ctx.attempt}/g{gen}/{name}"

    # ------------------------------------------------------------------ ranks
    def _plans(self) -> list[object] | None:
        if not self.cfg.topology.enabled:
            return None
        from slurmkit.topology import discover, plan_node

        return list(plan_node(discover(), self.ranks_per_node, self.cfg.topology))

    def rank_env(self, gen: int, local_rank: int, node_index: int, port: int) -> dict[str, str]:
        rank = node_index * self.ranks_per_node + local_rank
        env = dict(self.env)
        env.update({
            "RANK": str(rank), "LOCAL_RANK": str(local_rank),
            "WORLD_SIZE": str(self.train_nodes * self.ranks_per_node),
            "LOCAL_WORLD_SIZE": str(self.ranks_per_node), "GROUP_RANK": str(node_index),
            "MASTER_ADDR": self.ctx.master_addr, "MASTER_PORT": str(port),
            "SLURMKIT_RUN_DIR": self.run_dir,
            "SLURMKIT_CONFIG": os.path.join(self.run_dir, "config.yaml"),
            "SLURMKIT_LEDGER": os.path.join(self.run_dir, LEDGER_NAME),
            "SLURMKIT_GENERATION": str(gen), "SLURMKIT_NODE": self.ctx.node_name,
            "SLURMKIT_ATTEMPT": self.ctx.attempt,
            "SLURMKIT_HEARTBEAT_FILE": os.path.join(self.run_dir, "heartbeat", f"rank{rank}.json"),
            "PYTHONUNBUFFERED": "1",
        })
        return env

    def start_generation(self, gen: int, node_index: int) -> list[RankProcess]:
        if self.ctx.node_rank == 0:
            self.store.set(self._key(gen, "port"), str(free_port()))
        port = int(self.store.get(self._key(gen, "port")).decode())
        plans = self._plans()
        argv = rank_command(self.cfg.job.command)
        procs = []
        for lr in range(self.ranks_per_node):
            env = self.rank_env(gen, lr, node_index, port)
            cmd = argv
            if plans is not None:
                from slurmkit.topology import pin_command, rank_env

                env.update(rank_env(plans[lr], plans, env, self.cfg.topology))  # type: ignore[arg-type]
                cmd = pin_command(plans[lr], argv)  # type: ignore[arg-type]
            rank = int(env["RANK"])
            path = os.path.join(self.run_dir, "logs", f"rank{rank}.log")
            procs.append(spawn_rank(cmd, env, rank=rank, local_rank=lr, log_path=path, cwd=self.run_dir))
        self.ledger.append("ranks_started", generation=gen, node=self.ctx.node_name,
                           ranks=[p.rank for p in procs], pids=[p.pid for p in procs])
        return procs

    def watch(self, gen: int, procs: list[RankProcess]) -> GenerationResult:
        """Wait until every node's ranks finish, or any rank anywhere fails."""
        fail_key, done_key = self._key(gen, "fail"), self._key(gen, "done")
        reported_done = False
        while True:
            codes = {p.rank: p.poll() for p in procs}
            bad = {r: c for r, c in codes.items() if c not in (None, 0)}
            if bad:
                rank, rc = sorted(bad.items())[0]
                self.ledger.append("rank_exit", generation=gen, rank=rank, returncode=rc,
                                   node=self.ctx.node_name)
                self.store.set(fail_key, f"{self.ctx.node_name}:{rank}:{rc}")
            if self.store.check([fail_key]):
                stop_ranks(procs, grace_s=5.0, sleep=self.sleep, clock=self.clock)
                return GenerationResult(False, {p.rank: p.proc.returncode for p in procs})
            if not reported_done and all(c == 0 for c in codes.values()):
                self.store.add(done_key, 1)
                reported_done = True
            if reported_done and self.store.add(done_key, 0) >= self.train_nodes:
                for p in procs:
                    p.reader.join(timeout=5)
                return GenerationResult(True, {p.rank: 0 for p in procs})
            self.sleep(self.cfg.supervisor.poll_interval_s)

    def finish(self, code: int) -> int:
        """Leave together: node 0 keeps the store alive until every agent has read what it needs."""
        n = self.store.add(f"{self.ctx.attempt}/exit", 1)
        if self.ctx.node_rank == 0:
            deadline = self.clock() + 30
            while n < self.ctx.num_nodes and self.clock() < deadline:
                self.sleep(0.1)
                n = self.store.add(f"{self.ctx.attempt}/exit", 0)
        return code

    def run(self) -> int:
        node_index = self.ctx.node_rank
        if self.ctx.node_rank == 0:
            self.ledger.append("allocation_start", job_id=self.ctx.job_id, attempt=self.ctx.attempt,
                               nodes=list(self.ctx.nodes), executor=self.ctx.executor)
        if node_index >= self.train_nodes:
            log.info("node %s is a spare: no ranks here", self.ctx.node_name)
            return self.finish(0)
        procs = self.start_generation(0, node_index)
        result = self.watch(0, procs)
        code = 0 if result.ok else 1
        if self.ctx.node_rank == 0:
            self.ledger.append("end", status="completed" if result.ok else "failed", exit_code=code)
        return self.finish(code)


def agent_main(run_dir: str, env: Mapping[str, str] | None = None) -> int:
    """Entry point on every node (submitit callable and `python -m slurmkit.launch RUN_DIR`)."""
    env = dict(os.environ) if env is None else dict(env)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s agent %(levelname)s %(message)s")
    cfg = load_frozen(os.path.join(run_dir, "config.yaml"))
    ctx = node_context(env)
    store = connect(ctx, run_dir)
    return NodeAgent(run_dir, cfg, ctx, store, env).run()


def submitit_entry(run_dir: str) -> None:
    """The tiny callable submitit pickles: exit with the agent's code (93 means do not requeue)."""
    code = agent_main(run_dir)
    if code:
        sys.stdout.flush()
        os._exit(code)
