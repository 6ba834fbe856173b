"""Hostile checkpoints: what an attacker who can write a committed step directory does to it.

Each function rewrites one step directory the store committed, and then rewrites its
manifest so every size and checksum matches again (whoever can write a shard can write the
manifest). Used by the unit tests and by the gloo workers of the integration test.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex

from slurmkit.store.manifest import MANIFEST, METADATA, FileEntry, Manifest, hash_file


class Payload:
    """Unpickling this runs ``os.system`` (what a crafted checkpoint would do)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.marker}",))


def read_md(step_path: str) -> Metadata:
    """The test's own (trusted) unpickling of a .metadata the store wrote."""
    with open(os.path.join(step_path, METADATA), "rb") as f:
        md = pickle.load(f)
    assert isinstance(md, Metadata)
    return md


def write_md(step_path: str, md: Metadata) -> None:
    with open(os.path.join(step_path, METADATA), "wb") as f:
        pickle.dump(md, f)


def reseal(step_path: str, extra: dict[str, str] | None = None) -> None:
    """Rewrite the manifest so every listed file's size and checksum match the files as they
    are now; ``extra``: name -> path of a file to list as well (a name of the attacker's)."""
    mpath = os.path.join(step_path, MANIFEST)
    with open(mpath, "rb") as f:
        m = Manifest.from_json(f.read())
    files = []
    for e in m.files:
        digest, size = hash_file(os.path.join(step_path, e.name), m.checksum_algo)
        files.append(dataclasses.replace(e, size=size, checksum=digest))
    for name, path in (extra or {}).items():
        digest, size = hash_file(path, m.checksum_algo)
        files.append(FileEntry(name=name, size=size, checksum=digest, rank=0))
    with open(mpath, "wb") as f:
        f.write(dataclasses.replace(m, files=files).to_json())


def _shard_of(md: Metadata, key: str) -> str:
    return next(i.relative_path for k, i in md.storage_data.items() if k.fqn == key)


def byte_item_pickle(step_path: str, key: str, marker: str) -> None:
    """Mark ``key`` as a byte item and point it at a pickle appended to its shard file:
    DCP's default planner would ``torch.load(weights_only=False)`` it, running ``touch``."""
    md = read_md(step_path)
    shard = _shard_of(md, key)
    buf = io.BytesIO()
    torch.save(Payload(marker), buf)
    path = os.path.join(step_path, shard)
    offset = os.path.getsize(path)
    with open(path, "ab") as f:
        f.write(buf.getvalue())
    md.state_dict_metadata[key] = BytesStorageMetadata()
    md.storage_data = {k: i for k, i in md.storage_data.items() if k.fqn != key}
    md.storage_data[MetadataIndex(key)] = _StorageInfo(shard, offset, len(buf.getvalue()))
    write_md(step_path, md)
    reseal(step_path)


def storage_outside(step_path: str, key: str, outside: str) -> None:
    """Point ``key``'s bytes at ``outside`` (an absolute path, a copy of the real shard so
    the read would succeed if it happened)."""
    md = read_md(step_path)
    shard = _shard_of(md, key)
    with open(os.path.join(step_path, shard), "rb") as src, open(outside, "wb") as dst:
        dst.write(src.read())
    md.storage_data = {k: (dataclasses.replace(i, relative_path=outside) if k.fqn == key else i)
                       for k, i in md.storage_data.items()}
    write_md(step_path, md)
    reseal(step_path)


def manifest_dotdot(step_path: str, key: str, outside: str) -> str:
    """List ``../<outside's name>`` in the manifest (size and checksum of ``outside``, a copy
    of the real shard placed next to the step directory) and point ``key`` at it. Returns
    the name."""
    md = read_md(step_path)
    shard = _shard_of(md, key)
    assert os.path.dirname(os.path.abspath(outside)) == os.path.dirname(
        os.path.abspath(step_path))
    with open(os.path.join(step_path, shard), "rb") as src, open(outside, "wb") as dst:
        dst.write(src.read())
    name = "../" + os.path.basename(outside)
    md.storage_data = {k: (dataclasses.replace(i, relative_path=name) if k.fqn == key else i)
                       for k, i in md.storage_data.items()}
    write_md(step_path, md)
    reseal(step_path, {name: outside})
    return name


