"""A PyTorch Lightning training script, written as for ``srun``, that slurmkit runs as a user program.

It imports nothing from slurmkit. Its place in the world comes from Lightning's own
``SLURMEnvironment`` (``SLURM_NTASKS``, ``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURM_NODEID``,
``MASTER_ADDR``/``MASTER_PORT``), which is why slurmkit gives every rank Slurm's task variables as
if srun had started it (docs/design.md, "Exit codes and the rank environment"). ``auto_requeue=False``:
slurmkit requeues the job itself.

    python lightning_user_program.py <max_steps> <every_n_steps> <delay_s> <out_dir>

``Trainer(accelerator="cpu", devices=<SLURM_NTASKS_PER_NODE>, num_nodes=<SLURM_NNODES>)`` with
DDP over gloo trains a tiny regression model on synthetic data. A ``ModelCheckpoint`` saves every
``every_n_steps`` steps into ``<out_dir>/ckpt`` (each file written to a temporary name, fsynced,
then renamed, so a rank killed mid-save never leaves a torn checkpoint under a final name), and
a (re)started program resumes from the newest one there (``fit(ckpt_path=...)``). Each training
step sleeps ``delay_s``: the program's workload, slow enough to be interrupted mid-run. Rank 0
prints every step (``generation G step N loss L at T``), its own log of its progress.

Every rank writes ``<out_dir>/ranks/rank<R>.pid<PID>.json`` when training starts: Lightning's
view of it (global, local and node rank, world size), the ranks its gloo group all-gathered, the
step it starts from and the checkpoint it resumed. Rank 0 writes ``<out_dir>/final.json`` at the
end.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import warnings
from datetime import timedelta
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.environments import SLURMEnvironment
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

CKPT_RE = re.compile(r"step-(\d{6})\.ckpt")


def write_json(path: str, record: dict[str, Any]) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.replace(tmp, path)


def newest_checkpoint(ckpt_dir: str) -> str | None:
    """The highest-step checkpoint under its final name (a killed save's temporary file is not one)."""
    try:
        names = [n for n in os.listdir(ckpt_dir) if CKPT_RE.fullmatch(n)]
    except FileNotFoundError:
        return None
    return os.path.join(ckpt_dir, max(names)) if names else None


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's torch.save, made atomic: readers see a whole checkpoint or none."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        path = os.fspath(path)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp.{os.getpid()}"
        with open(tmp, "wb") as f:
            torch.save(checkpoint, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)


class TinyRegression(L.LightningModule):
    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.delay_s = delay_s
        self.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        time.sleep(self.delay_s)  # the workload's pace
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class PrintSteps(Callback):
    """The program's own log, as many Lightning scripts have one: rank 0 prints each optimizer
    step with its loss and the time (``generation G step N loss L at T``)."""

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        if trainer.global_rank == 0:
            loss = float(outputs["loss"] if isinstance(outputs, dict) else outputs)
            print(f"generation {os.environ.get('SLURMKIT_GENERATION')} step {trainer.global_step} "
                  f"loss {loss:.6f} at {time.time():.3f}", flush=True)


class RecordPlacement(Callback):
    """Each rank's record of where Lightning put it, written once its group is up."""

    def __init__(self, out_dir: str, resumed_from: str | None) -> None:
        self.out_dir = out_dir
        self.resumed_from = resumed_from

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        seen = trainer.strategy.all_gather(torch.tensor([trainer.global_rank]))
        record = {
            "global_rank": trainer.global_rank, "local_rank": trainer.local_rank,
            "node_rank": trainer.node_rank, "world_size": trainer.world_size,
            "group_ranks": sorted(int(r) for r in seen.flatten().tolist()),
            "backend": dist.get_backend(), "dist_world_size": dist.get_world_size(),
            "start_step": trainer.global_step, "resumed_from": self.resumed_from,
            "pid": os.getpid(), "environment": type(getattr(trainer.strategy, "cluster_environment", None)).__name__,
            "generation": os.environ.get("SLURMKIT_GENERATION"), "node": os.environ.get("SLURMKIT_NODE"),
        }
        out = os.path.join(self.out_dir, "ranks")
        os.makedirs(out, exist_ok=True)
        write_json(os.path.join(out, f"rank{trainer.global_rank}.pid{os.getpid()}.json"), record)
        print(f"lightning rank {trainer.global_rank}/{trainer.world_size} local {trainer.local_rank} "
              f"node {trainer.node_rank}: starting at step {trainer.global_step} from {self.resumed_from}",
              flush=True)


def main() -> int:
    max_steps, every, delay_s = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    out_dir = os.path.abspath(sys.argv[4])  # a relative one is under the working directory (the run directory)
    warnings.filterwarnings("ignore", message=r".*does not have many workers.*")
    ckpt_dir = os.path.join(out_dir, "ckpt")
    resume = newest_checkpoint(ckpt_dir)
    L.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 16, generator=g)
    data = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True).sin()), batch_size=8, shuffle=True)
    env = os.environ
    trainer = L.Trainer(
        accelerator="cpu", devices=int(env["SLURM_NTASKS_PER_NODE"]), num_nodes=int(env["SLURM_NNODES"]),
        strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=60)),
        plugins=[SLURMEnvironment(auto_requeue=False), AtomicCheckpointIO()],
        max_steps=max_steps, enable_progress_bar=False, enable_model_summary=False, logger=False,
        callbacks=[ModelCheckpoint(dirpath=ckpt_dir, filename="step-{step:06d}", auto_insert_metric_name=False,
                                   every_n_train_steps=every, save_top_k=-1),
                   RecordPlacement(out_dir, resume), PrintSteps()],
    )
    trainer.fit(TinyRegression(delay_s), train_dataloaders=data, ckpt_path=resume)
    if trainer.global_rank == 0:
        write_json(os.path.join(out_dir, "final.json"),
                   {"global_step": trainer.global_step, "resumed_from": resume, "world_size": trainer.world_size})
    return 0


if __name__ == "__main__":
    sys.exit(main())
