"""Restore the newest step that verifies on some tier, into a template state, in place.

Per step (newest first, the union of every rank's view), each rank:
  * verifies ``.metadata`` (checksum), unpickles it through an allowlist and refuses anything
    but tensor entries whose byte ranges lie inside files the manifest lists (safe_reader.py:
    a crafted checkpoint is refused, never run), and asks DCP's load planner which shard
    files its part of the state lives in;
  * takes each of those files from the fastest tier holding it intact: local files are
    hashed in place (in parallel), remote ones downloaded in parallel byte ranges and hashed
    on the way (transfer.py). A node's NVMe holds only its ranks' files; the rest come from
    the shared tier, and a damaged copy on one tier falls back to the next, file by file.
    Tiers holding different saves of one step are never mixed.
The ranks agree (all must succeed) and only then DCP reads the shards (``weights_only``,
with a load planner whose byte path refuses, through a file system that opens only the
verified files, never through a link). JSON values are decoded within limits and checked
against the template before the ranks agree again. A step that fails anywhere, with any
exception (a shard rewritten with a matching checksum, garbage JSON, a malformed entry), is
skipped with its reason (``ckpt_skipped``; ``ckpt_rejected`` when a copy was refused as
unsafe) and the next older one is tried. Only when no step restores and some step did not
fit the template (the model changed) does restore raise, rather than start from scratch.
"""
from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata

from slurmkit.errors import SlurmkitError
from slurmkit.store import nofollow
from slurmkit.store.catalog import check_file, read_manifest
from slurmkit.store.coord import MAX_REASON, MAX_REASONS, Coordinator
from slurmkit.store.json_values import UnsafeValueError, decode
from slurmkit.store.listing import StepSizes, agreed_steps
from slurmkit.store.manifest import (
    METADATA,
    FileEntry,
    Manifest,
    UnsafeManifestError,
    step_dir,
)
from slurmkit.store.safe_reader import (
    NoFollowFileSystem,
    SafeLoadPlanner,
    SafeReader,
    TemplateMisfitError,
    UnsafeMetadataError,
    check_storage,
    load_metadata,
)
from slurmkit.store.staging import JSON_PREFIX, load_targets, walk
from slurmkit.store.tier import Tier, TierError

log = logging.getLogger(__name__)
FILE_WORKERS = 4  # files of one step downloaded / hashed at the same time
UNSAFE = (UnsafeMetadataError, UnsafeManifestError, UnsafeValueError)  # refused as crafted
MISFIT = "does not fit the template: "  # a load failure that is the template's, not the step's
REFUSED = "refused: "


class RestoreError(SlurmkitError):
    """A verified checkpoint does not fit the template (changed model or state layout)."""


class StepLoadError(RestoreError):
    """Loading a verified step failed on some rank (every rank raises the same verdict)."""

    def __init__(self, reason: str, misfit: bool, unsafe: bool) -> None:
        super().__init__(reason)
        self.reason, self.misfit, self.unsafe = reason, misfit, unsafe


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
    """Where each file this rank reads comes from: a verified local path per file name."""

    manifest: Manifest
    paths: dict[str, str]
    files: list[FileEntry]  # what this rank verified and reads
    by_tier: dict[str, int]  # bytes read per tier
    scratch_dirs: list[str] = field(default_factory=list)  # downloads to remove after loading
    metadata: Metadata | None = None  # the verified .metadata, once read
    where: dict[str, tuple[str, str]] = field(default_factory=dict)  # path -> (root, rel)

    @property
    def tier(self) -> str:
        """The tier most of the bytes came from."""
        return max(self.by_tier, key=lambda k: self.by_tier[k]) if self.by_tier else ""

    def cleanup(self) -> None:
        for d in self.scratch_dirs:
            shutil.rmtree(d, ignore_errors=True)


def candidate_steps(tiers: Sequence[Tier], coord: Coordinator) -> list[int]:
    # shared tiers listed once by rank 0, node-local ones by each rank (listing.py)
    return agreed_steps(tiers, coord)


def json_sizes(md: Metadata) -> dict[str, int]:
    """Byte length of every JSON value the checkpoint holds (its load target's size)."""
    return {k: int(v.size[0]) for k, v in md.state_dict_metadata.items()
            if k.startswith(JSON_PREFIX) and hasattr(v, "size")}