def truncated_rewritten(step_path: str, key: str) -> str:
    """Cut ``key``'s shard file in the middle of ``key``'s bytes and reseal the manifest:
    sizes and checksums all match, but .metadata reads past the end. Returns the shard."""
    md = read_md(step_path)
    info = next(i for k, i in md.storage_data.items() if k.fqn == key)
    with open(os.path.join(step_path, info.relative_path), "r+b") as f:
        f.truncate(info.offset + info.length // 2)
    reseal(step_path)
    return info.relative_path


class OpenAudit:
    """Every path this process opens (Python audit events ``open``/``os.open``) while on.
    A plain name is kept as it is: the no-follow readers open each component relative to
    its (recorded) parent directory."""

    _installed: OpenAudit | None = None

    def __init__(self) -> None:
        self.paths: list[str] = []
        self.on = False
        self._lock = threading.Lock()

    @classmethod
    def get(cls) -> OpenAudit:
        """One per process: an audit hook cannot be removed once added."""
        if cls._installed is None:
            cls._installed = OpenAudit()
            sys.addaudithook(cls._installed._hook)
        return cls._installed

    def _hook(self, event: str, args: tuple[Any, ...]) -> None:
        if self.on and event in ("open", "os.open") and args and isinstance(
                args[0], (str, bytes, os.PathLike)):
            path = os.fsdecode(args[0])
            with self._lock:  # (a relative name: opened below a directory fd, nofollow.py)
                self.paths.append(os.path.abspath(path) if "/" in path else path)

    @contextmanager
    def recording(self) -> Iterator[list[str]]:
        self.paths = []
        self.on = True
        try:
            yield self.paths
        finally:
            self.on = False


def _record(md: Metadata, key: str, nth: int = 0) -> tuple[MetadataIndex, _StorageInfo]:
    return sorted(((k, i) for k, i in md.storage_data.items() if k.fqn == key),
                  key=lambda kv: list(kv[0].offset or []))[nth]


def garbage_record(step_path: str, key: str, nth: int = 0) -> str:
    """Overwrite the bytes of ``key``'s ``nth`` chunk in its shard with other bytes of the
    same length and reseal: every size and checksum matches, the record does not load.
    Returns the shard's name."""
    _, info = _record(read_md(step_path), key, nth)
    with open(os.path.join(step_path, info.relative_path), "r+b") as f:
        f.seek(info.offset)
        f.write(bytes((i * 7 + 3) % 256 for i in range(info.length)))
    reseal(step_path)
    return info.relative_path


def replace_json(step_path: str, key: str, raw: bytes) -> None:
    """Make the JSON value ``key`` (flat, without the prefix) hold ``raw``: a new record
    appended to its shard, the entry and its record pointed at it, the manifest resealed."""
    md = read_md(step_path)
    fqn = "__json__." + key
    index, info = _record(md, fqn)
    buf = io.BytesIO()
    torch.save(torch.frombuffer(bytearray(raw), dtype=torch.uint8), buf)
    path = os.path.join(step_path, info.relative_path)
    offset = os.path.getsize(path)
    with open(path, "ab") as f:
        f.write(buf.getvalue())
    entry = md.state_dict_metadata[fqn]
    size = torch.Size([len(raw)])
    md.state_dict_metadata[fqn] = dataclasses.replace(
        entry, size=size, chunks=[dataclasses.replace(entry.chunks[0], sizes=size)])
    md.storage_data[index] = dataclasses.replace(info, offset=offset,
                                                 length=len(buf.getvalue()))
    write_md(step_path, md)
    reseal(step_path)


def overlapping_records(step_path: str, key: str, copies: int) -> int:
    """Declare the JSON value ``key`` ``copies`` times its size, in ``copies`` chunks whose
    storage records all point at the one stored record (the sum of the records' lengths
    then covers the declared size). Returns the declared bytes."""
    md = read_md(step_path)
    fqn = "__json__." + key
    index, info = _record(md, fqn)
    entry = md.state_dict_metadata[fqn]
    n = entry.size[0]
    chunks = [dataclasses.replace(entry.chunks[0], offsets=torch.Size([i * n]),
                                  sizes=torch.Size([n])) for i in range(copies)]
    md.state_dict_metadata[fqn] = dataclasses.replace(entry, size=torch.Size([n * copies]),
                                                      chunks=chunks)
    del md.storage_data[index]
    for i in range(copies):
        md.storage_data[MetadataIndex(fqn, torch.Size([i * n]), i)] = info
    write_md(step_path, md)
    reseal(step_path)
    return n * copies


def entry_without_field(step_path: str, key: str, field_name: str) -> None:
    """``key``'s entry pickled without one of its fields (a TensorStorageMetadata whose
    ``__dict__`` lacks ``field_name``)."""
    md = read_md(step_path)
    entry = md.state_dict_metadata[key]
    bare = object.__new__(type(entry))
    bare.__dict__.update({k: v for k, v in entry.__dict__.items() if k != field_name})
    md.state_dict_metadata[key] = bare
    write_md(step_path, md)
    reseal(step_path)


def shard_link(step_path: str, key: str, outside: str) -> str:
    """Move ``key``'s shard to ``outside`` and leave a symbolic link to it in its place:
    sizes and checksums still match through the link. Returns the shard's name."""
    _, info = _record(read_md(step_path), key)
    path = os.path.join(step_path, info.relative_path)
    os.replace(path, outside)
    os.symlink(outside, path)
    return info.relative_path
