"""Read DCP's ``.metadata`` without letting it run code.

DCP pickles its checkpoint metadata and ``FileSystemReader.read_metadata`` unpickles it with
plain ``pickle.load``: a crafted ``.metadata`` could run any code on every rank that restores
(the shards themselves are read with ``weights_only=True``). A checksum does not help: whoever
can write the file can write the manifest. ``SafeReader`` unpickles with an allowlist of the
few globals DCP's metadata is made of; anything else is refused before it is imported.
"""

from __future__ import annotations

import dataclasses
import enum
import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from slurmkit.errors import SlurmkitError

# modules whose dataclasses and enums make up DCP metadata (plain records, no side effects)
_RECORD_MODULES = frozenset({
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.filesystem",
    "torch.distributed.checkpoint.planner",
})
_PATH_CLASSES = frozenset({"PurePath", "PurePosixPath", "PosixPath", "PureWindowsPath",
                           "WindowsPath", "Path"})


class UnsafeMetadataError(SlurmkitError):
    """A checkpoint's .metadata names something DCP metadata never contains."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module in _RECORD_MODULES and "." not in name:
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
            "contains; refusing to unpickle it (the file may have been crafted)")


def load_metadata(data: bytes) -> Metadata:
    md = _MetadataUnpickler(io.BytesIO(data)).load()
    if not isinstance(md, Metadata):
        raise UnsafeMetadataError(f"checkpoint .metadata holds a {type(md).__name__}, "
                                  "not DCP Metadata")
    return md


class SafeReader(FileSystemReader):
    """DCP's FileSystemReader whose metadata is unpickled through the allowlist."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            md = load_metadata(f.read())
        meta = getattr(md, "storage_meta", None) or StorageMeta()
        meta.load_id = self.load_id
        md.storage_meta = meta
        return md
