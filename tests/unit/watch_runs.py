"""Run directories for the watch verbs' unit tests, written by the project's own writers.

Ledger events go through :class:`slurmkit.ledger.ledger.Ledger` with the fields the node
agent, the trainer and the store append (see slurmkit/launch/agent.py, train/trainer.py,
store/store.py); per-step metrics through :class:`slurmkit.train.metrics.MetricsWriter`;
heartbeats through :class:`slurmkit.train.heartbeat.Heartbeat`. A clock makes times exact.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from slurmkit.ledger.ledger import LEDGER_NAME, Ledger
from slurmkit.train.heartbeat import Heartbeat
from slurmkit.train.metrics import MetricsWriter, step_metrics


@dataclass
class Clock:
    now: float = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now

    def tick(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class FakeRun:
    """A run directory and writers standing in for submit, node 0's agent and rank 0."""

    run_dir: str
    clock: Clock = field(default_factory=Clock)
    steps: int = 60

    def __post_init__(self) -> None:
        os.makedirs(os.path.join(self.run_dir, "logs"), exist_ok=True)
        with open(os.path.join(self.run_dir, "config.yaml"), "w", encoding="utf-8") as f:
            f.write(f"job:\n  name: tiny\n  nodes: 2\ntrain:\n  steps: {self.steps}\n")
        path = os.path.join(self.run_dir, LEDGER_NAME)
        self.submit = Ledger(path, source="submit", clock=self.clock)
        self.agent = Ledger(path, source="agent:node1", clock=self.clock)
        self.rank0 = Ledger(path, source="rank0", clock=self.clock)
        self.metrics = MetricsWriter(os.path.join(self.run_dir, "metrics.jsonl"))
        self.beat = Heartbeat(os.path.join(self.run_dir, "heartbeat", "rank0.json"), rank=0,
                              clock=self.clock)
        self.gen = 0

    def submitted(self, job_id: str = "4242", executor: str = "slurm") -> None:
        self.submit.append("submitted", job_id=job_id, executor=executor, name="tiny", nodes=2,
                           ranks_per_node=2, config_hash="abc")

    def allocation(self, job_id: str = "4242", nodes: tuple[str, ...] = ("node1", "node2")) -> None:
        self.clock.tick(3)
        self.agent.append("allocation_start", job_id=job_id, attempt=f"{job_id}-0", restart_count=0,
                          nodes=list(nodes), train_nodes=list(nodes), spares=[], executor="slurm")

    def start_generation(self, restored: int = 0) -> None:
        self.clock.tick(1)
        self.agent.append("ranks_started", generation=self.gen, node="node1", slot=0, ranks=[0, 1],
                          pids=[101, 102])
        self.clock.tick(2)
        if restored:
            self.rank0.append("ckpt_restored", step=restored, tier="nvme", rank=0, node="node1")
        self.rank0.append("train_started", step=restored, generation=self.gen, world_size=4,
                          strategy="ddp")

    def step(self, step: int, loss: float, seconds: float = 0.5) -> None:
        self.clock.tick(seconds)
        self.beat.beat(step)
        self.metrics.write(step_metrics(
            step=step, loss=loss, lr=1e-3, step_time_s=seconds, tokens=4096, world_size=4,
            flops_per_token=6e6, peak_tflops=0.5, ckpt_blocking_s=0.0, generation=self.gen))

    def heartbeat_sample(self, step: int) -> None:
        self.agent.append("heartbeat", generation=self.gen, node="node1",
                          steps={"0": step, "1": step})

    def checkpoint(self, step: int, tier: str = "nvme", durable_tier: str | None = None) -> None:
        self.rank0.append("ckpt_saved", step=step, tier=tier, uri=f"/ckpt/{tier}", bytes=1000,
                          seconds=0.2, promote_to=[durable_tier] if durable_tier else [])
        if durable_tier:
            self.clock.tick(0.5)
            self.rank0.append("ckpt_durable", step=step, tier=durable_tier, uri=f"/ckpt/{durable_tier}",
                              bytes=1000)

    def crash(self, rank: int = 1, cls: str = "rank_crash") -> None:
        self.clock.tick(1)
        self.agent.append("state", old="running", new="stopping", why=f"generation {self.gen}")
        self.agent.append("failure", generation=self.gen, cls=cls, rank=rank, node="node1",
                          evidence="exit code 1", time_of_fault=self.clock() - 0.5,
                          ranks_affected=[rank], slurm_view=[])
        self.agent.append("decision", generation=self.gen, action="restart", reason="rank crash",
                          exclude=[])
        self.gen += 1

    def finish(self, step: int) -> None:
        self.clock.tick(1)
        self.rank0.append("train_finished", step=step, param_sha256="0" * 64, generation=self.gen)
        self.agent.append("end", status="completed", exit_code=0, generation=self.gen)


def run_with_one_crash(run_dir: str) -> FakeRun:
    """Submitted, trained to step 25 (checkpoint at 20), a crash, resumed from 20, now at 30."""
    r = FakeRun(run_dir)
    r.submitted()
    r.allocation()
    r.start_generation()
    for s in range(1, 26):
        r.step(s, 6.0 - s * 0.05)
        if s == 20:
            r.checkpoint(20, "nvme", "lustre")
        if s % 10 == 0:
            r.heartbeat_sample(s)
    r.crash()
    r.start_generation(restored=20)
    for s in range(21, 31):
        r.step(s, 6.0 - s * 0.05)
    r.heartbeat_sample(30)
    return r
