"""The checkpoint manifest: the commit record of one step on one tier.

Layout on every tier root::

    step_0000000100/            one committed step (DCP files + manifest.json)
    step_0000000100/manifest.json   written last, atomically; carries its own checksum
    latest.json                 {"step": N}; moves only after N's manifest verified
    .partial/                   steps being written (rename-capable tiers only)

A step without a manifest that verifies does not exist for restore.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import IO, Any

from slurmkit.errors import ActionableError, SlurmkitError
from slurmkit.store import nofollow

FORMAT = "slurmkit-ckpt/1"
MANIFEST = "manifest.json"
METADATA = ".metadata"  # DCP's checkpoint index (pickled; read through safe_reader.py)
LATEST = "latest.json"
PARTIAL = ".partial"
QUEUE_DIR = ".queue"
_STEP_RE = re.compile(r"^step_(\d{10})$")
_CHUNK = 8 << 20  # bytes per read while hashing


class ManifestError(SlurmkitError):
    """A manifest is missing, malformed, or its own checksum does not match."""


class UnsafeManifestError(ManifestError, ActionableError):
    """A manifest names a file outside its step directory (the checkpoint may be crafted)."""


def check_name(name: object, what: str = "manifest file name") -> str:
    """``name`` if it is one plain file name inside a step directory, else UnsafeManifestError.

    Every reader joins these names to a step directory (restore, verify, promotion copies
    to other tiers); a separator, ``..``, an absolute path or a NUL would make them read or
    copy a file outside the step (to S3, say). Whoever can write a shard can rewrite the
    manifest, so the names are checked, not trusted."""
    if not isinstance(name, str) or not name:
        raise _unsafe_name(name, what, "is empty or not a string")
    bad = ""
    if name in (".", ".."):
        bad = "is a directory reference"
    elif name.startswith("/"):
        bad = "is an absolute path"
    elif "/" in name or "\\" in name:
        bad = "holds a path separator"
    elif any(ord(c) < 0x20 or ord(c) == 0x7F for c in name):
        bad = "holds a NUL or control character"
    elif len(name.encode("utf-8", "surrogatepass")) > 255:
        bad = "is longer than a file name can be"
    if bad:
        raise _unsafe_name(name, what, bad)
    return name


def _unsafe_name(name: object, what: str, bad: str) -> UnsafeManifestError:
    return UnsafeManifestError(
        detected=f"checkpoint {what} {name!r} {bad}",
        requirement="every file of a step is a plain name inside its step directory "
                    "(slurmkit writes only .metadata and DCP's __R_N.distcp shards)",
        fix="treat the step as tampered with: restore falls back to an older step; "
            "find out who wrote it, then delete it (python -m slurmkit.store gc)")


def step_dir(step: int) -> str:
    return f"step_{step:010d}"


def parse_step_dir(name: str) -> int | None:
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


class Hasher:
    """Incremental checksum by algorithm name (sha256 or crc32)."""

    def __init__(self, algo: str) -> None:
        self.algo = algo
        self._sha = hashlib.sha256() if algo == "sha256" else None
        self._crc = 0
        if algo not in ("sha256", "crc32"):
            raise ManifestError(f"unknown checksum algorithm {algo!r}")

    def update(self, data: bytes | memoryview) -> None:
        if self._sha is not None:
            self._sha.update(data)
        else:
            self._crc = zlib.crc32(data, self._crc)

    def hexdigest(self) -> str:
        return self._sha.hexdigest() if self._sha is not None else f"{self._crc:08x}"


def hash_stream(f: IO[bytes], algo: str, on_bytes: Callable[[int], None] | None = None
                ) -> tuple[str, int]:
    """Checksum and byte count of a stream read to its end."""
    h = Hasher(algo)
    n = 0
    while chunk := f.read(_CHUNK):
        h.update(chunk)
        n += len(chunk)
        if on_bytes is not None:
            on_bytes(len(chunk))
    return h.hexdigest(), n


def hash_file(path: str, algo: str, on_bytes: Callable[[int], None] | None = None,
              root: str | None = None) -> tuple[str, int]:
    """Checksum and size of a local file: one reused buffer, the kernel told to read ahead
    sequentially (about 25% faster from a cold page cache than plain reads). With ``root``,
    ``path`` is relative to it and opened without following a link (nofollow.py)."""
    h = Hasher(algo)
    n = 0
    buf = memoryview(bytearray(_CHUNK))
    fd = nofollow.open_fd(root, path) if root is not None else os.open(path, os.O_RDONLY)
    with open(fd, "rb", buffering=0) as f:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        while k := f.readinto(buf):
            h.update(buf[:k])
            n += k
            if on_bytes is not None:
                on_bytes(k)
    return h.hexdigest(), n


@dataclass
class FileEntry:
    name: str
    size: int
    checksum: str
    rank: int  # the rank that wrote it (and copies it during promotions)


@dataclass
class Manifest:
    step: int
    world_size: int
    files: list[FileEntry]
    checksum_algo: str
    config_hash: str = ""
    created_unix: float = 0.0
    tier: str = ""
    promote_to: list[str] = field(default_factory=list)
    format: str = FORMAT
    # "" for slurmkit's own saves; "program:<adapter>" for a program's save the agents adopted
    # (slurmkit.store.adopt): the program loads it itself, slurmkit's restore never does.
    origin: str = ""

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def to_json(self) -> bytes:
        body = asdict(self)
        body["manifest_checksum"] = _self_checksum(body)
        return json.dumps(body, indent=1, sort_keys=True).encode()

    def with_tier(self, tier: str) -> Manifest:
        d = asdict(self)
        d["files"] = [FileEntry(**f) for f in d["files"]]
        d["tier"] = tier
        return Manifest(**d)

    @staticmethod
    def from_json(data: bytes) -> Manifest:
        """Parse and check the manifest's own checksum; raise ManifestError if anything is off."""
        try:
            body = json.loads(data)
            if not isinstance(body, dict):
                raise ManifestError(f"malformed manifest: a {type(body).__name__}, not an "
                                    "object")
            claimed = body.pop("manifest_checksum")
            if claimed != _self_checksum(body):
                raise ManifestError("manifest checksum mismatch (manifest corrupted)")
            if body.get("format") != FORMAT:
                raise ManifestError(f"unknown manifest format {body.get('format')!r}")
            _check_types(body)
            body["files"] = [_file_entry(f) for f in body["files"]]
            names = [f.name for f in body["files"]]
            if len(set(names)) != len(names):
                raise ManifestError("malformed manifest: a file is listed twice")
            return Manifest(**body)
        except ManifestError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
            raise ManifestError(f"malformed manifest: {type(exc).__name__}: {exc}"[:500]
                                ) from exc


