"""What a tier holds: committed steps, their manifests, and whether they verify."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from slurmkit.store import nofollow
from slurmkit.store.manifest import (
    LATEST,
    MANIFEST,
    METADATA,
    FileEntry,
    Manifest,
    ManifestError,
    UnsafeManifestError,
    hash_file,
    hash_stream,
    parse_step_dir,
    step_dir,
)
from slurmkit.store.tier import Tier, TierError

log = logging.getLogger(__name__)
MAX_MANIFEST_BYTES = 256 << 20  # a manifest lists ~150 bytes per file


def read_bytes(tier: Tier, rel: str, limit: int | None = None) -> bytes:
    """``rel``'s bytes; on a local tier opened without following a link below the tier
    root (nofollow.py: a refusal is an OSError). At most ``limit`` bytes are read, more
    is an error: a file its reader would hold in memory cannot grow it without bound."""
    root = tier.local_path("")
    if root is not None:
        with nofollow.opened(root, rel) as f:
            data = f.read() if limit is None else f.read(limit + 1)
    else:
        with tier.open(rel, "rb") as f:
            data = f.read() if limit is None else f.read(limit + 1)
    if limit is not None and len(data) > limit:
        raise ManifestError(f"{rel} is larger than {limit} bytes")
    return data


def step_sizes(tier: Tier, step: int) -> dict[str, int]:
    """Size of every file in the step directory; on a local tier only regular files, and a
    step directory that is a link is refused (TierError)."""
    root = tier.local_path("")
    if root is None:
        return tier.sizes(step_dir(step))
    try:
        return nofollow.sizes(root, step_dir(step))
    except OSError as exc:
        raise TierError(f"{tier.name} tier {tier.uri}: {exc}") from exc


def file_size(tier: Tier, rel: str) -> int:
    """Size of one file (on a local tier: a regular file, reached without a link)."""
    root = tier.local_path("")
    if root is None:
        return tier.size(rel)
    try:
        return nofollow.size(root, rel)
    except OSError as exc:
        raise TierError(f"{tier.name} tier {tier.uri}: {rel}: {exc}") from exc


@dataclass
class StepStatus:
    """One step on one tier: its manifest if it parsed, and why it does not verify (or None)."""

    step: int
    tier: Tier
    manifest: Manifest | None
    problem: str | None

    @property
    def ok(self) -> bool:
        return self.problem is None and self.manifest is not None


def list_steps(tier: Tier) -> list[int]:
    """Steps with a step directory on the tier (committed or not), newest first."""
    steps = [parse_step_dir(n) for n in tier.ls("")]
    return sorted((s for s in steps if s is not None), reverse=True)


def read_manifest(tier: Tier, step: int) -> Manifest:
    """The step's manifest, checked. A link on the way to it is refused as unsafe."""
    rel = f"{step_dir(step)}/{MANIFEST}"
    if tier.local_path("") is None and not tier.exists(rel):
        raise ManifestError("no manifest (save incomplete or manifest deleted)")
    try:
        data = read_bytes(tier, rel, MAX_MANIFEST_BYTES)
    except FileNotFoundError as exc:
        raise ManifestError("no manifest (save incomplete or manifest deleted)") from exc
    except nofollow.LinkRefused as exc:
        raise UnsafeManifestError(
            detected=f"checkpoint step {step}: {exc.strerror}",
            requirement="a step is a plain directory of regular files on its tier",
            fix="treat the step as tampered with: restore falls back to an older step; "
                "find out who placed the link, then delete it") from exc
    except OSError as exc:
        raise TierError(f"{tier.name} tier {tier.uri}: read {rel!r} failed: {exc}") from exc
    m = Manifest.from_json(data)
    if m.step != step:
        raise ManifestError(f"manifest says step {m.step}, directory says {step}")
    return m


def check_step(tier: Tier, step: int, *, deep: bool,
               files: Callable[[Manifest], list[FileEntry]] | None = None,
               on_bytes: Callable[[int], None] | None = None,
               contents: bool = False) -> StepStatus:
    """Manifest self-check, then every file's presence and size; checksums too when ``deep``.
    Never raises: whatever a step holds, it is reported as the step's problem.

    ``files`` narrows which manifest entries must be here (a node's NVMe holds its own).
    ``contents`` (with ``deep``): every record is decoded as restore would (``store
    verify``: a shard rewritten with a matching checksum is not verified).
    """
    try:
        m = read_manifest(tier, step)
    except (ManifestError, TierError) as exc:
        return StepStatus(step, tier, None, str(exc))
    except Exception as exc:  # whatever a hostile step raises: the step is bad, not us
        return StepStatus(step, tier, None, f"{type(exc).__name__}: {exc}"[:1000])
    try:
        st = _check_files(tier, step, m, files(m) if files is not None else m.files,
                          deep, on_bytes)
        if st.ok and deep and contents:
            st.problem = check_contents(tier, step, m)
        return st
    except Exception as exc:
        return StepStatus(step, tier, m, f"{type(exc).__name__}: {exc}"[:1000])


