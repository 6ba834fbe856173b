"""Restore the newest step that verifies on some tier, into a template state, in place.

Per step (newest first, the union of every rank's view): each rank picks the fastest tier
whose copy verifies *deeply* (every file's checksum; local files are hashed in parallel;
remote copies are downloaded to a local directory in parallel byte ranges and hashed on the
way, see transfer.py), the ranks agree (all must succeed), and only then DCP reads
``.metadata`` (pickled by DCP: opened only after its checksum matched, and unpickled through
an allowlist, see safe_reader.py) and the shards (``weights_only``).
A step that fails anywhere is skipped with its reason and the next older one is tried.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch.distributed.checkpoint as dcp

from slurmkit.errors import SlurmkitError
from slurmkit.store.catalog import check_file, check_step, list_steps
from slurmkit.store.coord import Coordinator
from slurmkit.store.manifest import Manifest, step_dir
from slurmkit.store.safe_reader import SafeReader
from slurmkit.store.staging import JSON_PREFIX, apply_json, load_targets
from slurmkit.store.tier import Tier, TierError

log = logging.getLogger(__name__)
FILE_WORKERS = 4  # files of one step downloaded / hashed at the same time


class RestoreError(SlurmkitError):
    """A verified checkpoint does not fit the template (changed model or state layout)."""


@dataclass
class RestoreResult:
    step: int
    tier: str
    uri: str
    skipped: list[tuple[int, str]] = field(default_factory=list)


@dataclass
class Source:
    tier: Tier
    manifest: Manifest
    local_dir: str
    downloaded: bool


def candidate_steps(tiers: Sequence[Tier], coord: Coordinator) -> list[int]:
    mine: set[int] = set()
    for t in tiers:
        try:
            mine.update(list_steps(t))
        except TierError as exc:
            log.warning("cannot list %s: %s", t.uri, exc)
    union: set[int] = set()
    for steps in coord.all_gather_json(sorted(mine)):
        union.update(steps)
    return sorted(union, reverse=True)


def _download(tier: Tier, step: int, m: Manifest, scratch: str) -> tuple[str, str | None]:
    """Copy a remote step into ``scratch`` and check every checksum; (dir, problem)."""
    local = os.path.join(scratch, f"{tier.name}-{step_dir(step)}")
    os.makedirs(local, exist_ok=True)
    # largest first: the small .metadata must not hold a worker while shards wait
    files = sorted(m.files, key=lambda f: f.size, reverse=True)
    with ThreadPoolExecutor(max_workers=max(1, min(len(files), FILE_WORKERS))) as pool:
        got = list(pool.map(lambda f: tier.get_file_hashed(
            f"{step_dir(step)}/{f.name}", os.path.join(local, f.name), m.checksum_algo,
            f.size), files))
    for f, (digest, size) in zip(files, got):
        if size != f.size:
            return local, f"shard {f.name} has {size} bytes, manifest says {f.size}"
        if digest != f.checksum:
            return local, f"checksum mismatch in {f.name}"
    return local, None


def _verify_local(tier: Tier, step: int, m: Manifest) -> str | None:
    """Deep check of a local copy, files hashed in parallel; the first problem or None."""
    sizes = tier.sizes(step_dir(step))
    with ThreadPoolExecutor(max_workers=max(1, min(len(m.files), FILE_WORKERS))) as pool:
        problems = pool.map(lambda f: check_file(tier, step, f, m.checksum_algo, deep=True,
                                                 sizes=sizes), m.files)
        return next((p for p in problems if p), None)


def pick_source(tiers: Sequence[Tier], step: int, scratch: str) -> tuple[Source | None, str]:
    """The fastest tier whose copy of ``step`` verifies deeply, or None and every reason."""
    problems = []
    for t in tiers:
        st = check_step(t, step, deep=False)
        if not st.ok or st.manifest is None:
            problems.append(f"{t.name}: {st.problem}")
            continue
        m = st.manifest
        try:
            local = t.local_path(step_dir(step))
            if local is not None:
                bad = _verify_local(t, step, m)
                if bad is None:
                    return Source(t, m, local, False), ""
            else:
                local, bad = _download(t, step, m, scratch)
                if bad is None:
                    return Source(t, m, local, True), ""
                shutil.rmtree(local, ignore_errors=True)
        except TierError as exc:
            bad = str(exc)
        problems.append(f"{t.name}: {bad}")
    return None, "; ".join(problems) or "on no tier"


def load_into(template: dict[Any, Any], local_dir: str, coord: Coordinator) -> None:
    """DCP load from a verified local directory into ``template`` (tensors in place)."""
    reader = SafeReader(local_dir)
    md = reader.read_metadata()  # allowlisted unpickling, after its checksum matched
    sizes = {k: int(v.size[0]) for k, v in md.state_dict_metadata.items()
             if k.startswith(JSON_PREFIX) and hasattr(v, "size")}
    flat = load_targets(template, sizes)
    try:
        dcp.load(flat, storage_reader=SafeReader(local_dir),
                 process_group=coord.group if coord.distributed else None,
                 no_dist=not coord.distributed)
    except (RuntimeError, ValueError, KeyError) as exc:
        raise RestoreError(f"checkpoint in {local_dir} does not fit the template state: {exc}"
                           ) from exc
    apply_json(template, flat)


def restore_newest(template: dict[Any, Any], tiers: Sequence[Tier], coord: Coordinator,
                   scratch: str, emit: Callable[[dict[str, Any]], None]) -> RestoreResult | None:
    skipped: list[tuple[int, str]] = []
    for step in candidate_steps(tiers, coord):
        src, why = pick_source(tiers, step, scratch)
        verdicts = coord.all_gather_json({"ok": src is not None, "why": why})
        if not all(v["ok"] for v in verdicts):
            reason = "; ".join(f"rank {r}: {v['why']}" for r, v in enumerate(verdicts)
                               if not v["ok"])
            if coord.world_size == 1:
                reason = why
            log.warning("restore skips step %d: %s", step, reason)
            skipped.append((step, reason))
            emit({"event": "ckpt_skipped", "step": step, "phase": "restore", "reason": reason})
            if src is not None and src.downloaded:
                shutil.rmtree(src.local_dir, ignore_errors=True)
            continue
        if src is None:
            raise RestoreError("internal: a verified source vanished")
        try:
            load_into(template, src.local_dir, coord)
        finally:
            if src.downloaded:
                shutil.rmtree(src.local_dir, ignore_errors=True)
        result = RestoreResult(step, src.tier.name, src.tier.uri, skipped)
        emit({"event": "ckpt_restored", "step": step, "tier": src.tier.name,
              "uri": src.tier.uri, "skipped": [list(s) for s in skipped]})
        return result
    return None
