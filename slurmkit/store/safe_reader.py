"""Read a DCP checkpoint without letting it run code or read outside its step.

Whoever can write a shard can rewrite the manifest, so a checksum proves nothing about
intent; everything DCP would trust in ``.metadata`` is checked instead:

  * DCP pickles ``.metadata`` and ``FileSystemReader.read_metadata`` unpickles it with plain
    ``pickle.load``. ``load_metadata`` unpickles it into inert stand-ins of the few classes
    DCP's metadata is made of (metadata_pickle.py: no real class ever reaches pickle, so
    BUILD cannot set an attribute on one), anything else is refused before it is imported,
    and the real dataclasses are built from checked values.
  * A byte item (``BytesStorageMetadata``) is read by DCP's default load planner with
    ``torch.load(weights_only=False)``, i.e. an arbitrary pickle in a shard file. slurmkit
    never writes one (staging.py turns every non-tensor value into a JSON uint8 tensor), so
    ``.metadata`` may hold tensor entries only, and ``SafeLoadPlanner``'s byte path refuses.
  * Every ``storage_data`` entry names a plain file of the step (no separator, no ``..``)
    that the manifest lists, and its byte range lies inside that file (``check_storage``);
    ``SafeReader.read_data`` checks the range again against the file it opens.
  * Every key's chunks tile its tensor (inside it, no overlap, no gap), each has exactly one
    storage record, the records' byte ranges do not overlap within a file, and no entry
    declares more bytes than are stored for it (a JSON value's buffer is allocated from
    that size: overlapping records once let 1 MiB declare 256 MiB).
  * Files are opened without following a link (nofollow.py).
  * No stream transforms: slurmkit writes none, and each one would run a decoder on
    untrusted bytes.
Tensors themselves are read by DCP with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from slurmkit.errors import SlurmkitError
from slurmkit.store import nofollow
from slurmkit.store.manifest import UnsafeManifestError, check_name
from slurmkit.store.metadata_pickle import UnsafeMetadataError, byte_item, to_metadata, unpickle
from slurmkit.store.staging import JSON_PREFIX

__all__ = ["MAX_JSON_BYTES", "NoFollowFileSystem", "SafeLoadPlanner", "SafeReader", "TemplateMisfitError", "UnsafeMetadataError",
           "check_shape", "check_storage", "load_metadata"]
MAX_JSON_BYTES = 256 << 20  # one JSON value of the state (its load buffer is this big)
_byte_item = byte_item


def load_metadata(data: bytes) -> Metadata:
    """Unpickle ``.metadata`` into stand-ins, build the real Metadata from checked values,
    and check its shape (``check_shape``). Anything else is an UnsafeMetadataError."""
    try:
        md = to_metadata(unpickle(data), budget=len(data) + 64)
    except UnsafeMetadataError:
        raise
    except Exception as exc:  # a truncated or garbled pickle: refused the same way
        raise UnsafeMetadataError("checkpoint .metadata does not unpickle "
                                  f"({type(exc).__name__}: {str(exc)[:200]})") from exc
    check_shape(md)
    return md


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_shape(md: Metadata) -> None:
    """Refuse a ``Metadata`` whose entries, chunks and byte ranges are not what DCP writes:
    tensor entries whose chunks tile them, one storage record per chunk, byte ranges that
    do not overlap, no entry declaring more bytes than its records hold."""
    entries: dict[str, TensorStorageMetadata] = {}
    for key, entry in md.state_dict_metadata.items():
        entries[key] = _check_entry(key, entry)
        _check_tiling(key, entries[key])
    stored: dict[str, int] = {}
    chunk_at = {key: {tuple(c.offsets) for c in e.chunks} for key, e in entries.items()}
    for index, info in md.storage_data.items():
        _check_record(chunk_at, index, info)
        stored[index.fqn] = stored.get(index.fqn, 0) + info.length
    _check_ranges(md)
    for key, entry in entries.items():
        missing = [list(c.offsets) for c in entry.chunks
                   if MetadataIndex(key, c.offsets) not in md.storage_data]
        if missing:
            raise UnsafeMetadataError(f"checkpoint .metadata declares chunks of {key!r} at "
                                      f"{missing[:3]} that no storage record holds")
        declared = entry.size.numel() * entry.properties.dtype.itemsize
        if declared > stored.get(key, 0):
            raise UnsafeMetadataError(f"checkpoint .metadata declares {key!r} as {declared} "
                                      f"bytes but stores {stored.get(key, 0)}")


def _check_entry(key: str, entry: Any) -> TensorStorageMetadata:
    """One entry of the table: a tensor record whose chunks lie inside the tensor (a JSON
    value: one row of bytes, at most MAX_JSON_BYTES)."""
    if type(entry) is not TensorStorageMetadata:
        raise UnsafeMetadataError(f"checkpoint .metadata stores key {key!r} as a "
                                  f"{type(entry).__name__}, not a tensor")
    for c in entry.chunks:
        if (not len(c.offsets) == len(c.sizes) == len(entry.size)
                or any(o + n > d for o, n, d in zip(c.offsets, c.sizes, entry.size))):
            raise UnsafeMetadataError(f"checkpoint .metadata gives {key!r} (size "
                                      f"{list(entry.size)}) a chunk outside it")
    if key.startswith(JSON_PREFIX) and (
            entry.properties.dtype != torch.uint8 or len(entry.size) != 1
            or entry.size[0] > MAX_JSON_BYTES):
        raise UnsafeMetadataError(
            f"checkpoint .metadata declares the JSON value {key!r} as a {entry.properties.dtype}"
            f" tensor of size {list(entry.size)}; slurmkit writes one row of at most "
            f"{MAX_JSON_BYTES} bytes")
    return entry


def _check_tiling(key: str, entry: TensorStorageMetadata) -> None:
    """The chunks cover every element of the tensor exactly once. Checked on the grid of
    the chunks' own boundaries (one cell per chunk for DCP's shardings)."""
    if entry.size.numel() == 0 or _tiles_along_one_dim(entry):
        return
    bounds = [sorted({0, d} | {c.offsets[i] for c in entry.chunks}
                     | {c.offsets[i] + c.sizes[i] for c in entry.chunks})
              for i, d in enumerate(entry.size)]
    shape = [len(b) - 1 for b in bounds]
    if math.prod(shape) > max(1 << 16, 4 * len(entry.chunks)):
        raise UnsafeMetadataError(f"checkpoint .metadata splits {key!r} into "
                                  f"{len(entry.chunks)} chunks that form no grid")
    where = [{v: j for j, v in enumerate(b)} for b in bounds]
    if math.prod(shape) == len(entry.chunks) and len({
            tuple(w[o] for w, o in zip(where, c.offsets)) for c in entry.chunks
            if all(w[o + n] == w[o] + 1 for w, o, n in zip(where, c.offsets, c.sizes))
    }) == len(entry.chunks):
        return  # one chunk per cell of a grid (DCP's shardings): a tiling
    grid = torch.zeros(shape, dtype=torch.int32)
    for c in entry.chunks:
        grid[tuple(slice(w[o], w[o + n]) for w, o, n in zip(where, c.offsets, c.sizes))] += 1
    if not bool((grid == 1).all()):
        raise UnsafeMetadataError(f"checkpoint .metadata gives {key!r} chunks that overlap "
                                  "or leave part of it uncovered")


def _tiles_along_one_dim(entry: TensorStorageMetadata) -> bool:
    """The common sharding, checked in O(n log n): every chunk spans the tensor in all
    dimensions but one, and along that one they follow each other from 0 to its end."""
    size = list(entry.size)
    split = {i for c in entry.chunks for i, (o, n) in enumerate(zip(c.offsets, c.sizes))
             if o != 0 or n != size[i]}
    if len(split) > 1:
        return False
    d = split.pop() if split else 0
    if not size:
        return len(entry.chunks) == 1
    end = 0
    for o, n in sorted((c.offsets[d], c.sizes[d]) for c in entry.chunks):
        if o != end or n == 0:
            return False
        end = o + n
    return end == size[d]


def _check_ranges(md: Metadata) -> None:
    """No two storage records share a byte of a file."""
    by_file: dict[str, list[tuple[int, int, str]]] = {}
    for index, info in md.storage_data.items():
        by_file.setdefault(info.relative_path, []).append(
            (info.offset, info.offset + info.length, index.fqn))
    for name, ranges in by_file.items():
        ranges.sort()
        for (_, end, a), (start, _, b) in zip(ranges, ranges[1:]):
            if start < end:
                raise UnsafeMetadataError(
                    f"checkpoint .metadata stores {a!r} and {b!r} in overlapping bytes of "
                    f"{name!r} (one byte counted twice lets a value claim more than is "
                    "stored)")


def _check_record(chunk_at: Mapping[str, set[tuple[int, ...]]], index: MetadataIndex,
                  info: Any) -> None:
    """One storage record: a chunk of a declared key (``chunk_at``: key -> its chunks'
    offsets), a plain file name, a byte range, no stream transforms."""
    offsets = chunk_at.get(index.fqn)
    if offsets is None:
        raise UnsafeMetadataError(f"checkpoint .metadata stores bytes for {index.fqn!r}, "
                                  "which no tensor entry declares")
    if index.offset is None or tuple(index.offset) not in offsets:
        raise UnsafeMetadataError(f"checkpoint .metadata stores bytes for {index.fqn!r} at "
                                  f"{list(index.offset or [])}, where it has no chunk")
    try:
        check_name(info.relative_path, "storage_data file name")
    except UnsafeManifestError as exc:
        raise UnsafeMetadataError(exc.detected, exc.requirement, exc.fix) from exc
    if not (_is_int(info.offset) and _is_int(info.length)
            and info.offset >= 0 and info.length >= 0):
        raise UnsafeMetadataError(f"checkpoint .metadata gives {index.fqn!r} the byte "
                                  f"range offset={info.offset!r:.40} length={info.length!r:.40}")
    if info.transform_descriptors:
        raise UnsafeMetadataError(
            f"checkpoint .metadata asks for stream transforms "
            f"{list(info.transform_descriptors)!r} on {index.fqn!r}; slurmkit writes none")


def check_storage(md: Metadata, sizes: Mapping[str, int]) -> None:
    """Every storage record names a file of ``sizes`` (the manifest's verified files, name ->
    bytes) and its byte range lies inside it. The whole table is checked, not only this
    rank's part: a step one rank would refuse is refused by all."""
    for index, info in md.storage_data.items():
        size = sizes.get(info.relative_path)
        if size is None:
            raise UnsafeMetadataError(
                f"checkpoint .metadata reads {index.fqn!r} from {info.relative_path!r}, a file "
                "the step's manifest does not list")
        if info.offset + info.length > size:
            raise UnsafeMetadataError(
                f"checkpoint .metadata reads {index.fqn!r} from bytes {info.offset}.."
                f"{info.offset + info.length} of {info.relative_path!r}, which has {size} "
                "bytes (a shard truncated, its manifest rewritten to match?)")


