"""Read a DCP checkpoint without letting it run code or read outside its step.

Whoever can write a shard can rewrite the manifest, so a checksum proves nothing about
intent; everything DCP would trust in ``.metadata`` is checked instead:

  * DCP pickles ``.metadata`` and ``FileSystemReader.read_metadata`` unpickles it with plain
    ``pickle.load``. ``load_metadata`` unpickles with an allowlist of the few globals DCP's
    metadata is made of; anything else is refused before it is imported.
  * A byte item (``BytesStorageMetadata``) is read by DCP's default load planner with
    ``torch.load(weights_only=False)``, i.e. an arbitrary pickle in a shard file. slurmkit
    never writes one (staging.py turns every non-tensor value into a JSON uint8 tensor), so
    ``.metadata`` may hold tensor entries only, and ``SafeLoadPlanner``'s byte path refuses.
  * Every ``storage_data`` entry names a plain file of the step (no separator, no ``..``)
    that the manifest lists, and its byte range lies inside that file (``check_storage``);
    ``SafeReader.read_data`` checks the range again against the file it opens.
  * Every chunk lies inside its tensor and has a storage record, and no entry declares
    more bytes than are stored for it (a JSON value's buffer is allocated from that size).
  * No stream transforms: slurmkit writes none, and each one would run a decoder on
    untrusted bytes.
Tensors themselves are read by DCP with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import dataclasses
import enum
import io
import os
import pickle
from collections.abc import Mapping
from typing import Any, cast

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from slurmkit.errors import ActionableError
from slurmkit.store.manifest import UnsafeManifestError, check_name

# modules whose dataclasses and enums make up DCP metadata (plain records, no side effects)
_RECORD_MODULES = frozenset({
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.filesystem",
    "torch.distributed.checkpoint.planner",
})
_PATH_CLASSES = frozenset({"PurePath", "PurePosixPath", "PosixPath", "PureWindowsPath",
                           "WindowsPath", "Path"})
_FIX = ("treat the step as tampered with: restore falls back to an older step; find out "
        "who wrote it, then delete it (python -m slurmkit.store gc)")


class UnsafeMetadataError(ActionableError):
    """A checkpoint's .metadata holds something slurmkit never writes (it may be crafted)."""

    def __init__(self, detected: str, requirement: str | None = None,
                 fix: str | None = None) -> None:
        super().__init__(detected, requirement or "a DCP checkpoint of tensors only, every "
                         "byte range inside a file its manifest lists", fix or _FIX)


def _byte_item(what: str) -> UnsafeMetadataError:
    return UnsafeMetadataError(
        f"checkpoint .metadata stores {what} as a byte item (BytesStorageMetadata), which "
        "DCP would unpickle with torch.load(weights_only=False); slurmkit never writes one")


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module in _RECORD_MODULES and "." not in name:
            if name == "BytesStorageMetadata":
                raise _byte_item("an entry")
            obj = getattr(__import__(module, fromlist=[name]), name, None)
            if isinstance(obj, type) and (dataclasses.is_dataclass(obj)
                                          or issubclass(obj, enum.Enum)):
                return obj
        elif module == "torch" and "." not in name:
            obj = getattr(torch, name, None)
            if obj is torch.Size or isinstance(obj, (torch.dtype, torch.layout,
                                                     torch.memory_format)):
                return obj
        elif module == "torch.serialization" and name == "_get_layout":
            return torch.serialization._get_layout  # maps a layout's name to the layout
        elif module == "pathlib" and name in _PATH_CLASSES:
            import pathlib

            return getattr(pathlib, name)
        raise UnsafeMetadataError(
            f"checkpoint .metadata refers to {module}.{name}, which DCP metadata never "
            "contains; refusing to unpickle it")


