"""Unpickle DCP's ``.metadata`` without handing pickle a single real class.

Pickle's BUILD opcode sets state on whatever object is on its stack: with slot state
``(None, {k: v})`` it runs ``setattr``, and if that object is a class (put there by GLOBAL),
the class changes for the whole process, whether or not the load is refused afterwards (a
40-byte ``.metadata`` once replaced ``PosixPath._str``). So here every global the allowlist
accepts resolves to an inert stand-in of this module, never the class it names:

  * stand-in classes have a metaclass whose ``__setattr__`` refuses, and a ``__setstate__``
    that refuses when looked up on the class: BUILD on a class fails before any state is set;
  * on an instance BUILD only records the state in the stand-in's own slot; nothing runs;
  * dtype, layout, ``torch.Size`` and ``pathlib`` paths are stand-ins too (a path becomes a
    ``str``).
After loading, ``convert`` checks every stand-in's type and fields and only then builds the
real DCP dataclasses, through their constructors, from values of the expected types.

Before the C unpickler runs, ``pickle_scan.scan`` walks the opcodes: only those DCP's
pickles use are accepted, and tuples may nest only a few levels (hashing a tuple nested a
million deep, as a dict key, overflows the C stack: a segfault, not an exception).
"""

from __future__ import annotations

import dataclasses
import io
import pathlib
import pickle
from typing import Any, ClassVar

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from slurmkit.errors import ActionableError
from slurmkit.store.pickle_scan import PickleShapeError, scan

MAX_TUPLE_DEPTH = 16  # DCP nests tuples 2 deep (a Size's argument tuple)
MAX_DIMS = 64
_FIX = ("treat the step as tampered with: restore falls back to an older step; find out "
        "who wrote it, then delete it (python -m slurmkit.store gc)")


class UnsafeMetadataError(ActionableError):
    """A checkpoint's .metadata holds something slurmkit never writes (it may be crafted)."""

    def __init__(self, detected: str, requirement: str | None = None,
                 fix: str | None = None) -> None:
        super().__init__(detected, requirement or "a DCP checkpoint of tensors only, every "
                         "byte range inside a file its manifest lists", fix or _FIX)


def byte_item(what: str) -> UnsafeMetadataError:
    return UnsafeMetadataError(
        f"checkpoint .metadata stores {what} as a byte item (BytesStorageMetadata), which "
        "DCP would unpickle with torch.load(weights_only=False); slurmkit never writes one")


# -- the stand-ins ---------------------------------------------------------------------

class _Sealed(type):
    """Metaclass of every stand-in: no attribute of the class can be set or deleted."""

    def __setattr__(cls, name: str, value: Any) -> None:
        raise UnsafeMetadataError(f"checkpoint .metadata sets attribute {name[:40]!r} on the "
                                  f"class {cls.__name__} itself; DCP metadata never does")

    def __delattr__(cls, name: str) -> None:
        raise UnsafeMetadataError(f"checkpoint .metadata deletes attribute {name[:40]!r} of "
                                  f"the class {cls.__name__}; DCP metadata never does")


class _InstanceState:
    """``__setstate__`` of the stand-ins: bound on an instance; refused on the class, so
    pickle's BUILD with a class on its stack fails before it sets anything."""

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        if obj is None:
            raise UnsafeMetadataError(
                f"checkpoint .metadata applies state to the class {owner.__name__} itself "
                "(pickle BUILD on a class); DCP metadata never does")
        return obj.build


class Stand(metaclass=_Sealed):
    """An object of an allowlisted class, as the pickle describes it: the arguments it was
    called with and the state BUILD gave it. Nothing else happens to it."""

    __slots__ = ("args", "state")
    args: tuple[Any, ...]
    state: Any
    real: ClassVar[str] = ""
    buildable: ClassVar[bool] = True
    __setstate__ = _InstanceState()

    def __new__(cls, *args: Any, **kwargs: Any) -> Stand:
        if kwargs:
            raise UnsafeMetadataError(f"checkpoint .metadata builds a {cls.real} with keyword "
                                      "arguments; DCP metadata never does")
        self = object.__new__(cls)
        object.__setattr__(self, "args", args)
        object.__setattr__(self, "state", None)
        return self

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setattr__(self, name: str, value: Any) -> None:
        raise UnsafeMetadataError(f"checkpoint .metadata sets {name[:40]!r} on a {self.real}")

    def build(self, state: Any) -> None:
        if not self.buildable or self.state is not None:
            raise UnsafeMetadataError(f"checkpoint .metadata applies state to a {self.real} "
                                      "that takes none (or twice)")
        object.__setattr__(self, "state", state)


