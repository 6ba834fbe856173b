"""Who acts for node 0 once it is lost: one successor, elected through the run directory.

Node 0's loss takes the agents' store (and with it every channel between the agents) away, so
the survivors cannot agree through it. They agree through one file of the run directory
instead, touched only on this failure path, never in the step loop: node rank k leaves the
ranks below it k-1 grace periods to claim the succession, then claims it itself with an
exclusive create. The agent whose create succeeds is the successor; every other one sees the
file and leaves. Node rank 1 claims at once, so while it lives the others only look for the
file; with node rank 1 lost as well, node rank 2 acts one grace period later, and so on: no
second loss leaves the job without someone to record the failure and requeue it.

The file is keyed by the attempt, like the rendezvous file, so a requeued job starts clean.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable

#: Longest pause between two looks for a lower rank's claim (the grace period is the bound).
MAX_POLL_S = 1.0


def claim_path(run_dir: str, attempt: str) -> str:
    return os.path.join(run_dir, "rdzv", f"{attempt}.successor")


def read_claim(path: str) -> str:
    """Who claimed (``node (node rank k)``), for messages; "" when unreadable or still empty."""
    try:
        with open(path) as f:
            data = json.load(f)
        return f"{data['node']} (node rank {int(data['node_rank'])})"
    except (OSError, ValueError, KeyError, TypeError):
        return ""


def elect(path: str, node_rank: int, node: str, *, grace_s: float,
          clock: Callable[[], float] = time.monotonic,
          sleep: Callable[[float], None] = time.sleep) -> bool:
    """True when this agent (``node_rank`` >= 1) is node 0's successor.

    It waits ``(node_rank - 1) * grace_s`` for a claim by a lower node rank, then claims with
    O_CREAT|O_EXCL: of any agents that try at once exactly one wins, on a local disk and on
    NFS v3+ or Lustre alike.
    """
    deadline = clock() + max(node_rank - 1, 0) * grace_s
    poll_s = min(max(grace_s / 4, 0.01), MAX_POLL_S)
    while not os.path.exists(path):
        left = deadline - clock()
        if left <= 0:
            break
        sleep(min(poll_s, left))
    else:
        return False
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        json.dump({"node_rank": node_rank, "node": node, "pid": os.getpid(), "t": time.time()}, f)
    return True
