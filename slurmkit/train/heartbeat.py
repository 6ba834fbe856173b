"""A per-rank heartbeat file that a supervisor reads without touching the training process.

Any training script can use it: ``Heartbeat.from_env(rank)`` then ``hb.beat(step)`` once per
step. The file is replaced atomically (write a temporary file, then ``os.replace``), so a
reader sees either the previous beat or the new one, never a torn JSON document.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping
from typing import Any


def heartbeat_path(env: Mapping[str, str], rank: int) -> str | None:
    """$SLURMKIT_HEARTBEAT_FILE, else $SLURMKIT_RUN_DIR/heartbeat/rank<RANK>.json, else None."""
    explicit = env.get("SLURMKIT_HEARTBEAT_FILE")
    if explicit:
        return explicit
    run_dir = env.get("SLURMKIT_RUN_DIR")
    if run_dir:
        return os.path.join(run_dir, "heartbeat", f"rank{rank}.json")
    return None


class Heartbeat:
    """Writes ``{"rank", "step", "time", "pid", "generation"}`` to ``path`` on every beat."""

    def __init__(self, path: str, *, rank: int, generation: int = 0,
                 clock: Callable[[], float] = time.time, pid: int | None = None) -> None:
        self.path = path
        self.rank = rank
        self.generation = generation
        self._clock = clock
        self._pid = os.getpid() if pid is None else pid
        self._tmp = f"{path}.tmp.{self._pid}"
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    @classmethod
    def from_env(cls, env: Mapping[str, str], rank: int) -> Heartbeat | None:
        """The heartbeat the node agent asked for, or None when no path is configured."""
        path = heartbeat_path(env, rank)
        if path is None:
            return None
        return cls(path, rank=rank, generation=int(env.get("SLURMKIT_GENERATION", "0")))

    def beat(self, step: int, **extra: Any) -> dict[str, Any]:
        """Record that ``step`` optimizer steps are complete; returns the written record."""
        record: dict[str, Any] = {
            "rank": self.rank,
            "step": step,
            "time": round(self._clock(), 6),
            "pid": self._pid,
            "generation": self.generation,
        }
        record.update(extra)
        with open(self._tmp, "w", encoding="utf-8") as f:
            json.dump(record, f)
        os.replace(self._tmp, self.path)
        return record


def read_heartbeat(path: str) -> dict[str, Any] | None:
    """The last beat at ``path``, or None if there is none yet."""
    try:
        with open(path, encoding="utf-8") as f:
            return dict(json.load(f))
    except FileNotFoundError:
        return None
