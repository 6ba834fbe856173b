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
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata

from slurmkit.errors import SlurmkitError
from slurmkit.store.catalog import check_file, check_step, list_steps
from slurmkit.store.coord import Coordinator
from slurmkit.store.manifest import FileEntry, Manifest, step_dir
from slurmkit.store.safe_reader import SafeReader, load_metadata
from slurmkit.store.staging import JSON_PREFIX, apply_json, load_targets
from slurmkit.store.tier import Tier, TierError

log = logging.getLogger(__name__)
FILE_WORKERS = 4  # files of one step downloaded / hashed at the same time
METADATA = ".metadata"


class RestoreError(SlurmkitError):
    """A verified checkpoint does not fit the template (changed model or state layout)."""


@dataclass
class RestoreResult:
    step: int
    tier: str
    uri: str
    skipped: list[tuple[int, str]] = field(default_factory=list)
    files_read: int = 0  # files this rank verified and read (its part of the step)
    bytes_read: int = 0
    fetch_s: float = 0.0  # finding, downloading and verifying the chosen step
    load_s: float = 0.0  # DCP reading it into the template


@dataclass
class Source:
    tier: Tier
    manifest: Manifest
    local_dir: str
    downloaded: bool
    files: list[FileEntry] = field(default_factory=list)  # what this rank verified and reads


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


def _fetch(tier: Tier, step: int, m: Manifest, files: list[FileEntry], local: str
           ) -> str | None:
    """Download ``files`` of a remote step into ``local``, hashing on the way; the first
    problem or None."""
    # largest first: a small file must not hold a worker while big shards wait
    files = sorted(files, key=lambda f: f.size, reverse=True)
    if not files:
        return None
    with ThreadPoolExecutor(max_workers=max(1, min(len(files), FILE_WORKERS))) as pool:
        got = list(pool.map(lambda f: tier.get_file_hashed(
            f"{step_dir(step)}/{f.name}", os.path.join(local, f.name), m.checksum_algo,
            f.size), files))
    for f, (digest, size) in zip(files, got):
        if size != f.size:
            return f"shard {f.name} has {size} bytes, manifest says {f.size}"
        if digest != f.checksum:
            return f"checksum mismatch in {f.name}"
    return None


def files_needed(template: dict[Any, Any], md: Metadata) -> set[str] | None:
    """The shard files DCP will read to fill ``template`` (from the checkpoint's metadata and
    DCP's own load planner), or None when the template does not plan against it (the load
    then reports why)."""
    sizes = {k: int(v.size[0]) for k, v in md.state_dict_metadata.items()
             if k.startswith(JSON_PREFIX) and hasattr(v, "size")}
    try:
        planner = DefaultLoadPlanner()
        planner.set_up_planner(load_targets(template, sizes), md, False)
        plan = planner.create_local_plan()
        return {md.storage_data[item.storage_index].relative_path for item in plan.items}
    except Exception as exc:  # a template mismatch: download everything, let the load say it
        log.info("cannot plan which files to download (%s): downloading all", exc)
        return None


def _download(tier: Tier, step: int, m: Manifest, scratch: str,
              template: dict[Any, Any] | None = None
              ) -> tuple[str, str | None, list[FileEntry]]:
    """Copy what this rank needs of a remote step into ``scratch`` and check every checksum;
    (dir, problem, the files fetched).

    With a template, the verified ``.metadata`` comes first and DCP's load planner says which
    shard files this rank's part of the state lives in: only those are downloaded (with N
    ranks, about 1/N of the step each instead of all of it)."""
    local = os.path.join(scratch, f"{tier.name}-{step_dir(step)}")
    os.makedirs(local, exist_ok=True)
    files = list(m.files)
    meta = next((f for f in files if f.name == METADATA), None)
    if template is not None and meta is not None:
        bad = _fetch(tier, step, m, [meta], local)
        if bad is not None:
            return local, bad, [meta]
        with open(os.path.join(local, METADATA), "rb") as fh:
            needed = files_needed(template, load_metadata(fh.read()))
        if needed is not None and needed - {f.name for f in files}:
            return local, ("metadata names files the manifest lacks: "
                           f"{sorted(needed - {f.name for f in files})[:3]}"), [meta]
        rest = [f for f in files if f is not meta and (needed is None or f.name in needed)]
        return local, _fetch(tier, step, m, rest, local), [meta] + rest
    return local, _fetch(tier, step, m, files, local), files


def _verify_local(tier: Tier, step: int, m: Manifest, template: dict[Any, Any] | None = None
                  ) -> tuple[str | None, list[FileEntry]]:
    """Deep check of a local copy, files hashed in parallel; the first problem or None.

    With a template, ``.metadata`` is checked first and then only the shard files DCP will
    read for this rank (every rank checks what it reads, and the ranks agree on the outcome:
    a shared tier is not read N times over)."""
    sizes = tier.sizes(step_dir(step))

    def check(files: list[FileEntry]) -> str | None:
        if not files:
            return None
        with ThreadPoolExecutor(max_workers=max(1, min(len(files), FILE_WORKERS))) as pool:
            problems = pool.map(lambda f: check_file(tier, step, f, m.checksum_algo,
                                                     deep=True, sizes=sizes), files)
            return next((p for p in problems if p), None)

    files = list(m.files)
    meta = next((f for f in files if f.name == METADATA), None)
    path = tier.local_path(f"{step_dir(step)}/{METADATA}")
    if template is not None and meta is not None and path is not None:
        bad = check([meta])
        if bad is not None:
            return bad, [meta]
        with open(path, "rb") as fh:
            needed = files_needed(template, load_metadata(fh.read()))
        if needed is not None and needed - {f.name for f in files}:
            return ("metadata names files the manifest lacks: "
                    f"{sorted(needed - {f.name for f in files})[:3]}"), [meta]
        rest = [f for f in files if f is not meta and (needed is None or f.name in needed)]
        return check(rest), [meta] + rest
    return check(files), files


def pick_source(tiers: Sequence[Tier], step: int, scratch: str,
                template: dict[Any, Any] | None = None) -> tuple[Source | None, str]:
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
                bad, used = _verify_local(t, step, m, template)
                if bad is None:
                    return Source(t, m, local, False, used), ""
            else:
                local, bad, used = _download(t, step, m, scratch, template)
                if bad is None:
                    return Source(t, m, local, True, used), ""
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
        t0 = time.perf_counter()
        src, why = pick_source(tiers, step, scratch, template)
        t1 = time.perf_counter()
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
        result = RestoreResult(step, src.tier.name, src.tier.uri, skipped,
                               files_read=len(src.files),
                               bytes_read=sum(f.size for f in src.files),
                               fetch_s=round(t1 - t0, 3),
                               load_s=round(time.perf_counter() - t1, 3))
        emit({"event": "ckpt_restored", "step": step, "tier": src.tier.name,
              "uri": src.tier.uri, "skipped": [list(s) for s in skipped],
              "files_read": result.files_read, "bytes_read": result.bytes_read,
              "step_bytes": src.manifest.total_bytes, "fetch_s": result.fetch_s,
              "load_s": result.load_s})
        return result
    return None
