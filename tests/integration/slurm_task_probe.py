"""A rank program that knows nothing of slurmkit: it finds its place from Slurm's task
variables alone, as PyTorch Lightning's SLURMEnvironment does (world size SLURM_NTASKS, global
rank SLURM_PROCID, local rank SLURM_LOCALID, node SLURM_NODEID, the main address the first host
of SLURM_NODELIST), joins a real gloo group with it, and never writes a heartbeat.

Run by the node agent as ``job.command=[python,<this file>,<seconds>]``: after the group is
formed it keeps all-reducing for ``seconds`` (longer than the test's supervisor.startup_timeout_s,
so a supervisor that required beats from it would kill it as a hang), then writes
``$SLURMKIT_RUN_DIR/slurm_task/rank<SLURM_PROCID>.json``.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from datetime import timedelta

import submitit
import torch
import torch.distributed as dist


def main_address(nodelist: str) -> str:
    """The first host of a Slurm node list, the way Lightning reads it."""
    nodes = re.sub(r"\[(.*?)[,-].*\]", "\\1", nodelist)
    nodes = re.sub(r"\[(.*?)\]", "\\1", nodes)
    return nodes.split(" ")[0].split(",")[0]


def main() -> None:
    seconds = float(sys.argv[1])
    env = os.environ
    world, rank = int(env["SLURM_NTASKS"]), int(env["SLURM_PROCID"])
    addr = main_address(env["SLURM_NODELIST"])
    store = dist.TCPStore(addr, int(env["MASTER_PORT"]), world, rank == 0, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    rounds, t0 = 0, time.monotonic()
    while time.monotonic() - t0 < seconds:  # the program's own work, with no heartbeat
        x = torch.ones(1)
        dist.all_reduce(x)
        assert int(x.item()) == world
        rounds += 1
        time.sleep(0.2)
    job = submitit.JobEnvironment()
    record = {"slurm": {k: v for k, v in env.items() if k.startswith("SLURM")},
              "submitit": [job.global_rank, job.local_rank, job.num_tasks, job.node],
              "torch": [dist.get_rank(), dist.get_world_size()], "rank_sum": total.item(),
              "rounds": rounds, "RANK": env["RANK"], "SLURMKIT_NODE": env.get("SLURMKIT_NODE")}
    dist.destroy_process_group()
    out = os.path.join(env["SLURMKIT_RUN_DIR"], "slurm_task")
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
