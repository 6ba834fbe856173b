"""Rendezvous of the node agents: a TCPStore on node 0, found through the run directory.

Node 0's agent listens on a free port and publishes address and port in a file of the run
directory (which every node sees), keyed by the job attempt so a requeued job never reads a
stale address. The other agents wait for that file, then talk through the store.

The store listens only on the address the nodes use to reach node 0 (``master_addr``), not on
every interface: a socket bound there is handed to the TCPStore (its own server would bind
0.0.0.0). Before publishing, node 0 makes sure the run's channel token exists
(slurmkit.supervise.channel), so a follower that sees the file also finds the token.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from slurmkit.errors import SlurmkitError
from slurmkit.launch.context import NodeContext
from slurmkit.supervise.channel import load_token

log = logging.getLogger(__name__)

_LISTENING: list[socket.socket] = []


def _publish(path: str, payload: dict[str, object]) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(payload, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def listen_socket(addr: str, backlog: int = 1024, port: int = 0) -> socket.socket:
    """A listening TCP socket on ``addr`` (``port``, or a free one), for a store's server.
    ``backlog``: connections the kernel queues before the server accepts them (every agent
    connects at once, several times; the kernel caps it at net.core.somaxconn)."""
    try:
        infos = socket.getaddrinfo(addr, 0, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise SlurmkitError(
            f"Detected: cannot resolve node 0's address {addr!r} ({exc}). Requirement: the address "
            "the nodes use to reach node 0 (SLURM_LAUNCH_NODE_IPADDR). Fix: check the node's name "
            "resolution, or the cluster's network settings.") from None
    family, _, _, _, sockaddr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((sockaddr[0], port))
    except OSError as exc:
        sock.close()
        raise SlurmkitError(
            f"Detected: cannot listen on {addr}:{port or 'a free port'} ({exc}). Requirement: "
            "an address of this host that the other nodes reach (and a free port). Fix: check "
            "SLURM_LAUNCH_NODE_IPADDR on the batch host (the ranks' MASTER_ADDR).") from None
    sock.listen(backlog)
    return sock


def connect(ctx: NodeContext, run_dir: str, *, timeout_s: float = 300.0,
            clock: Callable[[], float] = time.monotonic,
            sleep: Callable[[float], None] = time.sleep) -> dist.TCPStore:
    """Return the agents' shared store; node 0 hosts it."""
    d = os.path.join(run_dir, "rdzv")
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, f"{ctx.attempt}.json")
    timeout = timedelta(seconds=timeout_s)
    if ctx.node_rank == 0:
        load_token(run_dir, create=True)
        sock = listen_socket(ctx.master_addr, backlog=max(1024, 3 * ctx.num_nodes))
        store = dist.TCPStore(ctx.master_addr, sock.getsockname()[1], ctx.num_nodes, True, timeout=timeout,
                              wait_for_workers=False, master_listen_fd=sock.fileno(), use_libuv=True)
        _LISTENING.append(sock)  # the store serves on this fd for the life of the process
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
