"""Small collectives on the store's own gloo groups (no-ops without a process group).

The store makes two groups at init: one for the background writer, one for calls from the
training thread (save decisions, restore). Neither interleaves with the trainer's own
collectives, and the two never interleave with each other. Payloads are JSON, never pickle.
"""

from __future__ import annotations

import json
from typing import Any

import torch


class Coordinator:
    """Gather/broadcast JSON and reduce flags over one process group (or a world of one)."""

    def __init__(self, group: Any | None, rank: int, world_size: int) -> None:
        self.group = group
        self.rank = rank
        self.world_size = world_size

    @property
    def distributed(self) -> bool:
        return self.group is not None and self.world_size > 1

    def all_gather_json(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order."""
        if not self.distributed:
            return [obj]
        import torch.distributed as dist

        data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        dist.all_gather(sizes, size, group=self.group)
        width = int(max(s.item() for s in sizes))
        padded = torch.zeros(width, dtype=torch.uint8)
        padded[: data.numel()] = data
        outs = [torch.zeros(width, dtype=torch.uint8) for _ in range(self.world_size)]
        dist.all_gather(outs, padded, group=self.group)
        return [json.loads(bytes(o[: int(s.item())].numpy().tobytes()))
                for o, s in zip(outs, sizes)]

    def broadcast_json(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` on every rank."""
        if not self.distributed:
            return obj
        return self.all_gather_json(obj if self.rank == src else None)[src]

    def any_true(self, flag: bool) -> bool:
        if not self.distributed:
            return flag
        import torch.distributed as dist

        t = torch.tensor([1 if flag else 0], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return bool(t.item())

    def barrier(self) -> None:
        if self.distributed:
            import torch.distributed as dist

            dist.barrier(group=self.group)
