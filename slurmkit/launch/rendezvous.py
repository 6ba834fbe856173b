"""Rendezvous of the node agents: a TCPStore on node 0, found through the run directory.

Node 0's agent listens on a free port and publishes address and port in a file of the run
directory (which every node sees), keyed by the job attempt so a requeued job never reads a
stale address. The other agents wait for that file, then talk through the store.

The store listens only on the address the nodes use to reach node 0 (``master_addr``), not on
every interface: a socket bound there is handed to the TCPStore (its own server would bind
0.0.0.0). Before publishing, node 0 makes sure the run's channel token exists
(slurmkit.supervise.channel), so a follower that sees the file also finds the token.

torch's TCPStore server keeps whatever any client sets, without a quota, and anyone on the
network can connect: a stranger once grew node 0's agent by 200 MiB. So the server runs in a
child process forked from node 0's agent, whose data segment may grow by STORE_CAP_BYTES at
most (RLIMIT_DATA): a flood beyond it is refused message by message (the server drops that
client's connection) and never takes memory from the agent or its ranks. It does not keep a
stranger from filling the store up to the cap, after which the agents' own writes fail too:
the run's coordination can still be denied, node 0 cannot be run out of memory through it.
The server and node 0's agent live and die together: the server ends when the agent's process
is gone, and the agent kills itself when the server ends (a server killed alone, by the OOM
killer say, must not leave an agent that requeues beside the nodes that saw node 0 lost).
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import resource
import select
import signal
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from slurmkit.atomic import atomic_write
from slurmkit.errors import SlurmkitError
from slurmkit.launch.context import NodeContext
from slurmkit.listen import listen_socket
from slurmkit.runfiles import RDZV_DIR
from slurmkit.supervise.channel import load_token

log = logging.getLogger(__name__)

_KEEPALIVE: list[int] = []  # the write ends of the store children's pipes: closed at exit
# What the agents' store may hold beyond its start: the agents' messages are KiBs per node.
STORE_CAP_BYTES = 256 << 20
_SERVER_START_S = 60.0
STORE_COMM = "slurmkit-store"  # the server's process name (/proc/PID/comm)


def _publish(path: str, payload: dict[str, object]) -> None:
    atomic_write(path, json.dumps(payload), mode=None)


def _vm_data() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    return 0


def _name_self(name: str) -> None:
    """Set this process's name (/proc/PID/comm), so that tools that look for the agent by its
    command line can tell its store's server apart (both run submitit's entry point)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass  # only a name: the server works without it


def _die_with(pid: int) -> None:
    """In node 0's agent: when its store's server ends, end this agent at once, as if it had
    been killed. The store and node 0's agent live and die together, so exactly one side acts:
    the other nodes see node 0 lost and requeue once. An agent that outlived its store would
    requeue too, and the run would get two successor jobs."""
    try:
        _, status = os.waitpid(pid, 0)
        why = f"wait status {status}"
    except ChildProcessError:
        why = "already reaped"
    log.error("the agents' store server (pid %d) ended (%s): node 0's agent ends with it", pid, why)
    for h in logging.getLogger().handlers:
        h.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _serve_child(sock: socket.socket, world: int | None, ready: int, alive: int,
                 cap_bytes: int) -> None:
    """In the forked child: the store's server on ``sock`` and nothing else, until the agent
    (the write end of ``alive``) is gone."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)  # the agent decides when its node stops; not Slurm
    _name_self(STORE_COMM)
    keep = {0, 1, 2, sock.fileno(), ready, alive}
    for name in os.listdir("/proc/self/fd"):
        if int(name) not in keep:
            try:
                os.close(int(name))
            except OSError:
                pass  # the listing's own descriptor
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # a few sockets per agent
    addr, port = sock.getsockname()[:2]
    store = dist.TCPStore(addr, port, world, True, timeout=timedelta(seconds=60),
                          wait_for_workers=False, master_listen_fd=sock.fileno(), use_libuv=True)
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    limit = _vm_data() + cap_bytes
    resource.setrlimit(resource.RLIMIT_DATA, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))
    os.write(ready, b"1")
    os.close(ready)
    while os.read(alive, 1):  # EOF once the agent's process is gone
        pass
    del store


def serve_capped(sock: socket.socket, world: int | None, cap_bytes: int = STORE_CAP_BYTES) -> int:
    """Serve a TCPStore on the listening ``sock`` from a child process whose memory may grow
    by ``cap_bytes`` at most; return once it serves (its pid). The child lives as long as this
    process (a pipe only this process holds); this process' copy of ``sock`` is closed."""
    ready_r, ready_w = os.pipe()
    alive_r, alive_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child; os._exit keeps the agent's exit handlers out
        code = 1
        try:
            os.close(ready_r)
            os.close(alive_w)
            _serve_child(sock, world, ready_w, alive_r, cap_bytes)
            code = 0
        finally:
            os._exit(code)
    os.close(ready_w)
    os.close(alive_r)
    sock.close()
    _KEEPALIVE.append(alive_w)
    try:
        readable, _, _ = select.select([ready_r], [], [], _SERVER_START_S)
        started = bool(readable) and os.read(ready_r, 1) == b"1"
    finally:
        os.close(ready_r)
    if started:
        threading.Thread(target=_die_with, args=(pid,), name="slurmkit-store-watch", daemon=True).start()
    if not started:
        raise SlurmkitError(
            f"Detected: the agents' store server (pid {pid}) did not start within "
            f"{_SERVER_START_S:.0f} s. Requirement: node 0's agent can fork its store's server. "
            "Fix: check node 0's agent log and the node's process and memory limits.")
    return pid


def connect(ctx: NodeContext, run_dir: str, *, timeout_s: float = 300.0,
            clock: Callable[[], float] = time.monotonic,
            sleep: Callable[[float], None] = time.sleep) -> dist.TCPStore:
    """Return the agents' shared store; node 0 hosts it."""
    d = os.path.join(run_dir, RDZV_DIR)
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, f"{ctx.attempt}.json")
    timeout = timedelta(seconds=timeout_s)
    if ctx.node_rank == 0:
        load_token(run_dir, create=True)
        sock = listen_socket(ctx.master_addr, backlog=max(1024, 3 * ctx.num_nodes))
        port = sock.getsockname()[1]
        serve_capped(sock, ctx.num_nodes)  # the server in a capped child: a flood cannot grow us
        store = dist.TCPStore(ctx.master_addr, port, ctx.num_nodes, False, timeout=timeout,
                              use_libuv=True)
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