def files_needed(template: dict[Any, Any], md: Metadata) -> set[str] | None:
    """The shard files DCP will read to fill ``template`` (from the checkpoint's metadata and
    DCP's own load planner), or None when the template does not plan against it (the load
    then reports why). Raises UnsafeMetadataError for a byte item."""
    try:
        planner = SafeLoadPlanner()
        planner.set_up_planner(load_targets(template, json_sizes(md)), md, False)
        plan = planner.create_local_plan()
        return {md.storage_data[item.storage_index].relative_path for item in plan.items}
    except UnsafeMetadataError:
        raise
    except Exception as exc:  # a template mismatch: read everything, let the load say it
        log.info("cannot plan which files to read (%s): reading all", exc)
        return None


def _save_identity(m: Manifest) -> tuple[Any, ...]:
    """Two manifests of one step describe the same save (a promoted copy) iff this matches."""
    return (m.checksum_algo, tuple(sorted((f.name, f.size, f.checksum) for f in m.files)))


class _Assembly:
    """Finds each file of one save on the fastest tier that holds it intact.

    Local tiers are read in place after a deep check; remote files are downloaded into
    ``scratch`` with their checksum computed on the way. A node's NVMe holds only its own
    ranks' files, so a restart in the allocation reads those from NVMe and the rest from the
    shared tier."""

    def __init__(self, tiers: list[Tier], step: int, m: Manifest, scratch: str) -> None:
        self.tiers, self.step, self.m, self.scratch = tiers, step, m, scratch
        # a node-local step directory is listed; on a shared tier only this rank's files
        # are looked up (listing.StepSizes), never all N ranks' entries
        self.listing: dict[str, Mapping[str, int]] = {t.name: StepSizes(t, step)
                                                       for t in tiers}
        self.scratch_dirs: list[str] = []
        self.by_tier: dict[str, int] = {}
        self.where: dict[str, tuple[str, str]] = {}  # path -> (root, rel): opened link-free
        self._lock = threading.Lock()

    def get(self, f: FileEntry) -> tuple[str | None, str]:
        """(verified local path, "") or (None, every tier's reason)."""
        problems = []
        for t in self.tiers:
            if self.listing[t.name].get(f.name) != f.size:
                got = self.listing[t.name].get(f.name)
                problems.append(f"{t.name}: " + (f"missing shard {f.name}" if got is None else
                                                 f"shard {f.name} has {got} bytes, manifest "
                                                 f"says {f.size} (truncated?)"))
                continue
            try:
                path, bad = self._one(t, f)
            except (TierError, OSError) as exc:
                path, bad = None, f"{f.name}: {exc}"
            if path is not None:
                with self._lock:
                    self.by_tier[t.name] = self.by_tier.get(t.name, 0) + f.size
                return path, ""
            problems.append(f"{t.name}: {bad}")
        return None, "; ".join(problems)

    def _one(self, t: Tier, f: FileEntry) -> tuple[str | None, str]:
        rel = f"{step_dir(self.step)}/{f.name}"
        local = t.local_path(rel)
        if local is not None:
            bad = check_file(t, self.step, f, self.m.checksum_algo, deep=True,
                             sizes=self.listing[t.name])
            with self._lock:
                self.where[local] = (t.local_path("") or "/", rel)
            return (local, "") if bad is None else (None, bad)
        d = os.path.join(self.scratch, f"{t.name}-{step_dir(self.step)}")
        with self._lock:
            if d not in self.scratch_dirs:
                self.scratch_dirs.append(d)
        path = os.path.join(d, f.name)
        with self._lock:
            self.where[path] = (d, f.name)
        digest, size = t.get_file_hashed(f"{step_dir(self.step)}/{f.name}", path,
                                         self.m.checksum_algo, f.size)
        if size != f.size:
            return None, f"shard {f.name} has {size} bytes, manifest says {f.size}"
        if digest != f.checksum:
            return None, f"checksum mismatch in {f.name}"
        return path, ""

    def cleanup(self) -> None:
        for d in self.scratch_dirs:
            shutil.rmtree(d, ignore_errors=True)


