"""Tiered, asynchronous, verified checkpoints (NVMe -> Lustre -> object store).

    store = CheckpointStore.from_config(cfg, rank=r, world_size=w, node=host, env=os.environ)
    handle = store.save(step, state)      # returns after the snapshot
    result = store.restore(template)      # newest verified step, loaded in place

Only the config schema is imported eagerly: `python -m slurmkit.submit` needs StoreConfig but
not torch.distributed.checkpoint (about 2 s of imports on a small machine).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from slurmkit.store.config import StoreConfig

if TYPE_CHECKING:
    from slurmkit.store.restore import RestoreError, RestoreResult
    from slurmkit.store.store import CheckpointStore, SaveHandle
    from slurmkit.store.tier import FsspecTier, Tier, TierError, make_tier

_LAZY = {
    "RestoreError": "slurmkit.store.restore", "RestoreResult": "slurmkit.store.restore",
    "CheckpointStore": "slurmkit.store.store", "SaveHandle": "slurmkit.store.store",
    "FsspecTier": "slurmkit.store.tier", "Tier": "slurmkit.store.tier",
    "TierError": "slurmkit.store.tier", "make_tier": "slurmkit.store.tier",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'slurmkit.store' has no attribute {name!r}")


__all__ = [
    "CheckpointStore",
    "FsspecTier",
    "RestoreError",
    "RestoreResult",
    "SaveHandle",
    "StoreConfig",
    "Tier",
    "TierError",
    "make_tier",
]