_TYPES: dict[str, tuple[type, ...]] = {
    "step": (int,), "world_size": (int,), "checksum_algo": (str,), "config_hash": (str,),
    "created_unix": (int, float), "tier": (str,), "promote_to": (list,), "files": (list,),
    "origin": (str,)}


def _check_types(body: dict[str, Any]) -> None:
    """Every field of the kind its readers expect (they index, compare and sum them)."""
    for name, kinds in _TYPES.items():
        v = body.get(name)
        if name in body and (not isinstance(v, kinds) or isinstance(v, bool)):
            raise ManifestError(f"malformed manifest: {name} is a {type(v).__name__}")
    if not all(isinstance(t, str) for t in body.get("promote_to", [])):
        raise ManifestError("malformed manifest: promote_to holds a non-string")


def _file_entry(f: dict[str, Any]) -> FileEntry:
    if not isinstance(f, dict):
        raise ManifestError(f"malformed manifest: a file entry is a {type(f).__name__}")
    e = FileEntry(**f)
    check_name(e.name)
    for field_name in ("size", "rank"):
        v = getattr(e, field_name)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ManifestError(f"malformed manifest: {e.name} has {field_name} {v!r}")
    if not isinstance(e.checksum, str):
        raise ManifestError(f"malformed manifest: {e.name} has checksum {e.checksum!r}")
    return e


def _self_checksum(body: dict[str, Any]) -> str:
    canon = json.dumps({k: v for k, v in body.items() if k != "manifest_checksum"},
                       sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canon.encode()).hexdigest()
