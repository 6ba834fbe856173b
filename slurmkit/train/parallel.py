"""Process group, device and model wrapping (DDP or FSDP2), and a full-parameter digest.

gloo on the CPU, NCCL on a GPU (the device the node agent chose for the rank). Tensor and pipeline parallelism
are planned by ``slurmkit.train.planner`` but not implemented by this reference trainer: a
layout asking for them fails at start with a clear error instead of training something else.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from slurmkit.contract import (
    CUDA_VISIBLE_DEVICES,
    DEVICE,
    MASTER_ADDR,
    MASTER_PORT,
    RANK,
    WORLD_SIZE,
    ContractError,
    DeviceChoice,
)
from slurmkit.errors import ConfigError
from slurmkit.train.config import ParallelConfig, TrainConfig
from slurmkit.train.model import Transformer
from slurmkit.train.reduce import CommClock, rank_order_hook, timed_rank_order_hook

log = logging.getLogger(__name__)
_LISTENING: list[socket.socket] = []  # rank 0's store server sockets, open while it serves


@dataclass(frozen=True)
class Runtime:
    """Where this rank computes."""

    device: torch.device
    backend: str  # "gloo" or "nccl"
    compute_dtype: torch.dtype  # bf16 on GPU when configured, else fp32


def select_runtime(train: TrainConfig, local_rank: int, *, device: DeviceChoice | None = None,
                   cuda: bool | None = None, device_count: int | None = None) -> Runtime:
    """Where this rank computes: the device the node agent chose (``SLURMKIT_DEVICE``, see
    slurmkit.contract.choose_device), else GPU ``local_rank`` as under torchrun; NCCL on a GPU,
    gloo on the CPU. A GPU choice on a host without CUDA (an emulated GPU cluster) runs on the
    CPU; a GPU index that is not visible is refused here, not deep inside NCCL."""
    use_cuda = torch.cuda.is_available() if cuda is None else cuda
    if use_cuda and (device is None or device.kind == "cuda"):
        index = local_rank if device is None or device.index is None else device.index
        count = torch.cuda.device_count() if device_count is None else device_count
        if index >= count:
            source = f"{DEVICE}=cuda:{index}" if device is not None else f"LOCAL_RANK={local_rank}"
            raise ContractError(
                f"this rank must use GPU {index} ({source}) but {count} GPU(s) are visible "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get(CUDA_VISIBLE_DEVICES, 'unset')})",
                "a device index below the number of GPUs the rank sees",
                "start ranks through the node agent (it sets SLURMKIT_DEVICE to match what it made "
                "visible), or lower job.ranks_per_node to the GPUs per node")
        dtype = torch.bfloat16 if train.dtype == "bf16" else torch.float32
        return Runtime(torch.device("cuda", index), "nccl", dtype)
    return Runtime(torch.device("cpu"), "gloo", torch.float32)


def init_distributed(runtime: Runtime, parallel: ParallelConfig,
                     env: Mapping[str, str] | None = None) -> None:
    """Join the process group from the torchrun-style environment (MASTER_ADDR/PORT, RANK)."""
    env = os.environ if env is None else env
    if runtime.device.type == "cuda":
        torch.cuda.set_device(runtime.device)
    timeout = timedelta(seconds=parallel.pg_timeout_s)
    rank, world = int(env.get(RANK, "0")), int(env.get(WORLD_SIZE, "1"))
    dist.init_process_group(
        runtime.backend, store=rank_store(env, rank, world, timeout), rank=rank,
        world_size=world, timeout=timeout,
        device_id=runtime.device if runtime.device.type == "cuda" else None,
    )


def rank_store(env: Mapping[str, str], rank: int, world: int, timeout: timedelta) -> dist.Store:
    """The ranks' rendezvous store, as ``env://`` makes it except that rank 0's server listens
    on MASTER_ADDR only (like the agents' store, slurmkit.launch.rendezvous), not on every
    interface of the node: a socket bound there is handed to the TCPStore."""
    from slurmkit.listen import listen_socket

    addr, port = env.get(MASTER_ADDR, ""), int(env.get(MASTER_PORT, "0") or 0)
    if not addr or not port:
        raise ContractError(f"{MASTER_ADDR}={addr!r} {MASTER_PORT}={port or ''!r}",
                            "the rendezvous address and port in the rank's environment",
                            "start ranks through the node agent, or set MASTER_ADDR and MASTER_PORT")
    if rank == 0:
        sock = listen_socket(addr, backlog=max(1024, 2 * world), port=port)
        _LISTENING.append(sock)  # the server accepts on this descriptor for the process' life
        store = dist.TCPStore(addr, port, world, True, timeout=timeout, wait_for_workers=False,
                              master_listen_fd=sock.fileno(), use_libuv=True)
    else:
        store = dist.TCPStore(addr, port, world, False, timeout=timeout, use_libuv=True)
    return dist.PrefixStore("default_pg", store)  # the keys env:// would use


def require_supported(parallel: ParallelConfig) -> None:
    """The reference trainer runs data parallelism only (DDP or FSDP2)."""
    for name, degree in (("tensor", parallel.tensor), ("pipeline", parallel.pipeline)):
        if degree > 1:
            raise ConfigError(
                detected=f"parallel.{name}={degree}",
                requirement=f"the reference trainer (slurmkit.train) implements data "
                            f"parallelism only (DDP/FSDP2); {name} parallel is planned, not run",
                fix=f"set parallel.{name}=1 and use parallel.strategy=fsdp with activation "
                    "checkpointing, or run your own trainer under the same agent and store",
            )


def wrap(model: Transformer, strategy: str, runtime: Runtime, parallel: ParallelConfig, *,
         rank_order: bool = True, comm_clock: CommClock | None = None) -> nn.Module:
    """DDP (replicated) or FSDP2 (each block sharded, then the root) over all ranks.

    ``rank_order``: DDP reduces gradients with ``rank_order_hook``, whose sums do not depend
    on DDP's bucket layout (which changes after a DDP's first iteration, so a resumed run
    would otherwise not be bit-exact with more than two ranks). FSDP2 reduce-scatters each
    parameter group in one fixed layout from its first step on and needs no hook.
    ``comm_clock``: with ``rank_order``, the hook adds its time there (the step's gradient
    communication, for straggler scores); elsewhere the reduction is inside the compute.
    """
    if strategy == "ddp":
        ids = [runtime.device.index] if runtime.device.type == "cuda" else None
        # The rotary table is a deterministic buffer: syncing it is waste. torch 2.13 marks
        # broadcast_buffers deprecated, but its replacement still syncs at init.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            ddp = DistributedDataParallel(model, device_ids=ids, broadcast_buffers=False)
        if rank_order and comm_clock is not None:
            ddp.register_comm_hook(comm_clock, timed_rank_order_hook)
        elif rank_order:
            ddp.register_comm_hook(None, rank_order_hook)
        return ddp
    if strategy != "fsdp":
        raise ConfigError(detected=f"strategy {strategy!r}", requirement="ddp or fsdp",
                          fix="set parallel.strategy to ddp, fsdp or auto")
    mesh = init_device_mesh(runtime.device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=runtime.compute_dtype, reduce_dtype=torch.float32)
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=policy,
                    reshard_after_forward=parallel.reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=policy,
                reshard_after_forward=parallel.reshard_after_forward)
    return model


def unwrap(module: nn.Module) -> Transformer:
    """The Transformer inside a DDP wrapper (FSDP2 shards in place, nothing to unwrap)."""
    inner = module.module if isinstance(module, DistributedDataParallel) else module
    return cast(Transformer, inner)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: all-gathers a DTensor shard (a collective: every rank must call)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def param_digest(model: Transformer) -> str:
    """sha256 over (name, dtype, shape, bytes) of every parameter in sorted name order.

    Every rank must call it (FSDP shards are gathered); all ranks return the same digest.
    """
    h = hashlib.sha256()
    for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
        full = full_tensor(param.detach()).cpu().contiguous()
        h.update(f"{name}:{full.dtype}:{tuple(full.shape)}\n".encode())
        h.update(full.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
