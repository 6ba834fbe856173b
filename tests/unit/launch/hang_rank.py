"""A rank of a user program (not slurmkit's trainer) for tests/unit/launch/test_hang_stacks.py.

Real gloo all-reduces, one heartbeat per step (the optional one-line API). Before step 4 rank 1
sleeps in ``load_batch`` (a data loader stuck on a file system) while rank 0 waits in step 4's
all-reduce. Rank 1 beats each step 0.3 s after rank 0, so the earliest beat names rank 0: the
random blame of a hang by beats alone.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from slurmkit.train.heartbeat import Heartbeat

RANK = int(os.environ["RANK"])
STALL_STEP = 4


def load_batch(step: int) -> torch.Tensor:
    if RANK == 1 and step == STALL_STEP:
        print("loading", flush=True)
        time.sleep(3600)
    return torch.ones(8)


def main() -> None:
    dist.init_process_group("gloo")
    beat = Heartbeat.from_env(os.environ, RANK)
    assert beat is not None
    for step in range(1, 100):
        batch = load_batch(step)
        dist.all_reduce(batch)
        if RANK == 1:
            time.sleep(0.3)
        beat.beat(step)


if __name__ == "__main__":
    main()