class TemplateMisfitError(SlurmkitError):
    """DCP's planner cannot fit a checkpoint to the template (a changed model or layout)."""


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner whose byte path refuses (it would unpickle anything), and
    whose planning failures say they are the template's (TemplateMisfitError), not the
    step's bytes."""

    def create_local_plan(self) -> LoadPlan:
        try:
            plan = super().create_local_plan()
        except UnsafeMetadataError:
            raise
        except Exception as exc:
            raise TemplateMisfitError(str(exc)[:600]) from exc
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                raise _byte_item(f"key {item.storage_index.fqn!r}")
        return plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise _byte_item(f"key {read_item.storage_index.fqn!r}")


class NoFollowFileSystem(FileSystem):
    """DCP's local file system, for reading only: a file is opened relative to its
    directory without following a link, and must be a regular file (``where`` maps a path
    to the (root, relative path) to open it by, every component below root link-free)."""

    def __init__(self, where: Mapping[str, tuple[str, str]] | None = None) -> None:
        super().__init__()
        self.where = dict(where or {})

    def _split(self, path: str | os.PathLike[str]) -> tuple[str, str]:
        p = os.fspath(path)
        return self.where.get(p) or nofollow.split(p)

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
        if mode != "rb":
            raise UnsafeMetadataError(f"a checkpoint reader asked to open {path!s} for {mode}")
        with nofollow.opened(*self._split(path)) as f:
            yield f  # type: ignore[misc]

    def size(self, path: str | os.PathLike[str]) -> int:
        fd = nofollow.open_fd(*self._split(path))
        try:
            return os.fstat(fd).st_size
        finally:
            os.close(fd)


class SafeReader(FileSystemReader):
    """DCP's FileSystemReader whose metadata is unpickled into stand-ins and checked, and
    which reads only regular files of its directory (no link), only inside their sizes."""

    def __init__(self, path: str | os.PathLike[str], **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.fs: NoFollowFileSystem = NoFollowFileSystem()

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            md = load_metadata(f.read())
        meta = getattr(md, "storage_meta", None) or StorageMeta()
        meta.load_id = self.load_id
        md.storage_meta = meta
        return md

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        sizes: dict[str, int] = {}
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                raise _byte_item(f"key {item.storage_index.fqn!r}")
            info = self.storage_data[item.storage_index]
            name = info.relative_path
            if name not in sizes:
                check_name(name, "storage_data file name")
                sizes[name] = self.fs.size(self.fs.concat_path(self.path, name))
        check_storage(Metadata({}, storage_data={
            item.storage_index: self.storage_data[item.storage_index] for item in plan.items}),
            sizes)
        return super().read_data(plan, planner)
