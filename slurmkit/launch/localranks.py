"""Start the trainer's ranks as local processes with the node agent's environment contract.

For tests, benchmarks and a laptop: the same ``python -m slurmkit.train`` ranks and the same
variables the node agent sets (RANK ... MASTER_PORT, SLURMKIT_*), without an agent.

As the agent does (slurmkit.launch.forkserver), the ranks are forked from a fork server that
imported the trainer once: one server per process and environment, kept for the next launch,
so a test that launches three runs of two ranks pays Python's and torch's start-up once, not
six times. Each rank is this process's child (it is a subreaper only while a fork is made, so
nothing else it started is reparented to it), with the same environment, output file and exit
code as a rank started cold. Where the server cannot fork, the rank starts cold.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from omegaconf import OmegaConf

from slurmkit.errors import ConfigError
from slurmkit.failures.programs import REFERENCE_TRAINER
from slurmkit.launch import forkserver
from slurmkit.runfiles import LEDGER_NAME, LOGS_DIR
from slurmkit.train.heartbeat import LocalDirError, local_heartbeat_path

log = logging.getLogger(__name__)
SERVER_READY_S = 120.0  # its imports take seconds; a server slower than this is not used
FORK_ANSWER_S = 30.0
MAX_SERVERS = 4  # one per distinct environment; the oldest goes first
# Set by the launching process per call and read by no rank: pytest names its current test.
CALLER_NAMES = frozenset({"PYTEST_CURRENT_TEST"})


class RankProcess(Protocol):
    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def send_signal(self, signum: int) -> None: ...
    def kill(self) -> None: ...


def free_port() -> int:
    """A TCP port that was free a moment ago (the rendezvous binds it right after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_config(path: str, sections: Mapping[str, object]) -> str:
    """Freeze ``{"model": {...}, "train": {...}, ...}`` to YAML at ``path``; returns path."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(OmegaConf.to_yaml(OmegaConf.create(dict(sections))))
    return path


@dataclass
class LocalRun:
    """The rank processes of one local launch; ``logs[r]`` is rank r's combined output file."""

    procs: list[RankProcess]
    logs: list[str]
    run_dir: str
    extra_env: dict[str, str] = field(default_factory=dict)
    server_pid: int | None = None  # the fork server its ranks were forked from, if any

    def wait(self, timeout_s: float, *, clock: Callable[[], float] = time.monotonic,
             sleep: Callable[[float], None] = time.sleep) -> list[int]:
        """Return codes of all ranks; kills every rank and raises TimeoutError on timeout."""
        deadline = clock() + timeout_s
        while any(p.poll() is None for p in self.procs):
            if clock() > deadline:
                self.kill()
                raise TimeoutError(f"ranks still running after {timeout_s} s:\n{self.tail()}")
            sleep(0.05)
        return [int(p.poll() or 0) for p in self.procs]  # every rank has exited: poll() is its code

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()

    def output(self, rank: int) -> str:
        with open(self.logs[rank], encoding="utf-8", errors="replace") as f:
            return f.read()

    def tail(self, chars: int = 3000) -> str:
        return "\n".join(f"--- rank {r} ---\n{self.output(r)[-chars:]}"
                         for r in range(len(self.procs)))


_servers: dict[tuple[str, frozenset[tuple[str, str]]], forkserver.ForkServer] = {}
_servers_lock = threading.Lock()


def _key(env: Mapping[str, str]) -> tuple[str, frozenset[tuple[str, str]]]:
    """What a server's directory and environment must equal for a rank to be forked from it."""
    return os.getcwd(), frozenset((k, v) for k, v in env.items()
                                  if not forkserver.may_differ(k) and k not in CALLER_NAMES)


def stop_servers() -> None:
    """End every fork server this process keeps (also at its exit)."""
    with _servers_lock:
        servers = list(_servers.values())
        _servers.clear()
    for server in servers:
        server.stop()


def _server_for(env: Mapping[str, str]) -> forkserver.ForkServer | None:
    """A ready fork server started with an environment ``env`` may differ from only in a rank's
    identity; started (and waited for) if there is none. None where none can fork."""
    key = _key(env)
    with _servers_lock:
        server = _servers.get(key)
        if server is not None and server.refused() is None:
            return server
        if server is not None:
            _servers.pop(key).stop()
        if len(_servers) >= MAX_SERVERS:
            _servers.pop(next(iter(_servers))).stop()
        try:
            server = forkserver.ForkServer.start(env, cwd=None, parent=os.getpid(), subreaper=False)
        except OSError as exc:
            log.info("no fork server (%s): ranks start cold", exc)
            return None
        if not _servers:
            atexit.register(stop_servers)
        _servers[key] = server
    why = server.why_not(SERVER_READY_S)
    if why is not None:
        log.info("the fork server cannot fork (%s): ranks start cold", why)
        return None
    return server


def _fork(server: forkserver.ForkServer, env: Mapping[str, str], output: int) -> RankProcess | None:
    """The rank forked as this process's child (a subreaper only for the fork); None if not."""
    if not forkserver.set_subreaper(True):
        return None
    try:
        return server.fork(env, [], plan_json=None, verify="off", timeout_s=FORK_ANSWER_S, output=output,
                           also_differ=CALLER_NAMES)
    except forkserver.ForkServerError as exc:
        log.info("the fork server did not fork a rank (%s): it starts cold", exc)
        return None
    finally:
        forkserver.set_subreaper(False)


def spawn_ranks(config_path: str, run_dir: str, world_size: int, *,
                env: Mapping[str, str] | None = None, generation: int = 0, nodes: int = 1,
                python: str = sys.executable, fork: bool = True) -> LocalRun:
    """Start ``world_size`` ranks of ``python -m slurmkit.train`` on this machine.

    ``nodes > 1`` emulates that many nodes of ``world_size // nodes`` consecutive ranks each:
    LOCAL_RANK and LOCAL_WORLD_SIZE as on such a node, and SLURMKIT_NODE ``<name>-<i>`` (so
    each emulated node has its own node-local checkpoint tier, as the node agent gives it).
    With ``fork`` (and this interpreter) the ranks are forked from a kept fork server.
    """
    if nodes < 1 or world_size % nodes:
        raise ConfigError(detected=f"{world_size} ranks on {nodes} emulated nodes",
                          requirement="nodes >= 1 dividing the world size",
                          fix="pass a number of nodes that divides world_size")
    per_node = world_size // nodes
    base = dict(os.environ if env is None else env)
    node_name = base.get("SLURMKIT_NODE", socket.gethostname())
    port = free_port()
    os.makedirs(run_dir, exist_ok=True)
    procs: list[RankProcess] = []
    logs: list[str] = []
    server = None
    for rank in range(world_size):
        # A beat left by an earlier run at the same path would read as this rank's progress.
        with contextlib.suppress(OSError, LocalDirError):
            os.unlink(local_heartbeat_path(run_dir, rank, base))
        rank_env = {
            **base,
            "RANK": str(rank), "LOCAL_RANK": str(rank % per_node),
            "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(per_node),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "SLURMKIT_RUN_DIR": run_dir,
            "SLURMKIT_CONFIG": config_path, "SLURMKIT_GENERATION": str(generation),
            "SLURMKIT_NODE": node_name if nodes == 1 else f"{node_name}-{rank // per_node}",
            "SLURMKIT_LEDGER": base.get("SLURMKIT_LEDGER",
                                        os.path.join(run_dir, LEDGER_NAME)),
            # Two ranks share a few cores here: one thread each avoids oversubscription.
            "OMP_NUM_THREADS": base.get("OMP_NUM_THREADS", "1"),
        }
        log_path = os.path.join(run_dir, LOGS_DIR, f"gen{generation}-rank{rank}.log")
        os.makedirs(os.path.dirname(log_path), exist_ok=True)
        if fork and python == sys.executable and rank == 0:
            server = _server_for(rank_env)
        with open(log_path, "wb") as log_file:
            proc = None if server is None else _fork(server, rank_env, log_file.fileno())
            if proc is None:
                proc = subprocess.Popen([python, "-m", REFERENCE_TRAINER], env=rank_env,
                                        stdout=log_file, stderr=subprocess.STDOUT)
            procs.append(proc)
        logs.append(log_path)
    forked = server is not None and any(isinstance(p, forkserver.ForkedProc) for p in procs)
    return LocalRun(procs, logs, run_dir, server_pid=server.pid if forked and server is not None else None)
