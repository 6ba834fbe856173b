"""DCP's save steps driven over the store's Coordinator, so a save needs no process group.

``dcp.save`` over a group gathers every rank's plan on the coordinator, scatters the global
plans, gathers the write results, then broadcasts the finished checkpoint metadata to every
rank: that metadata names every chunk of every rank, so with a sharded state each rank
receives O(N) bytes per save, and the group itself is a world-sized full mesh. Here the same
planner and storage-writer calls (DCP's public extension points, in the order
``state_dict_saver`` makes them) run with the exchanges done through the Coordinator:
plans and write results go to the root (O(N) there, as the metadata's writer needs them),
each rank gets back only its own plan, and all learn only whether the save worked.

Plans travel as JSON (``encode_plan``/``decode_plan``), never pickle: decoding accepts only
the few dataclasses a save plan is made of, with checked field types.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo, _StoragePrefix
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    BytesIOWriteData,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult

from slurmkit.store.coord import CoordinationError, Coordinator


class PlanError(CoordinationError):
    """A plan or write result from another rank does not decode."""


# -- JSON codec -----------------------------------------------------------------------------
def _size(x: Any) -> list[int] | None:
    return None if x is None else [int(v) for v in x]


def _tsize(x: Any, what: str) -> torch.Size:
    if not isinstance(x, list) or not all(isinstance(v, int) and not isinstance(v, bool)
                                          for v in x):
        raise PlanError(f"{what}: expected a list of ints, got {type(x).__name__}")
    return torch.Size(x)


def _torch_attr(name: Any, kind: type, what: str) -> Any:
    if not isinstance(name, str) or not name.startswith("torch."):
        raise PlanError(f"{what}: {name!r} is not a torch attribute name")
    value = getattr(torch, name[len("torch."):], None)
    if not isinstance(value, kind):
        raise PlanError(f"{what}: {name!r} is not a {kind.__name__}")
    return value


def _index(i: MetadataIndex) -> dict[str, Any]:
    return {"fqn": i.fqn, "offset": _size(i.offset), "index": i.index}


def _dec_index(d: Any) -> MetadataIndex:
    if not isinstance(d, dict) or not isinstance(d.get("fqn"), str):
        raise PlanError("metadata index without an fqn")
    off = d.get("offset")
    idx = d.get("index")
    if idx is not None and (not isinstance(idx, int) or isinstance(idx, bool)):
        raise PlanError("metadata index: index is not an int")
    return MetadataIndex(d["fqn"], None if off is None else _tsize(off, "index offset"), idx)


def _item(w: WriteItem) -> dict[str, Any]:
    out: dict[str, Any] = {"index": _index(w.index), "type": w.type.name}
    if w.bytes_io_data is not None:
        out["bytes"] = int(w.bytes_io_data.nbytes)
    if w.tensor_data is not None:
        t, p = w.tensor_data, w.tensor_data.properties
        out["tensor"] = {"offsets": _size(t.chunk.offsets), "sizes": _size(t.chunk.sizes),
                         "size": _size(t.size), "dtype": str(p.dtype), "layout": str(p.layout),
                         "requires_grad": bool(p.requires_grad),
                         "memory_format": str(p.memory_format),
                         "pin_memory": bool(p.pin_memory)}
    return out


def _dec_item(d: Any) -> WriteItem:
    if not isinstance(d, dict) or d.get("type") not in WriteItemType.__members__:
        raise PlanError("write item of unknown type")
    bytes_io = None
    if d.get("bytes") is not None:
        if not isinstance(d["bytes"], int) or isinstance(d["bytes"], bool):
            raise PlanError("write item: bytes is not an int")
        bytes_io = BytesIOWriteData(nbytes=d["bytes"])
    tensor = None
    if d.get("tensor") is not None:
        t = d["tensor"]
        if not isinstance(t, dict):
            raise PlanError("write item: tensor is not a mapping")
        props = TensorProperties(
            dtype=_torch_attr(t.get("dtype"), torch.dtype, "dtype"),
            layout=_torch_attr(t.get("layout"), torch.layout, "layout"),
            requires_grad=bool(t.get("requires_grad")),
            memory_format=_torch_attr(t.get("memory_format"), torch.memory_format,
                                      "memory_format"),
            pin_memory=bool(t.get("pin_memory")))
        tensor = TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=_tsize(t.get("offsets"), "chunk offsets"),
                                       sizes=_tsize(t.get("sizes"), "chunk sizes")),
            properties=props, size=_tsize(t.get("size"), "tensor size"))
    return WriteItem(index=_dec_index(d.get("index")), type=WriteItemType[d["type"]],
                     bytes_io_data=bytes_io, tensor_data=tensor)


def _path(p: Any) -> list[Any]:
    return [x if isinstance(x, (str, int)) else str(x) for x in p]


def encode_plan(plan: SavePlan) -> dict[str, Any]:
    storage = plan.storage_data
    if storage is not None and not isinstance(storage, _StoragePrefix):
        raise PlanError(f"cannot send a plan's storage data of type {type(storage).__name__}")
    planner = plan.planner_data
    if planner is not None and not isinstance(planner, dict):
        raise PlanError(f"cannot send planner data of type {type(planner).__name__}")
    return {"items": [_item(w) for w in plan.items],
            "prefix": None if storage is None else storage.prefix,
            "mappings": None if planner is None else
            {str(k): _path(v) for k, v in planner.items()},
            "usable": bool(plan.usable)}


def decode_plan(d: Any) -> SavePlan:
    if not isinstance(d, dict) or not isinstance(d.get("items"), list):
        raise PlanError("a save plan must be a mapping with a list of items")
    prefix = d.get("prefix")
    if prefix is not None and not isinstance(prefix, str):
        raise PlanError("plan prefix is not a string")
    mappings = d.get("mappings")
    if mappings is not None:
        if not isinstance(mappings, dict) or not all(
                isinstance(v, list) and all(isinstance(x, (str, int)) for x in v)
                for v in mappings.values()):
            raise PlanError("planner mappings must map names to paths of str/int")
        mappings = {k: tuple(v) for k, v in mappings.items()}
    return SavePlan(items=[_dec_item(x) for x in d["items"]],
                    storage_data=None if prefix is None else _StoragePrefix(prefix),
                    planner_data=mappings, usable=bool(d.get("usable", True)))


def encode_results(results: Sequence[WriteResult]) -> list[dict[str, Any]]:
    out = []
    for r in results:
        s = r.storage_data
        if not isinstance(s, _StorageInfo):
            raise PlanError(f"cannot send storage info of type {type(s).__name__}")
        out.append({"index": _index(r.index), "size": int(r.size_in_bytes),
                    "path": s.relative_path, "offset": int(s.offset), "length": int(s.length),
                    "transforms": None if s.transform_descriptors is None
                    else [str(t) for t in s.transform_descriptors]})
    return out


def decode_results(xs: Any) -> list[WriteResult]:
    if not isinstance(xs, list):
        raise PlanError("write results must be a list")
    out = []
    for d in xs:
        if not isinstance(d, dict) or not isinstance(d.get("path"), str):
            raise PlanError("write result without a file name")
        nums = [d.get(k) for k in ("size", "offset", "length")]
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in nums):
            raise PlanError("write result: size/offset/length must be ints >= 0")
        tr = d.get("transforms")
        if tr is not None and not (isinstance(tr, list) and all(isinstance(t, str) for t in tr)):
            raise PlanError("write result: transforms must be strings")
        size, offset, length = (int(n) for n in nums)  # type: ignore[arg-type]
        out.append(WriteResult(index=_dec_index(d.get("index")), size_in_bytes=size,
                               storage_data=_StorageInfo(d["path"], offset, length, tr)))
    return out


# -- the save -------------------------------------------------------------------------------
def _fail(exc: BaseException) -> dict[str, str]:
    return {"error": f"{type(exc).__name__}: {exc}"[:500]}


def _failed(xs: list[Any]) -> list[str]:
    return [f"rank {r}: {x['error']}" for r, x in enumerate(xs)
            if isinstance(x, dict) and "error" in x]


def save(state_dict: dict[str, Any], writer: StorageWriter, planner: SavePlanner,
         coord: Coordinator) -> Metadata | None:
    """One DCP save, every rank; the checkpoint metadata on the root (None elsewhere).
    Raises CoordinationError on every rank when any rank failed (all fail together)."""
    root = coord.rank == coord.root
    local: Any
    try:
        planner.set_up_planner(state_dict=state_dict, storage_meta=writer.storage_meta(),
                               is_coordinator=root)
        if "kwargs" in inspect.signature(writer.set_up_storage_writer).parameters:
            writer.set_up_storage_writer(root, rank=coord.rank, use_collectives=True)
        else:
            writer.set_up_storage_writer(root)
        local = encode_plan(writer.prepare_local_plan(planner.create_local_plan()))
    except Exception as exc:  # reported to the root, so every rank fails this save together
        local = _fail(exc)
    plans = coord.gather_json(local)
    metadata: Metadata | None = None
    central: Any = None
    if root:
        assert plans is not None
        bad = _failed(plans)
        if not bad:
            try:
                globals_, metadata = planner.create_global_plan(
                    [decode_plan(p) for p in plans])
                central = [encode_plan(p) for p in writer.prepare_global_plan(globals_)]
            except Exception as exc:
                bad = [f"rank {coord.rank} (planning): {type(exc).__name__}: {exc}"]
        if bad:
            central = [{"error": "; ".join(bad)[:2000]}] * coord.world_size
    mine = coord.scatter_json(central)
    if isinstance(mine, dict) and "error" in mine:
        raise CoordinationError(f"checkpoint planning failed: {mine['error']}")
    result: Any
    try:
        final = planner.finish_plan(decode_plan(mine))
        fut = writer.write_data(final, planner)
        fut.wait()
        result = encode_results(fut.value())
    except Exception as exc:
        result = _fail(exc)
    results = coord.gather_json(result)
    problem = ""
    if root:
        assert results is not None and metadata is not None
        bad = _failed(results)
        if not bad:
            try:
                writer.finish(metadata=metadata, results=[decode_results(r) for r in results])
            except Exception as exc:
                bad = [f"rank {coord.rank} (finish): {type(exc).__name__}: {exc}"]
        problem = "; ".join(bad)
    outcome = coord.broadcast_json(problem if root else None)
    if outcome:
        raise CoordinationError(f"checkpoint write failed: {outcome}")
    return metadata


__all__ = ["PlanError", "decode_plan", "decode_results", "encode_plan", "encode_results",
           "save"]