class Token(Stand):
    """A torch dtype, layout or the layout factory, by name."""

    __slots__ = ()
    real = "torch constant"
    buildable = False


class LayoutFactory(Stand):
    """``torch.serialization._get_layout``: called with a layout's name, gives its token."""

    __slots__ = ()
    real = "torch.serialization._get_layout"
    buildable = False

    def __call__(self, name: Any) -> Token:
        if type(name) is not str or name not in _LAYOUTS:
            raise UnsafeMetadataError("checkpoint .metadata names an unknown tensor layout")
        return Token("layout", name)


_RECORDS: dict[type, type] = {cls: _Sealed(cls.__name__, (Stand,), {"__slots__": (), "real": cls.__name__})
            for cls in (Metadata, TensorStorageMetadata, TensorProperties,
                        ChunkStorageMetadata, MetadataIndex, StorageMeta, _StorageInfo)}
_ENUM = _Sealed("_MEM_FORMAT_ENCODING", (Stand,), {"__slots__": (), "real": "memory format",
                                                   "buildable": False})
_SIZE = _Sealed("Size", (Stand,), {"__slots__": (), "real": "torch.Size", "buildable": False})
_POSIX = _Sealed("PosixPath", (Stand,), {"__slots__": (), "real": "path", "buildable": False})
_WINDOWS = _Sealed("WindowsPath", (Stand,), {"__slots__": (), "real": "path",
                                             "buildable": False})
_LAYOUTS = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}
_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_BY_NAME = {(m, cls.__name__): stand for cls, stand in _RECORDS.items()
            for m in _DCP_MODULES if cls.__module__ == m}
_BY_NAME[("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING")] = _ENUM
_BY_NAME[("torch", "Size")] = _SIZE
for _n in ("PurePath", "PurePosixPath", "PosixPath", "Path"):
    _BY_NAME[("pathlib", _n)] = _POSIX
for _n in ("PureWindowsPath", "WindowsPath"):
    _BY_NAME[("pathlib", _n)] = _WINDOWS


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name == "BytesStorageMetadata" and module in _DCP_MODULES:
            raise byte_item("an entry")
        stand = _BY_NAME.get((module, name))
        if stand is not None:
            return stand
        # (vars, not getattr: torch's module __getattr__ imports submodules by name)
        if module == "torch" and isinstance(vars(torch).get(name), torch.dtype):
            return Token("dtype", name)
        if module == "torch.serialization" and name == "_get_layout":
            return LayoutFactory()
        raise UnsafeMetadataError(
            f"checkpoint .metadata refers to {module[:80]}.{name[:80]}, which DCP metadata "
            "never contains; refusing to unpickle it")

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeMetadataError("checkpoint .metadata holds a persistent id")


def unpickle(data: bytes) -> Any:
    """The pickle's object tree, made of builtins and stand-ins only (``scan`` first)."""
    try:
        scan(data, MAX_TUPLE_DEPTH)
    except PickleShapeError as exc:
        raise UnsafeMetadataError(f"checkpoint .metadata {exc}; DCP metadata never "
                                  "does") from None
    return _Unpickler(io.BytesIO(data)).load()


# -- stand-ins to DCP's dataclasses ----------------------------------------------------

def _what(x: Any) -> str:
    """What ``x`` is, for a message: a type name, never its (attacker's) repr."""
    return x.real if isinstance(x, Stand) else type(x).__name__


def _refuse(detected: str) -> UnsafeMetadataError:
    return UnsafeMetadataError(f"checkpoint .metadata {detected}")


def _is_int(v: Any) -> bool:
    return type(v) is int


def _is(x: Any, stand: type) -> bool:
    """``x`` is exactly a ``stand`` (no subclass, no lookalike)."""
    return type(x) is stand


