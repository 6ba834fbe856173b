"""A user program whose ranks write garbage where their node agent reads (issue 34, item 7).

Every rank trains a few seconds (gloo, one all-reduce per step, ``userapi.report_step`` after
each) and in between puts into its own ``$SLURMKIT_HEARTBEAT_FILE`` each of :data:`BEATS`
(``null``, a number, 100,000-deep nesting, a 5,000-digit step, bytes that are not UTF-8, and a
FIFO, which an agent that opens it plainly would wait on forever), each held for
``hold_s`` so that the agent's polls see it, and appends :data:`SPOOL_LINES` to its own
``$SLURMKIT_EVENTS_FILE``. Rank 0 then reports a checkpoint (a valid spool event after the
garbage); the last rank replaces its spool with a FIFO. At the end rank 0 writes
``hostile_done.json``.

    python hostile_rank_program.py <steps> <hold_s>
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from slurmkit import userapi

DEEP = b"[" * 100_000 + b"]" * 100_000
HUGE = b"9" * 5000
BEATS: dict[str, bytes | None] = {  # None: a FIFO
    "null": b"null", "number": b"5", "deep": DEEP,
    "huge step": b'{"generation": 0, "step": ' + HUGE + b', "time": 1e9}',
    "not utf-8": b"\xff\xfe\x00{", "fifo": None,
}
SPOOL_LINES = [
    b'{"t": 1.0, "event": "train_started", "step": ' + HUGE + b"}",
    b'{"t": 1.0, "event": "ckpt_saved", "step": 1, "x": ' + DEEP + b"}",
    b"null", b"\xff\xfe garbage",
    b'{"t": 1.0, "event": "train_started", "step": "one"}',
    b'{"t": 1.0, "event": "train_started", "step": 1, "pad": "' + b"x" * (300 * 1024) + b'"}',
]


def _replace(path: str, data: bytes | None) -> None:
    """Put ``data`` (None: a FIFO) at ``path`` atomically, as a beat is written."""
    tmp = f"{path}.hostile.{os.getpid()}"
    if data is None:
        os.mkfifo(tmp, 0o600)
    else:
        with open(tmp, "wb") as f:
            f.write(data)
    os.replace(tmp, path)


def main() -> int:
    steps, hold_s = int(sys.argv[1]), float(sys.argv[2])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    beat, spool = os.environ["SLURMKIT_HEARTBEAT_FILE"], os.environ["SLURMKIT_EVENTS_FILE"]
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    hostile = iter(BEATS.items())
    for step in range(1, steps + 1):
        t = torch.ones(1)
        dist.all_reduce(t)
        userapi.report_step(step)
        kind = next(hostile, None)
        if kind is not None:
            _replace(beat, kind[1])
            print(f"rank {rank}: heartbeat is now {kind[0]}", flush=True)
            time.sleep(hold_s)
        if step == 2:
            os.makedirs(os.path.dirname(spool), exist_ok=True)
            with open(spool, "ab") as f:
                f.write(b"\n".join(SPOOL_LINES) + b"\n")
            if rank == 0:
                userapi.report_checkpoint(step, None)  # a valid event after the garbage
    if rank == world - 1:
        _replace(spool, None)
    dist.barrier()
    if rank == 0:
        with open(os.path.join(os.environ["SLURMKIT_RUN_DIR"], "hostile_done.json"), "w") as f:
            json.dump({"step": steps, "beats": list(BEATS)}, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