def _assemble(tiers: list[Tier], step: int, m: Manifest, scratch: str,
              template: dict[Any, Any] | None) -> tuple[Source | None, str]:
    """Every file this rank needs of save ``m``, verified, each from its fastest tier.
    Raises UnsafeMetadataError when the save's ``.metadata`` is refused."""
    asm = _Assembly(tiers, step, m, scratch)
    files = list(m.files)
    meta = next((f for f in files if f.name == METADATA), None)
    paths: dict[str, str] = {}
    used: list[FileEntry] = []
    md: Metadata | None = None
    if template is not None and meta is None:
        return None, f"the manifest lists no {METADATA} (nothing says where the state lies)"
    if template is not None and meta is not None:
        path, why = asm.get(meta)
        if path is None:
            asm.cleanup()
            return None, why
        paths[METADATA], used = path, [meta]
        try:
            md = load_metadata(nofollow.read_bytes(*asm.where[path]))
            # the manifest's sizes are what the listing and the checksums verify against
            check_storage(md, {f.name: f.size for f in files})
            needed = files_needed(template, md)
        except BaseException:
            asm.cleanup()
            raise
        files = [f for f in files if f is not meta and (needed is None or f.name in needed)]
    # largest first: a small file must not hold a worker while big shards wait
    files.sort(key=lambda f: f.size, reverse=True)
    if files:
        with ThreadPoolExecutor(max_workers=max(1, min(len(files), FILE_WORKERS))) as pool:
            got = list(pool.map(asm.get, files))
        for f, (path, why) in zip(files, got):
            if path is None:
                asm.cleanup()
                return None, why
            paths[f.name] = path
    by_tier = dict(asm.by_tier) or {tiers[0].name: 0}  # (a step with no files to read)
    return Source(m, paths, used + files, by_tier, list(asm.scratch_dirs), md,
                  dict(asm.where)), ""


def pick_source(tiers: Sequence[Tier], step: int, scratch: str,
                template: dict[Any, Any] | None = None) -> tuple[Source | None, str]:
    """The files this rank needs of ``step``, each verified, each from the fastest tier that
    holds it intact; or None and every reason. Tiers holding different saves of one step
    (a re-save after a restart) are never mixed: the save on the fastest tier is tried first."""
    src, problems, _ = _pick(tiers, step, scratch, template)
    return src, "; ".join(problems) or "on no tier"


def _pick(tiers: Sequence[Tier], step: int, scratch: str, template: dict[Any, Any] | None
          ) -> tuple[Source | None, list[str], list[str]]:
    """pick_source's work: (source, every problem, the problems that are refusals)."""
    problems: list[str] = []
    rejected: list[str] = []
    saves: dict[tuple[Any, ...], tuple[Manifest, list[Tier]]] = {}
    for t in tiers:
        try:
            m = read_manifest(t, step)
        except UNSAFE as exc:
            problems.append(f"{t.name}: {exc}")
            rejected.append(problems[-1])
            continue
        except Exception as exc:  # (ManifestError, TierError, anything a hostile step raises)
            problems.append(f"{t.name}: {_say(exc)}")
            continue
        if m.origin:  # a program's save the agents adopted: the program loads it, never slurmkit
            problems.append(f"{t.name}: step {step} is a save of {m.origin!r}, not slurmkit's own")
            continue
        saves.setdefault(_save_identity(m), (m, []))[1].append(t)
    for m, holders in saves.values():
        try:
            src, why = _assemble(holders, step, m, scratch, template)
        except UNSAFE as exc:
            problems.append(f"{'+'.join(t.name for t in holders)}: {exc}")
            rejected.append(problems[-1])
            continue
        except Exception as exc:  # any other failure reading this save: try the next
            problems.append(f"{'+'.join(t.name for t in holders)}: {_say(exc)}")
            continue
        if src is not None:
            return src, problems, rejected
        problems.append(why)
    return None, problems, rejected


class MappedReader(SafeReader):
    """SafeReader over verified files that may lie in different directories (tiers)."""

    def __init__(self, paths: dict[str, str],
                 where: dict[str, tuple[str, str]] | None = None) -> None:
        super().__init__(os.path.dirname(paths.get(METADATA) or next(iter(paths.values()))))
        self.fs = _MappedFileSystem(paths, where)


class _MappedFileSystem(NoFollowFileSystem):
    """Opens the verified files and nothing else: a name that is not one of them (a path
    out of the step, a file no manifest lists) is refused, not joined to a directory; each
    is opened below its tier root without following a link."""

    def __init__(self, paths: dict[str, str],
                 where: dict[str, tuple[str, str]] | None = None) -> None:
        super().__init__(where)
        self.paths = paths

    def concat_path(self, path: str | os.PathLike[str], suffix: str) -> str | os.PathLike[str]:
        if suffix in self.paths:
            return self.paths[suffix]
        raise UnsafeMetadataError(f"checkpoint load asked for {suffix!r}, which is not one of "
                                  "the step's verified files")