class Converter:
    """Builds the real ``Metadata`` from a checked stand-in tree. Each stand-in is
    converted once (a pickle may reference one object many times: no amplification)."""

    def __init__(self, budget: int) -> None:
        self.memo: dict[int, Any] = {}
        self.budget = budget  # containers and values visited in planner_data at most

    def fields(self, x: Any, cls: type) -> dict[str, Any]:
        """A dataclass stand-in's fields (defaults filled in), checked against ``cls``."""
        if not _is(x, _RECORDS[cls]):
            raise _refuse(f"holds a {_what(x)} where DCP writes a {cls.__name__}")
        state = x.state if x.state is not None else {}
        if x.args or type(state) is not dict or any(type(k) is not str for k in state):
            raise _refuse(f"gives a {cls.__name__} arguments or state DCP never writes")
        known = _FIELDS[cls]
        if not known.keys() >= state.keys():
            extra = next(k for k in state if k not in known)
            raise _refuse(f"gives a {cls.__name__} the unknown field {extra[:60]!r}")
        if len(state) == len(known):
            return state
        out = {}
        for name, f in known.items():
            if name in state:
                out[name] = state[name]
            elif f.default is not dataclasses.MISSING:
                out[name] = f.default
            elif f.default_factory is not dataclasses.MISSING:
                out[name] = f.default_factory()
            else:
                raise _refuse(f"has a {cls.__name__} without its field {name!r}")
        return out

    def once(self, x: Any, make: Any) -> Any:
        got = self.memo.get(id(x))
        if got is None:
            got = self.memo[id(x)] = make(x)
        return got

    def metadata(self, x: Any) -> Metadata:
        f = self.fields(x, Metadata)
        sdm, sd = f["state_dict_metadata"], f["storage_data"]
        if type(sdm) is not dict or type(sd) is not dict:
            raise _refuse("lacks its entry or storage table")
        entries = {}
        for key, entry in sdm.items():
            if type(key) is not str:
                raise _refuse(f"has a {_what(key)} key")
            entries[key] = self.once(entry, self.tensor_entry)
        storage: dict[MetadataIndex, _StorageInfo] = {}
        for index, info in sd.items():
            real = self.once(index, self.index)
            if real in storage:
                raise _refuse(f"stores {real.fqn[:200]!r} at {list(real.offset or [])} twice")
            storage[real] = self.once(info, self.storage_info)
        meta = f["storage_meta"]
        version = f["version"]
        if version is not None and type(version) is not str:
            raise _refuse(f"has a {_what(version)} version")
        return Metadata(entries, planner_data=self.plain(f["planner_data"], 0),
                        storage_data=storage,
                        storage_meta=None if meta is None else self.once(meta, self.storage_meta),
                        version=version)

    def tensor_entry(self, x: Any) -> TensorStorageMetadata:
        f = self.fields(x, TensorStorageMetadata)
        if type(f["chunks"]) is not list:
            raise _refuse("has a tensor entry whose chunks are not a list")
        return TensorStorageMetadata(self.once(f["properties"], self.properties),
                                     self.once(f["size"], self.size),
                                     [self.once(c, self.chunk) for c in f["chunks"]])

    def properties(self, x: Any) -> TensorProperties:
        if not _is(x, _RECORDS[TensorProperties]) or x.args:
            raise _refuse(f"holds a {_what(x)} where DCP writes TensorProperties")
        state = x.state
        if type(state) is tuple and len(state) == 5:  # TensorProperties.__getstate__'s form
            dtype, layout, grad, fmt, pin = state
        else:
            f = self.fields(x, TensorProperties)
            dtype, layout, grad, fmt, pin = (f["dtype"], f["layout"], f["requires_grad"],
                                             f["memory_format"], f["pin_memory"])
        if not (type(dtype) is Token and dtype.args[0] == "dtype"
                and type(layout) is Token and layout.args[0] == "layout"
                and type(grad) is bool and type(pin) is bool and type(fmt) is _ENUM
                and len(fmt.args) == 1 and _is_int(fmt.args[0])):
            raise _refuse("has tensor properties of types DCP never writes")
        try:
            enc = _MEM_FORMAT_ENCODING(fmt.args[0])
        except ValueError:
            raise _refuse("names an unknown memory format") from None
        memory_format = {_MEM_FORMAT_ENCODING.TORCH_CHANNELS_LAST: torch.channels_last,
                         _MEM_FORMAT_ENCODING.TORCH_PRESERVE_FORMAT: torch.preserve_format
                         }.get(enc, torch.contiguous_format)
        return TensorProperties(dtype=getattr(torch, dtype.args[1]),
                                layout=_LAYOUTS[layout.args[1]], requires_grad=grad,
                                memory_format=memory_format, pin_memory=pin)

    def size(self, x: Any) -> torch.Size:
        if type(x) is not _SIZE or len(x.args) != 1 or type(x.args[0]) not in (tuple, list):
            raise _refuse(f"holds a {_what(x)} where DCP writes a torch.Size")
        dims = x.args[0]
        if len(dims) > MAX_DIMS or not all(_is_int(d) and d >= 0 for d in dims):
            raise _refuse("has a size that is not a short list of non-negative integers")
        return torch.Size(dims)

    def chunk(self, x: Any) -> ChunkStorageMetadata:
        f = self.fields(x, ChunkStorageMetadata)
        return ChunkStorageMetadata(offsets=self.once(f["offsets"], self.size),
                                    sizes=self.once(f["sizes"], self.size))

    def index(self, x: Any) -> MetadataIndex:
        f = self.fields(x, MetadataIndex)
        fqn, offset, index = f["fqn"], f["offset"], f["index"]
        if type(fqn) is not str or not (index is None or _is_int(index)):
            raise _refuse("has a storage index of types DCP never writes")
        return MetadataIndex(fqn, None if offset is None else self.once(offset, self.size),
                             index)

    def storage_info(self, x: Any) -> _StorageInfo:
        f = self.fields(x, _StorageInfo)
        td = f["transform_descriptors"]
        if td is not None and (type(td) not in (list, tuple) or len(td) > 16
                               or any(type(t) is not str or len(t) > 200 for t in td)):
            raise _refuse("has stream transforms of types DCP never writes")
        return _StorageInfo(f["relative_path"], f["offset"], f["length"], td)

    def storage_meta(self, x: Any) -> StorageMeta:
        f = self.fields(x, StorageMeta)
        cid = f["checkpoint_id"]
        if type(cid) in (_POSIX, _WINDOWS):
            cid = self.path(cid)
        modules = f["modules"]
        if not (cid is None or type(cid) is str) or not all(
                v is None or type(v) is str for v in (f["save_id"], f["load_id"])) or (
                type(modules) is not list or any(type(m) is not str for m in modules)):
            raise _refuse("has storage meta of types DCP never writes")
        return StorageMeta(cid, f["save_id"], f["load_id"], list(modules))

    def path(self, x: Any) -> str:
        """A pathlib path as ``str`` (the real class is never touched)."""
        if not all(type(p) is str for p in x.args) or len(x.args) > 4096:
            raise _refuse("has a path made of something other than strings")
        flavour = pathlib.PureWindowsPath if type(x) is _WINDOWS else pathlib.PurePosixPath
        return str(flavour(*x.args))

    def plain(self, v: Any, depth: int) -> Any:
        """``v`` if it is plain data (None, bool, int, float, str, tuples, lists and dicts of
        these, nested at most 8 deep, within the visit budget), else refused."""
        self.budget -= 1
        if self.budget < 0 or depth > 8:
            raise _refuse("has planner data nested too deep or too large")
        t = type(v)
        if v is None or t in (bool, int, float, str):
            return v
        if t in (list, tuple):
            for item in v:
                self.plain(item, depth + 1)
            return v
        if t is dict:
            for k, item in v.items():
                if type(k) not in (str, int):
                    raise _refuse(f"has planner data with a {_what(k)} key")
                self.plain(item, depth + 1)
            return v
        raise _refuse(f"has a {_what(v)} in its planner data")


_FIELDS = {cls: {f.name: f for f in dataclasses.fields(cls)} for cls in _RECORDS}


def to_metadata(tree: Any, budget: int) -> Metadata:
    """The real ``Metadata`` from ``unpickle``'s tree, or UnsafeMetadataError."""
    if type(tree) is not _RECORDS[Metadata]:
        raise _refuse(f"holds a {_what(tree)}, not DCP Metadata")
    return Converter(budget).metadata(tree)