def _check_files(tier: Tier, step: int, m: Manifest, entries: list[FileEntry], deep: bool,
                 on_bytes: Callable[[int], None] | None) -> StepStatus:
    try:
        sizes = step_sizes(tier, step)  # one listing instead of two requests per file
    except TierError as exc:
        return StepStatus(step, tier, m, str(exc))
    for e in entries:
        problem = check_file(tier, step, e, m.checksum_algo, deep=deep, on_bytes=on_bytes,
                             sizes=sizes)
        if problem is not None:
            return StepStatus(step, tier, m, problem)
    if deep and any(e.name == METADATA for e in entries):
        problem = check_metadata(tier, step, m)
        if problem is not None:
            return StepStatus(step, tier, m, problem)
    return StepStatus(step, tier, m, None)


def check_metadata(tier: Tier, step: int, m: Manifest) -> str | None:
    """Why the step's ``.metadata`` is not one restore would accept (None when it is).

    A checksum only says the bytes are the ones the manifest names, and whoever can write a
    shard can rewrite the manifest. So verification, promotion and retention read the index
    with the same reader restore uses (safe_reader.py: no code on load, tensor entries only,
    every byte range inside a file the manifest lists): a step restore would refuse is never
    counted as verified, never promoted, and never the reason an older good step is deleted.
    """
    from slurmkit.store.safe_reader import UnsafeMetadataError, check_storage, load_metadata

    if m.origin:  # an adopted program save (slurmkit.store.adopt): the program reads its index
        return None  # with its own loader; slurmkit never loads it (restore skips it)
    rel = f"{step_dir(step)}/{METADATA}"
    size = next((f.size for f in m.files if f.name == METADATA), 0)
    try:
        data = read_bytes(tier, rel, size)
        check_storage(load_metadata(data), {f.name: f.size for f in m.files})
    except UnsafeMetadataError as exc:
        return f"{METADATA} refused: {exc.detected}"
    except (TierError, OSError) as exc:
        return f"{METADATA}: {exc}"
    except Exception as exc:  # anything else a crafted file raises: not verified
        return f"{METADATA}: {type(exc).__name__}: {exc}"[:1000]
    return None


def check_contents(tier: Tier, step: int, m: Manifest) -> str | None:
    """Why a step whose checksums verify would still not restore (None when it would):
    every tensor record loads (``weights_only``) with its chunk's dtype and shape, and every
    JSON value decodes within its limits. Reads the whole step once more."""
    import io

    import torch
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    from slurmkit.store.json_values import decode
    from slurmkit.store.safe_reader import load_metadata
    from slurmkit.store.staging import JSON_PREFIX

    size = next((f.size for f in m.files if f.name == METADATA), None)
    if size is None:
        return None
    try:
        md = load_metadata(read_bytes(tier, f"{step_dir(step)}/{METADATA}", size))
        chunks = {MetadataIndex(k, c.offsets): c for k, e in md.state_dict_metadata.items()
                  if isinstance(e, TensorStorageMetadata) for c in e.chunks}
        for index, info in sorted(md.storage_data.items(),
                                  key=lambda kv: (kv[1].relative_path, kv[1].offset)):
            entry = md.state_dict_metadata[index.fqn]
            if not isinstance(entry, TensorStorageMetadata):  # (load_metadata refuses it)
                return f"{index.fqn}: not a tensor entry"
            chunk = chunks[index]
            where = f"{info.relative_path} ({index.fqn})"
            t = torch.load(io.BytesIO(_read_range(tier, step, info)), map_location="cpu",
                           weights_only=True)
            if (not isinstance(t, torch.Tensor) or t.shape != chunk.sizes
                    or t.dtype != entry.properties.dtype):
                return f"{where}: the stored record is not the tensor .metadata declares"
            if index.fqn.startswith(JSON_PREFIX) and len(entry.chunks) == 1:
                decode(index.fqn, t, None)
    except Exception as exc:  # a record that does not load: the step would be skipped
        return f"record does not load: {type(exc).__name__}: {exc}"[:1000]
    return None


