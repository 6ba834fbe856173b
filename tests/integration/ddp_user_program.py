"""A plain DDP training script, written as for torchrun, that slurmkit runs as a user program.

It knows slurmkit only through slurmkit.userapi: its place comes from torchrun's variables
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT; Slurm's SLURM_PROCID/SLURM_NTASKS/
SLURM_LOCALID when those are missing), its process group is gloo, and it saves and resumes its
own checkpoints: rank 0 ``torch.save``s the model and optimizer every ``every`` steps to
``$SLURMKIT_RUN_DIR/user_ckpt/step_<N>.pt`` (a temporary file, fsync, rename), and every rank
starts from the newest one there (``torch.load(weights_only=True)``), printing
``resumed at step <N>``. After each step it calls ``report_step``; after each save, unless run
with ``no-report``, ``report_checkpoint``; ``silent`` calls no slurmkit.userapi at all (never a
heartbeat: only its printed lines and its files tell its progress). A rank that finds
``$SLURMKIT_RUN_DIR/hang_rank<RANK>`` at a step takes it (renamed ``.taken``) and sleeps there
for good, a hang that is no stopped process: its peers wait in the next all-reduce. At the end rank 0 writes ``user_final.json`` (its
step, the step it last resumed from, its parameters); :func:`uninterrupted_params` computes
what they must be.

    python ddp_user_program.py <steps> <every> <delay_s> report|no-report|silent
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from slurmkit import userapi

CKPT_RE = re.compile(r"step_(\d{8})\.pt")


def _env_int(names: tuple[str, ...], default: int) -> int:
    for name in names:
        if os.environ.get(name, "").strip():
            return int(os.environ[name])
    return default


def newest_checkpoint(ckpt_dir: str) -> str | None:
    """The highest-step complete checkpoint (a temporary file of a killed save is ignored)."""
    try:
        names = [n for n in os.listdir(ckpt_dir) if CKPT_RE.fullmatch(n)]
    except FileNotFoundError:
        return None
    return os.path.join(ckpt_dir, max(names)) if names else None


def save(path: str, model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": step}, tmp)
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The data of (step, rank) alone: a resumed run sees what an uninterrupted one would."""
    g = torch.Generator().manual_seed(step * 1009 + rank)
    x = torch.randn(8, 16, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def make_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def flat_params(model: nn.Module) -> list[float]:
    return torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()


def uninterrupted_params(steps: int, world: int) -> list[float]:
    """The parameters after ``steps`` uninterrupted steps of ``world`` ranks, in one process: DDP
    averages the ranks' gradients, so one loss that is the mean of theirs gives the same step (to
    the rounding of the sum's order)."""
    model, opt = make_model()
    for step in range(1, steps + 1):
        loss = torch.stack([F.mse_loss(model(x), y) for x, y in (batch(step, r) for r in range(world))]).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return flat_params(model)


def main() -> int:
    steps, every, delay_s, mode = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
    rank = _env_int(("RANK", "SLURM_PROCID"), 0)
    world = _env_int(("WORLD_SIZE", "SLURM_NTASKS"), 1)
    local_rank = _env_int(("LOCAL_RANK", "SLURM_LOCALID"), 0)
    run_dir = os.environ.get("SLURMKIT_RUN_DIR", os.getcwd())
    ckpt_dir = os.path.join(run_dir, "user_ckpt")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    model, opt = make_model()
    ddp = DistributedDataParallel(model)  # broadcasts rank 0's parameters: the same start everywhere
    start = 0
    newest = newest_checkpoint(ckpt_dir)
    if newest is not None:
        state = torch.load(newest, map_location="cpu", weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        start = int(state["step"])
        print(f"rank {rank} (local {local_rank}): resumed at step {start} from {newest}", flush=True)
    else:
        print(f"rank {rank} (local {local_rank}): starting at step 0", flush=True)
    if rank == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
    if mode == "report":
        userapi.set_total_steps(steps)
    for step in range(start + 1, steps + 1):
        x, y = batch(step, rank)
        loss = F.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()  # DDP's gradient all-reduce over gloo
        opt.step()
        if mode == "report":  # the step with its loss (status shows it)
            userapi.report_metrics(step, loss=loss.item())
        elif mode == "no-report":
            userapi.report_step(step)
        hang = os.path.join(run_dir, f"hang_rank{rank}")
        if os.path.exists(hang):
            os.replace(hang, hang + ".taken")
            print(f"rank {rank}: hanging at step {step}", flush=True)
            while True:
                time.sleep(3600)
        if rank == 0:  # in its own words (a pattern can read them), and to compare with status
            print(f"generation {os.environ.get('SLURMKIT_GENERATION')} step {step} loss {loss.item()!r} "
                  f"at {time.time():.3f}", flush=True)
        if rank == 0 and (step % every == 0 or step == steps):
            path = os.path.join(ckpt_dir, f"step_{step:08d}.pt")
            save(path, model, opt, step)
            if mode == "report":
                userapi.report_checkpoint(step, path)
        time.sleep(delay_s)
    if rank == 0:
        out = os.path.join(run_dir, "user_final.json")
        with open(out + ".tmp", "w") as f:
            json.dump({"step": steps, "resumed_from": start, "world_size": world,
                       "params": flat_params(model)}, f)
        os.replace(out + ".tmp", out)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
