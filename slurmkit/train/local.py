"""Start the trainer's ranks as local processes with the node agent's environment contract.

For tests, benchmarks and a laptop: the same ``python -m slurmkit.train`` processes and the
same variables the node agent sets (RANK ... MASTER_PORT, SLURMKIT_*), without an agent.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from omegaconf import OmegaConf

from slurmkit.errors import ConfigError
from slurmkit.failures.programs import REFERENCE_TRAINER
from slurmkit.runfiles import LEDGER_NAME, LOGS_DIR
from slurmkit.train.heartbeat import LocalDirError, local_heartbeat_path


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

    procs: list[subprocess.Popen[bytes]]
    logs: list[str]
    run_dir: str
    extra_env: dict[str, str] = field(default_factory=dict)

    def wait(self, timeout_s: float, *, clock: Callable[[], float] = time.monotonic,
             sleep: Callable[[float], None] = time.sleep) -> list[int]:
        """Return codes of all ranks; kills every rank and raises TimeoutError on timeout."""
        deadline = clock() + timeout_s
        while any(p.poll() is None for p in self.procs):
            if clock() > deadline:
                self.kill()
                raise TimeoutError(f"ranks still running after {timeout_s} s:\n{self.tail()}")
            sleep(0.05)
        return [int(p.returncode) for p in self.procs]

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


def spawn_ranks(config_path: str, run_dir: str, world_size: int, *,
                env: Mapping[str, str] | None = None, generation: int = 0, nodes: int = 1,
                python: str = sys.executable) -> LocalRun:
    """Start ``world_size`` ranks of ``python -m slurmkit.train`` on this machine.

    ``nodes > 1`` emulates that many nodes of ``world_size // nodes`` consecutive ranks each:
    LOCAL_RANK and LOCAL_WORLD_SIZE as on such a node, and SLURMKIT_NODE ``<name>-<i>`` (so
    each emulated node has its own node-local checkpoint tier, as the node agent gives it).
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
    procs, logs = [], []
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
        with open(log_path, "wb") as log_file:
            procs.append(subprocess.Popen([python, "-m", REFERENCE_TRAINER], env=rank_env,
                                          stdout=log_file, stderr=subprocess.STDOUT))
        logs.append(log_path)
    return LocalRun(procs, logs, run_dir)
