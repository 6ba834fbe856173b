"""Tiered, asynchronous, verified checkpoints (NVMe -> Lustre -> object store).

    store = CheckpointStore.from_config(cfg, rank=r, world_size=w, node=host, env=os.environ)
    handle = store.save(step, state)      # returns after the snapshot
    result = store.restore(template)      # newest verified step, loaded in place
"""

from slurmkit.store.config import StoreConfig
from slurmkit.store.restore import RestoreError, RestoreResult
from slurmkit.store.store import CheckpointStore, SaveHandle
from slurmkit.store.tier import FsspecTier, Tier, TierError, make_tier

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