def _say(exc: BaseException) -> str:
    """One line for a failure's reason (an ActionableError says all of it itself)."""
    text = str(exc) if isinstance(exc, SlurmkitError) else f"{type(exc).__name__}: {exc}"
    return text[:4 * MAX_REASON]


def _read(template: dict[Any, Any], paths: dict[str, str], md: Metadata | None,
          where: dict[str, tuple[str, str]] | None) -> dict[str, Any]:
    """DCP load into ``template``'s tensors (in place); its JSON values decoded and checked
    (flat key -> value, applied only once every rank succeeded)."""
    if md is None:
        md = MappedReader(paths, where).read_metadata()  # checked, after its checksum matched
    flat = load_targets(template, json_sizes(md))
    dcp.load(flat, storage_reader=MappedReader(paths, where), planner=SafeLoadPlanner(),
             no_dist=True)
    return {key: decode(key, flat[JSON_PREFIX + key], parent[k])
            for key, parent, k in walk(template)
            if JSON_PREFIX + key in flat and not isinstance(parent[k], torch.Tensor)}


def load_into(template: dict[Any, Any], paths: dict[str, str], coord: Coordinator,
              md: Metadata | None = None,
              where: dict[str, tuple[str, str]] | None = None) -> None:
    """DCP load of verified files into ``template`` (tensors in place, JSON values once all
    ranks succeeded); ``md``: their metadata when already read. Each rank reads its own part
    (no process group: DCP's load plan is local), then the ranks agree, so that a rank whose
    load failed never trains on alone: any failure on any rank raises StepLoadError, the
    same on every rank."""
    failure: BaseException | None = None
    values: dict[str, Any] = {}
    try:
        values = _read(template, paths, md, where)
    except CheckpointException as exc:
        failure = _load_failure(exc)
    except Exception as exc:  # anything a step's bytes can raise: the step is skipped
        failure = exc
    why = ""
    if failure is not None:
        why = (MISFIT if isinstance(failure, TemplateMisfitError) else
               REFUSED if isinstance(failure, UNSAFE) else "") + _say(failure)
        log.info("loading %s failed: %s", os.path.dirname(next(iter(paths.values()))), why)
    ok, bad = coord.agree(failure is None, why)
    if not ok:
        reasons = [w for _, w in bad]
        text = why if coord.world_size == 1 else "; ".join(
            f"rank {r}: {w}" if r >= 0 else w for r, w in bad)
        raise StepLoadError(text, any(w.startswith(MISFIT) for w in reasons),
                            any(w.startswith(REFUSED) for w in reasons))
    for key, parent, k in walk(template):
        if key in values:
            parent[k] = values[key]


def _verdicts(coord: Coordinator, ok: bool, why: str, rejected: list[str]) -> dict[str, Any]:
    """Every rank's verdict on one step, reduced on rank 0 to O(1) for every rank: whether
    all could restore it, and the reports (rank, verdict) of up to 8 ranks that could not or
    refused a copy (then one line with how many more)."""
    mine = None if ok and not rejected else {"ok": ok, "why": why[:MAX_REASON],
                                             "rejected": [x[:MAX_REASON] for x in rejected[:4]]}

    def combine(xs: list[Any]) -> dict[str, Any]:
        reports: list[list[Any]] = [[r, x] for r, x in enumerate(xs) if isinstance(x, dict)]
        shown = reports[:MAX_REASONS]
        if len(reports) > len(shown):
            more = reports[len(shown):]
            shown.append([-1, {"ok": all(bool(x.get("ok")) for _, x in more),
                               "why": f"... and {len(more)} more ranks",
                               "rejected": []}])
        return {"ok": all(bool(x.get("ok")) for _, x in reports), "reports": shown}

    res = coord.reduce_json(mine, combine)
    if not isinstance(res, dict) or not isinstance(res.get("reports"), list):
        raise RestoreError(f"malformed restore verdict from rank 0: {res!r}"[:300])
    reports = [(int(r), {"ok": bool(v.get("ok")), "why": str(v.get("why", "")),
                         "rejected": [str(x) for x in v.get("rejected") or []]})
               for r, v in res["reports"] if isinstance(v, dict)]
    return {"ok": bool(res.get("ok")), "reports": reports}


