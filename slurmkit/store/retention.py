"""Retention: keep the newest N deep-verified steps per tier, and clean up what never committed.

Safety rules:
  * only deep-verified steps count (``verified``: checksums, not a manifest's presence), so
    a silently corrupted newer step never pushes an older good one out;
  * a step is deleted only when ``keep`` newer deep-verified steps stay on the same tier, so
    every tier keeps its newest deep-verified step;
  * ``protected`` steps are never deleted (the newest save still awaiting a promotion: until
    it lands elsewhere this may be its only verified copy; a step being copied right now);
  * a committed step is made invisible first (manifest removed, or the directory renamed into
    ``.trash``) and only then deleted, so a half-deleted step never looks restorable;
  * unverified leftovers (killed saves, withdrawn corrupt ones, staged promotions) are
    removed only when older than the newest verified step (a slower rank may still be
    writing a newer one).
"""

from __future__ import annotations

import contextlib
import logging
import os
import uuid
from collections.abc import Callable

from slurmkit.store import nofollow
from slurmkit.store.catalog import check_step, list_steps
from slurmkit.store.manifest import MANIFEST, PARTIAL, parse_step_dir, step_dir
from slurmkit.store.tier import Tier, TierError

log = logging.getLogger(__name__)
TRASH = ".trash"


def _delete_step(tier: Tier, name: str) -> None:
    root = tier.local_path("")
    if root is not None and nofollow.is_link(root, name):
        # a link placed where a step belongs: remove the link, never what it points at
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(root, name))
        return
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


def _committed(tier: Tier, step: int) -> bool:
    """The step has a manifest (read through no link on a local tier)."""
    root = tier.local_path("")
    if root is None:
        return tier.exists(f"{step_dir(step)}/{MANIFEST}")
    try:
        nofollow.size(root, f"{step_dir(step)}/{MANIFEST}")
    except OSError:
        return False
    return True


def _partial_step(name: str) -> int | None:
    return parse_step_dir(name.split(".", 1)[0])


def gc_tier(tier: Tier, keep: int, protected: set[int],
            verified: Callable[[int], bool] | None = None) -> list[int]:
    """Apply retention to one tier; return the committed steps deleted.

    ``verified(step)``: the step deep-verifies on this tier (the caller caches what it knows;
    asked newest first, only until ``keep`` steps verified). None: every checksum is read
    back here (the CLI).
    """
    if verified is None:
        def verified(s: int) -> bool:
            return check_step(tier, s, deep=True).ok
    steps = list_steps(tier)
    kept: list[int] = []
    deleted = []
    for s in steps:
        if len(kept) < keep:
            if verified(s):
                kept.append(s)
            elif kept and s not in protected:  # unverified, older than a verified step
                log.info("retention removes unverified step %d on %s", s, tier.uri)
                _delete_step(tier, step_dir(s))
            continue
        if s in protected:
            log.info("retention keeps step %d on %s: a promotion still needs it", s, tier.uri)
            continue
        committed = _committed(tier, s)
        _delete_step(tier, step_dir(s))
        if committed:
            deleted.append(s)
    newest = kept[0] if kept else None
    for name in tier.ls(PARTIAL):
        ps = _partial_step(name)
        if ps is not None and newest is not None and ps < newest and ps not in protected:
            tier.rm(f"{PARTIAL}/{name}", recursive=True)
    if tier.renames_atomically():
        tier.rm(TRASH, recursive=True)
    if deleted:
        log.info("retention on %s deleted steps %s (keep %d deep-verified: %s)", tier.uri,
                 deleted, keep, kept)
    return deleted
