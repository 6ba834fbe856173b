"""Rendezvous of the node agents: a TCPStore on node 0, found through the run directory.

Node 0's agent listens on a free port and publishes address and port in a file of the run
directory (which every node sees), keyed by the job attempt so a requeued job never reads a
stale address. The other agents wait for that file, then talk through the store.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from slurmkit.errors import SlurmkitError
from slurmkit.launch.context import NodeContext

log = logging.getLogger(__name__)


def _publish(path: str, payload: dict[str, object]) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(payload, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def connect(ctx: NodeContext, run_dir: str, *, timeout_s: float = 300.0,
            clock: Callable[[], float] = time.monotonic,
            sleep: Callable[[float], None] = time.sleep) -> dist.TCPStore:
    """Return the agents' shared store; node 0 hosts it."""
    d = os.path.join(run_dir, "rdzv")
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, f"{ctx.attempt}.json")
    timeout = timedelta(seconds=timeout_s)
    if ctx.node_rank == 0:
        store = dist.TCPStore("0.0.0.0", 0, ctx.num_nodes, True, timeout=timeout,
                              wait_for_workers=False, use_libuv=True)
        _publish(path, {"addr": ctx.master_addr, "port": store.port, "pid": os.getpid()})
        log.info("agent store listening on %s:%d", ctx.master_addr, store.port)
        return store
    deadline = clock() + timeout_s
    while not os.path.exists(path):
        if clock() > deadline:
            raise SlurmkitError(
                f"Detected: no rendezvous file {path} after {timeout_s:.0f} s. Requirement: node 0's "
                "agent publishes it in the run directory. Fix: put submit.run_root on a file system "
                "every node sees, and check node 0's agent log.")
        sleep(0.2)
    with open(path) as f:
        info = json.load(f)
    return dist.TCPStore(info["addr"], int(info["port"]), ctx.num_nodes, False, timeout=timeout,
                         use_libuv=True)