def load_metadata(data: bytes) -> Metadata:
    """Unpickle ``.metadata`` through the allowlist and check its shape (``check_shape``)."""
    try:
        md = _MetadataUnpickler(io.BytesIO(data)).load()
    except UnsafeMetadataError:
        raise
    except Exception as exc:  # a truncated or garbled pickle: refused the same way
        raise UnsafeMetadataError(f"checkpoint .metadata does not unpickle ({exc!r})") from exc
    check_shape(md)
    return md


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_shape(md: Any) -> None:
    """Refuse a ``Metadata`` holding anything but tensor entries and plain storage records."""
    if type(md) is not Metadata:
        raise UnsafeMetadataError(f"checkpoint .metadata holds a {type(md).__name__}, "
                                  "not DCP Metadata")
    if not isinstance(md.state_dict_metadata, dict) or not isinstance(md.storage_data, dict):
        raise UnsafeMetadataError("checkpoint .metadata lacks its entry or storage table")
    for key, entry in md.state_dict_metadata.items():
        _check_entry(key, entry)
    stored: dict[str, int] = {}
    for index, info in md.storage_data.items():
        _check_record(md, index, info)
        stored[index.fqn] = stored.get(index.fqn, 0) + info.length
    for key, value in md.state_dict_metadata.items():
        entry = cast(TensorStorageMetadata, value)  # (checked above)
        # every chunk has its bytes somewhere, and an entry declares no more bytes than are
        # stored for it (a JSON value's load buffer is allocated from its declared size)
        missing = [list(c.offsets) for c in entry.chunks
                   if MetadataIndex(key, c.offsets) not in md.storage_data]
        if missing:
            raise UnsafeMetadataError(f"checkpoint .metadata declares chunks of {key!r} at "
                                      f"{missing[:3]} that no storage record holds")
        declared = entry.size.numel() * entry.properties.dtype.itemsize
        if declared > stored.get(key, 0):
            raise UnsafeMetadataError(f"checkpoint .metadata declares {key!r} as {declared} "
                                      f"bytes but stores {stored.get(key, 0)}")


def _check_entry(key: Any, entry: Any) -> None:
    """One entry of the table: a tensor record whose chunks lie inside the tensor."""
    if not isinstance(key, str):
        raise UnsafeMetadataError(f"checkpoint .metadata has a {type(key).__name__} key")
    if type(entry) is not TensorStorageMetadata:
        if type(entry).__name__ == "BytesStorageMetadata":
            raise _byte_item(f"key {key!r}")
        raise UnsafeMetadataError(f"checkpoint .metadata stores key {key!r} as a "
                                  f"{type(entry).__name__}, not a tensor")
    if (type(entry.properties) is not TensorProperties
            or not isinstance(entry.properties.dtype, torch.dtype)
            or type(entry.size) is not torch.Size
            or not isinstance(entry.chunks, list)
            or any(type(c) is not ChunkStorageMetadata for c in entry.chunks)):
        raise UnsafeMetadataError(f"checkpoint .metadata entry {key!r} is not a plain "
                                  "tensor record")
    for c in entry.chunks:
        if (type(c.offsets) is not torch.Size or type(c.sizes) is not torch.Size
                or not len(c.offsets) == len(c.sizes) == len(entry.size)
                or any(o < 0 or n < 0 or o + n > d
                       for o, n, d in zip(c.offsets, c.sizes, entry.size))):
            raise UnsafeMetadataError(f"checkpoint .metadata gives {key!r} (size "
                                      f"{list(entry.size)}) a chunk outside it")


def _check_record(md: Metadata, index: Any, info: Any) -> None:
    """One storage record: a plain file name, a byte range, no stream transforms."""
    if type(index) is not MetadataIndex or type(info) is not _StorageInfo:
        raise UnsafeMetadataError("checkpoint .metadata has a storage record of type "
                                  f"{type(index).__name__} -> {type(info).__name__}")
    if index.fqn not in md.state_dict_metadata:
        raise UnsafeMetadataError(f"checkpoint .metadata stores bytes for {index.fqn!r}, "
                                  "which no tensor entry declares")
    try:
        check_name(info.relative_path, "storage_data file name")
    except UnsafeManifestError as exc:
        raise UnsafeMetadataError(exc.detected, exc.requirement, exc.fix) from exc
    if not (_is_int(info.offset) and _is_int(info.length)
            and info.offset >= 0 and info.length >= 0):
        raise UnsafeMetadataError(f"checkpoint .metadata gives {index.fqn!r} the byte "
                                  f"range offset={info.offset!r} length={info.length!r}")
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


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner whose byte path refuses (it would unpickle anything)."""

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                raise _byte_item(f"key {item.storage_index.fqn!r}")
        return plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise _byte_item(f"key {read_item.storage_index.fqn!r}")


class SafeReader(FileSystemReader):
    """DCP's FileSystemReader whose metadata is unpickled through the allowlist and checked,
    and which reads only plain files of its directory, only inside their sizes."""

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
                sizes[name] = os.path.getsize(self.fs.concat_path(self.path, name))
        check_storage(Metadata({}, storage_data={
            item.storage_index: self.storage_data[item.storage_index] for item in plan.items}),
            sizes)
        return super().read_data(plan, planner)
