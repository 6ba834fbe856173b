"""The persistent promotion queue of one rank: a JSON file that survives a process restart."""

from __future__ import annotations

import json
import logging
import os
import threading
import uuid

log = logging.getLogger(__name__)


class PromotionQueue:
    """Ordered (step, dest tier) entries; every change is written through atomically.

    ``path`` None keeps the queue in memory (no local tier to hold it).
    """

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._entries: list[tuple[int, str]] = self._load()

    def _load(self) -> list[tuple[int, str]]:
        if self.path is None or not os.path.exists(self.path):
            return []
        try:
            with open(self.path) as f:
                data = json.load(f)
            return [(int(e["step"]), str(e["dest"])) for e in data["pending"]]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.error("promotion queue %s unreadable, starting empty: %s", self.path, exc)
            return []

    def _persist(self) -> None:
        try:
            self._write()
        except OSError as exc:  # e.g. a full disk: keep the queue in memory, say so
            log.error("promotion queue %s not persisted: %s", self.path, exc)

    def _write(self) -> None:
        if self.path is None:
            return
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        tmp = f"{self.path}.tmp-{uuid.uuid4().hex[:8]}"
        with open(tmp, "w") as f:
            json.dump({"pending": [{"step": s, "dest": d} for s, d in self._entries]}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def add(self, step: int, dest: str) -> None:
        with self._lock:
            if (step, dest) not in self._entries:
                self._entries.append((step, dest))
                self._entries.sort()
                self._persist()

    def remove(self, step: int, dest: str) -> None:
        with self._lock:
            if (step, dest) in self._entries:
                self._entries.remove((step, dest))
                self._persist()

    def entries(self) -> list[tuple[int, str]]:
        with self._lock:
            return list(self._entries)


def referenced_steps(queue_dir: str | None) -> set[int]:
    """Steps referenced by any rank's queue file in ``queue_dir`` (all ranks of a node)."""
    if queue_dir is None or not os.path.isdir(queue_dir):
        return set()
    steps: set[int] = set()
    for name in os.listdir(queue_dir):
        if name.endswith(".json"):
            steps.update(s for s, _ in PromotionQueue(os.path.join(queue_dir, name)).entries())
    return steps
