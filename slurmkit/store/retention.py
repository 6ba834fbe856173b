"""Retention: keep the newest N verified steps per tier, and clean up what never committed.

Safety rules:
  * a step that any promotion queue still references is never deleted (the promotion may be
    reading it, and until it lands elsewhere this may be its only verified copy);
  * a committed step is made invisible first (manifest removed, or the directory renamed into
    ``.trash``) and only then deleted, so a half-deleted step never looks restorable;
  * unverified leftovers (killed saves) are removed only when older than the newest verified
    step and not referenced by a queue (a slower rank may still be writing a newer one).
"""

from __future__ import annotations

import logging
import uuid

from slurmkit.store.catalog import list_steps
from slurmkit.store.manifest import MANIFEST, PARTIAL, parse_step_dir, step_dir
from slurmkit.store.tier import Tier, TierError

log = logging.getLogger(__name__)
TRASH = ".trash"


def _delete_step(tier: Tier, name: str) -> None:
    if tier.renames_atomically():
        trash = f"{TRASH}/{name}.{uuid.uuid4().hex[:8]}"
        try:
            tier.commit(name, trash)
        except TierError:
            return  # another rank of this node removed it first
        tier.rm(trash, recursive=True)
    else:
        tier.rm(f"{name}/{MANIFEST}")
        tier.rm(name, recursive=True)


def _partial_step(name: str) -> int | None:
    return parse_step_dir(name.split(".", 1)[0])


def gc_tier(tier: Tier, keep: int, protected: set[int], verified: list[int] | None = None
            ) -> list[int]:
    """Apply retention to one tier; return the committed steps deleted.

    ``verified``: the steps that verify on this tier, newest first (computed by the caller,
    which already knows them; None = a step counts as verified when its manifest exists).
    """
    steps = list_steps(tier)
    if verified is None:
        verified = [s for s in steps if tier.exists(f"{step_dir(s)}/{MANIFEST}")]
    newest = verified[0] if verified else None
    deleted = []
    for s in verified[keep:]:
        if s in protected:
            log.info("retention keeps step %d on %s: a promotion still needs it", s, tier.uri)
            continue
        _delete_step(tier, step_dir(s))
        deleted.append(s)
    for s in steps:
        if s not in verified and newest is not None and s < newest and s not in protected:
            log.info("retention removes unverified step %d on %s", s, tier.uri)
            _delete_step(tier, step_dir(s))
    if tier.renames_atomically():
        for name in tier.ls(PARTIAL):
            ps = _partial_step(name)
            if ps is not None and newest is not None and ps < newest and ps not in protected:
                tier.rm(f"{PARTIAL}/{name}", recursive=True)
        tier.rm(TRASH, recursive=True)
    if deleted:
        log.info("retention on %s deleted steps %s (keep %d)", tier.uri, deleted, keep)
    return deleted
