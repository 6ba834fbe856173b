"""A small real torch.distributed program: every rank all-reduces its rank number.

Rank 0 records the result in $SLURMKIT_RUN_DIR/allreduce.json; the sum must be
world_size * (world_size - 1) / 2.
"""

from __future__ import annotations

import json
import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    hosts: list[object] = [None] * world
    dist.all_gather_object(hosts, {"rank": rank, "node": os.environ.get("SLURMKIT_NODE", ""),
                                   "host": socket.gethostname(), "pid": os.getpid(),
                                   "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                                   "device": os.environ.get("SLURMKIT_DEVICE"),
                                   "local_rank": os.environ.get("LOCAL_RANK")})
    print(f"rank {rank}/{world}: all_reduce sum = {t.item():.0f}", flush=True)
    if rank == 0:
        out = {"world_size": world, "sum": t.item(), "expected": world * (world - 1) / 2,
               "ranks": hosts}
        path = os.path.join(os.environ.get("SLURMKIT_RUN_DIR", "."), "allreduce.json")
        with open(path + ".tmp", "w") as f:
            json.dump(out, f, indent=1)
        os.replace(path + ".tmp", path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