def _read_range(tier: Tier, step: int, info: Any) -> bytes:
    rel = f"{step_dir(step)}/{info.relative_path}"
    root = tier.local_path("")
    with (nofollow.opened(root, rel) if root is not None else tier.open(rel, "rb")) as f:
        f.seek(info.offset)
        return f.read(info.length)


def check_file(tier: Tier, step: int, e: FileEntry, algo: str, *, deep: bool,
               on_bytes: Callable[[int], None] | None = None,
               sizes: Mapping[str, int] | None = None) -> str | None:
    """Why ``e`` does not verify on ``tier`` (None when it does).

    ``sizes``: the step directory's listing (name -> bytes) when the caller has it.
    """
    rel = f"{step_dir(step)}/{e.name}"
    try:
        if sizes is None:
            sizes = {e.name: file_size(tier, rel)} if tier.exists(rel) else {}
        if e.name not in sizes:
            return f"missing shard {e.name}"
        size = sizes[e.name]
        if size != e.size:
            return f"shard {e.name} has {size} bytes, manifest says {e.size} (truncated?)"
        if deep:
            root = tier.local_path("")
            if root is not None:  # (no link followed below the root)
                digest, _ = hash_file(rel, algo, on_bytes, root=root)
            else:
                with tier.open(rel, "rb") as f:
                    digest, _ = hash_stream(f, algo, on_bytes)
            if digest != e.checksum:
                return f"checksum mismatch in {e.name}"
    except (TierError, OSError) as exc:
        return f"{e.name}: {exc}"
    return None


def scan(tier: Tier, *, deep: bool) -> list[StepStatus]:
    """Status of every step directory on the tier, newest first."""
    return [check_step(tier, s, deep=deep) for s in list_steps(tier)]


def _read_latest(tier: Tier) -> int | None:
    if not tier.exists(LATEST):
        return None
    step = json.loads(read_bytes(tier, LATEST, 1 << 16))["step"]
    if not isinstance(step, int) or isinstance(step, bool):
        raise ValueError(f"{LATEST} names a {type(step).__name__}")
    return step


def read_latest(tier: Tier) -> int | None:
    """The step ``latest.json`` names; None when missing or unreadable (a read can fail with
    OSError from inside the open file on S3, e.g. while the server restarts)."""
    try:
        return _read_latest(tier)
    except (TierError, OSError, ValueError, KeyError, TypeError, ManifestError,
            RecursionError) as exc:
        log.warning("unreadable %s on %s: %s", LATEST, tier.uri, exc)
        return None


def write_latest(tier: Tier, step: int) -> None:
    """Move the latest pointer forward (never back: a late promotion must not rewind it).
    A pointer whose bytes cannot be read now (S3 raises OSError from inside the open file)
    fails the write rather than risk a rewind."""
    try:
        current = _read_latest(tier)
    except (TierError, ValueError, KeyError, TypeError, ManifestError, RecursionError,
            nofollow.LinkRefused):
        current = None  # (a link in its place is replaced, never followed)
    except OSError as exc:
        raise TierError(f"cannot read {LATEST} on {tier.uri}: {exc}") from exc
    if current is not None and current >= step:
        return
    tier.write_atomic(LATEST, json.dumps({"step": step}).encode())


class VerifiedCache:
    """Which save of a step this process saw deep-verified on a tier: hashed while it was
    written (the writer's sealing), or checked on the destination after a promotion copy.

    Retention asks it before hashing anything again, so a step is read back at most once
    per process and tier."""

    def __init__(self) -> None:
        self._known: dict[tuple[str, int], str] = {}
        self._lock = threading.Lock()

    def mark(self, tier: Tier, step: int, save: str) -> None:
        with self._lock:
            self._known[(tier.uri, step)] = save
            if len(self._known) > 4096:  # a long run: forget the oldest steps
                for key in sorted(self._known, key=lambda k: k[1])[:1024]:
                    del self._known[key]

    def forget(self, tier: Tier, step: int) -> None:
        with self._lock:
            self._known.pop((tier.uri, step), None)

    def get(self, tier: Tier, step: int) -> str | None:
        with self._lock:
            return self._known.get((tier.uri, step))
