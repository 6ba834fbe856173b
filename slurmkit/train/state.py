"""The checkpointed state of a training run, shaped for torch.distributed.checkpoint.

Layout (same keys on every rank, as DCP wants)::

    model      model state dict (DTensor shards under FSDP2)   get_state_dict
    optim      AdamW state keyed by parameter name              get_state_dict
    scheduler  {"steps_taken": int64}
    data       {"position": int64}: next global sample index
    step       int64: optimizer steps completed
    rng        {"torch"|"python"|"numpy": (world_size, n) int64}: row r is rank r's state

The RNG rows are all-gathered so the tensor is replicated and identical on every rank;
restoring picks this rank's row. Scalars are tensors so the store never pickles anything.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from slurmkit.train import rng
from slurmkit.train.data import ShardedLoader
from slurmkit.train.schedule import WarmupCosine

log = logging.getLogger(__name__)


def _gather_rows(local: torch.Tensor, device: torch.device) -> torch.Tensor:
    """(world_size, n) int64 tensor of every rank's ``local`` (same n on every rank)."""
    flat = local.to(torch.int64).flatten().to(device)
    if not (dist.is_available() and dist.is_initialized()):
        return flat.unsqueeze(0).cpu()
    rows = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, flat)
    return torch.stack(rows).cpu()


def capture_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                  scheduler: WarmupCosine, loader: ShardedLoader, *, step: int,
                  device: torch.device) -> dict[str, Any]:
    """The state to save after ``step`` steps (collective: every rank calls it)."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    rng_rows = {name: _gather_rows(t, device) for name, t in rng.capture().items()}
    return {
        "model": model_sd,
        "optim": optim_sd,
        "scheduler": scheduler.state_dict(),
        "data": {"position": torch.tensor(loader.position, dtype=torch.int64)},
        "step": torch.tensor(step, dtype=torch.int64),
        "rng": rng_rows,
    }


def apply_state(state: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer,
                scheduler: WarmupCosine, loader: ShardedLoader, *, rank: int) -> int:
    """Load a restored ``state`` into the live objects; returns the step it was saved at."""
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    scheduler.load_state_dict(state["scheduler"])
    loader.load_state_dict({"position": int(state["data"]["position"])})
    rows = state["rng"]
    if rank < rows["torch"].shape[0]:
        rng.restore({name: rows[name][rank] for name in ("torch", "python", "numpy")})
    else:
        log.warning("checkpoint holds RNG states of %d ranks; rank %d keeps its fresh seed",
                    rows["torch"].shape[0], rank)
    return int(state["step"])