def _load_failure(exc: CheckpointException) -> BaseException:
    """The cause of DCP's wrapper of a load failure (a BaseException, which ``except
    Exception`` would let through): a refusal or a template misfit first."""
    causes = [e for _, (e, _) in sorted(exc.failures.items())]
    for kind in (UNSAFE, TemplateMisfitError):
        hit = next((e for e in causes if isinstance(e, kind)), None)
        if hit is not None:
            return hit
    return RestoreError("checkpoint does not load: " + "; ".join(_say(e) for e in causes))


def _skip(step: int, reason: str, unsafe: bool, skipped: list[tuple[int, str]],
          emit: Callable[[dict[str, Any]], None]) -> None:
    if unsafe:  # someone wrote a crafted checkpoint: say so loudly
        log.error("restore refuses step %d as unsafe: %s", step, reason)
    else:
        log.warning("restore skips step %d: %s", step, reason)
    skipped.append((step, reason))
    emit({"event": "ckpt_rejected" if unsafe else "ckpt_skipped", "step": step,
          "phase": "restore", "reason": reason})


def restore_newest(template: dict[Any, Any], tiers: Sequence[Tier], coord: Coordinator,
                   scratch: str, emit: Callable[[dict[str, Any]], None]) -> RestoreResult | None:
    """The newest step every rank can verify and load, loaded into ``template``; None when
    none can (nothing saved yet, or every step damaged). RestoreError when no step loads and
    some did not fit the template: a changed model must not silently start from scratch."""
    skipped: list[tuple[int, str]] = []
    misfits: list[str] = []
    for step in candidate_steps(tiers, coord):
        t0 = time.perf_counter()
        src, problems, rejected = _pick(tiers, step, scratch, template)
        why = "; ".join(problems) or "on no tier"
        t1 = time.perf_counter()
        verdicts = _verdicts(coord, src is not None, why, rejected)
        refusals = "; ".join(f"rank {r}: {x}" if coord.world_size > 1 and r >= 0 else x
                             for r, v in verdicts["reports"] for x in v["rejected"])
        if not verdicts["ok"]:
            reason = "; ".join(f"rank {r}: {v['why']}" if r >= 0 else v["why"]
                               for r, v in verdicts["reports"] if not v["ok"])
            _skip(step, why if coord.world_size == 1 else reason, bool(refusals), skipped,
                  emit)
            if src is not None:
                src.cleanup()
            continue
        if refusals:  # the step restores from another tier; one copy of it was refused
            log.error("restore refuses a copy of step %d as unsafe: %s", step, refusals)
            emit({"event": "ckpt_rejected", "step": step, "phase": "restore",
                  "reason": refusals, "restored_from_other_copy": True})
        if src is None:
            raise RestoreError("internal: a verified source vanished")
        try:
            load_into(template, src.paths, coord, src.metadata, src.where)
        except StepLoadError as exc:  # (on every rank alike)
            _skip(step, exc.reason, exc.unsafe, skipped, emit)
            if exc.misfit:
                misfits.append(f"step {step}: {exc.reason}")
            continue
        finally:
            src.cleanup()
        return _restored(step, tiers, src, skipped, t0, t1, emit)
    if misfits:
        raise RestoreError("no checkpoint fits the template state (did the model or the "
                           "state's layout change?): " + "; ".join(misfits)[:4000])
    return None


def _restored(step: int, tiers: Sequence[Tier], src: Source, skipped: list[tuple[int, str]],
              t0: float, t1: float, emit: Callable[[dict[str, Any]], None]) -> RestoreResult:
    tier = next(t for t in tiers if t.name == src.tier)
    result = RestoreResult(step, tier.name, tier.uri, skipped,
                           files_read=len(src.files),
                           bytes_read=sum(f.size for f in src.files),
                           fetch_s=round(t1 - t0, 3),
                           load_s=round(time.perf_counter() - t1, 3))
    emit({"event": "ckpt_restored", "step": step, "tier": tier.name,
          "uri": tier.uri, "skipped": [list(s) for s in skipped],
          "bytes_by_tier": src.by_tier,
          "files_read": result.files_read, "bytes_read": result.bytes_read,
          "step_bytes": src.manifest.total_bytes, "fetch_s": result.fetch_s,
          "load_s": result.load_s})
    return result
