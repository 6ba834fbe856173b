"""Node 0's view of checkpoint progress, from the checkpoint store itself.

The crash-loop rule (slurmkit.supervise.policy.decide) needs the newest committed step. It is
read from the tiers' ``latest.json`` (which moves only after that step's manifest verified),
not by parsing the ledger: at 2,048 nodes the ledger is large and shared, and a decision must
not wait on it. A background thread refreshes the value; ``latest`` asks for a fresh read and
waits for it at most ``wait_s``, so a slow file system or object store delays a decision by at
most that bound (the last value read is used then).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

log = logging.getLogger(__name__)

#: One read of the newest committed step of one tier (None: nothing committed or unreadable).
StepReader = Callable[[], "int | None"]


class CheckpointProgress:
    def __init__(self, readers: Sequence[StepReader], *, refresh_s: float = 5.0) -> None:
        self._readers = list(readers)
        self._refresh_s = refresh_s
        self._best: int | None = None
        self._lock = threading.Lock()
        self._wanted = threading.Event()
        self._fresh = threading.Event()
        self._thread: threading.Thread | None = None

    def _read_once(self) -> None:
        for read in self._readers:
            try:
                step = read()
            except Exception as exc:  # noqa: BLE001 - an unreadable tier gives no progress, never an error
                log.warning("checkpoint progress: %s", exc)
                continue
            if step is not None:
                with self._lock:
                    self._best = step if self._best is None else max(self._best, step)

    def _loop(self) -> None:
        while True:
            self._wanted.wait(self._refresh_s)
            self._wanted.clear()
            self._read_once()
            self._fresh.set()

    def start(self) -> "CheckpointProgress":
        self._thread = threading.Thread(target=self._loop, name="ckpt-progress", daemon=True)
        self._thread.start()
        return self

    def latest(self, wait_s: float = 2.0) -> int | None:
        """The newest committed step seen; refreshed first when that takes under ``wait_s``."""
        if self._thread is None:
            self._read_once()
        else:
            self._fresh.clear()
            self._wanted.set()
            self._fresh.wait(wait_s)
        with self._lock:
            return self._best

    def peek(self) -> int | None:
        """The newest committed step read so far, without waiting (a fresh read is asked for,
        and the next call sees it): for a loop that must not block on a slow tier."""
        if self._thread is None:
            self._read_once()
        else:
            self._wanted.set()
        with self._lock:
            return self._best


def tier_readers(store_cfg: object, env: dict[str, str], node_name: str) -> list[StepReader]:
    """``latest.json`` readers of the run's tiers as node 0 sees them: its own NVMe directory,
    the shared file system and the object store (slurmkit.store builds the same URIs)."""
    from slurmkit.store.catalog import read_latest
    from slurmkit.store.config import StoreConfig, store_env
    from slurmkit.store.tier import make_tier

    assert isinstance(store_cfg, StoreConfig)  # noqa: S101 - typed by the caller's config
    env = store_env(store_cfg, env)
    uris = []
    if store_cfg.nvme_uri:
        uris.append(("nvme", f"{store_cfg.nvme_uri.rstrip('/')}/{node_name}", ""))
    if store_cfg.lustre_uri:
        uris.append(("lustre", store_cfg.lustre_uri, ""))
    if store_cfg.object_uri:
        uris.append(("object", store_cfg.object_uri, store_cfg.s3_profile))
    readers: list[StepReader] = []
    for name, uri, profile in uris:
        def read(name: str = name, uri: str = uri, profile: str = profile) -> int | None:
            return read_latest(make_tier(name, uri, env, profile))
        readers.append(read)
    return readers
