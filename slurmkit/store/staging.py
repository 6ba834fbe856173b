"""State dicts <-> flat DCP state, and the reusable snapshot buffers.

Supported state: nested dicts (keys str or int) whose leaves are
  * tensors (any dtype, CPU or CUDA; DTensor shards too): saved by DCP, loaded in place;
  * JSON values (None, bool, int, float, str, lists/tuples/dicts of these; ``bytes``):
    encoded by us as a JSON uint8 tensor, so DCP never pickles (or unpickles) an object.
    Tuples come back as lists. Tensors inside lists are not supported (use dicts).
A plain tensor is treated as replicated across ranks (DCP keeps one copy); per-rank data
must be keyed by rank or stored as a DTensor.
"""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Iterator
from typing import Any

import torch

from slurmkit.errors import ConfigError, SlurmkitError
from slurmkit.store.json_values import MAX_DEPTH

JSON_PREFIX = "__json__."


def _is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor"


def _jsonable(v: Any) -> Any:
    if isinstance(v, bytes):
        return {"__bytes__": base64.b64encode(v).decode()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    raise ConfigError(
        detected=f"a checkpoint state value of type {type(v).__name__}",
        requirement="tensors, dicts, or JSON values (None/bool/int/float/str/list/bytes)",
        fix="convert it to a tensor or a JSON value before store.save()",
    )


def _unjson(v: Any) -> Any:
    if isinstance(v, dict):
        if set(v) == {"__bytes__"}:
            return base64.b64decode(v["__bytes__"])
        return {k: _unjson(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_unjson(x) for x in v]
    return v


def walk(state: dict[Any, Any], prefix: str = "") -> Iterator[tuple[str, dict[Any, Any], Any]]:
    """Yield (flat key, parent dict, key in parent) for every leaf of a nested dict."""
    for k, v in state.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v and not _all_json(v):
            yield from walk(v, key + ".")
        else:
            yield key, state, k


def _all_json(d: dict[Any, Any]) -> bool:
    return not any(isinstance(v, torch.Tensor) or isinstance(v, dict) and not _all_json(v)
                   for v in d.values())


def _too_deep(v: Any) -> bool:
    """Whether ``v`` stored as JSON nests deeper than restore accepts (json_values.py: a
    container at depth MAX_DEPTH is refused; bytes become a one-key dict). Iterative, and
    it stops at the first container too deep, so a self-containing list ends too."""
    todo = [(v, 0)]
    while todo:
        x, d = todo.pop()
        if isinstance(x, (list, tuple, dict, bytes)):
            if d >= MAX_DEPTH:
                return True
            if isinstance(x, dict):
                todo.extend((y, d + 1) for y in x.values())
            elif not isinstance(x, bytes):
                todo.extend((y, d + 1) for y in x)
    return False


def _unrestorable(key: str, found: str, limit: str) -> ConfigError:
    return ConfigError(
        detected=f"checkpoint state value {key[:200]!r} {found}",
        requirement=f"{limit}: restore refuses larger or deeper values, so this save could "
                    "never be loaded",
        fix="store it as a tensor, or split or flatten it before store.save()")


def encode_json(v: Any, key: str = "") -> torch.Tensor:
    """The JSON bytes of ``v`` as a uint8 tensor; a value restore would refuse (deeper than
    MAX_DEPTH, over MAX_JSON_BYTES) is a ConfigError here, before anything is written."""
    from slurmkit.store.safe_reader import MAX_JSON_BYTES  # safe_reader imports this module

    if _too_deep(v):
        raise _unrestorable(key, f"nests more than {MAX_DEPTH} levels deep",
                            f"JSON values nested at most {MAX_DEPTH} deep")
    data = json.dumps(_jsonable(v), separators=(",", ":")).encode()
    if len(data) > MAX_JSON_BYTES:
        raise _unrestorable(key, f"is {len(data)} bytes as JSON",
                            f"JSON values of at most {MAX_JSON_BYTES} bytes")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def decode_json(t: torch.Tensor) -> Any:
    return _unjson(json.loads(bytes(t.numpy().tobytes())))


class StagingBuffers:
    """CPU copies of a state's tensors, reused across saves while shapes stay the same.

    Reuse matters: allocating (and page-faulting) a fresh 1 GiB each save costs about as much
    as the copy itself. Buffers are pinned when the source lives on an accelerator.
    """

    def __init__(self) -> None:
        self._bufs: dict[str, torch.Tensor] = {}
        self.allocated_bytes = 0

    def _buffer_for(self, key: str, src: torch.Tensor) -> torch.Tensor:
        buf = self._bufs.get(key)
        if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
            pin = src.device.type != "cpu" and torch.cuda.is_available()
            buf = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=pin)
            self._bufs[key] = buf
            self.allocated_bytes += buf.numel() * buf.element_size()
        return buf

    def snapshot(self, state: dict[Any, Any]) -> dict[str, Any]:
        """Copy ``state`` into the buffers; return the flat DCP state dict that points at them."""
        flat, copies = self.prepare(state)
        fill(copies, FillGate([c[0] for c in copies]))
        return flat

    def prepare(self, state: dict[Any, Any]) -> tuple[dict[str, Any], list[Copy]]:
        """The flat DCP state over the (not yet filled) buffers, and the copies that fill them.

        Everything that can reject a state (unsupported values, clashing keys) happens here,
        before any background writer is started on the result.
        """
        flat: dict[str, Any] = {}
        copies: list[Copy] = []
        for key, parent, k in walk(state):
            v = parent[k]
            if isinstance(v, torch.Tensor):
                local = v.to_local() if _is_dtensor(v) else v  # type: ignore[attr-defined]
                buf = self._buffer_for(key, local)
                copies.append((key, buf, local.detach()))
                flat[key] = _rewrap(v, buf) if _is_dtensor(v) else buf
            else:
                flat[JSON_PREFIX + key] = encode_json(v, key)
        if len(flat) != sum(1 for _ in walk(state)):
            raise ConfigError(detected="two state keys flatten to the same name",
                              requirement="unique dotted key paths",
                              fix="rename keys that contain dots")
        return flat, copies


Copy = tuple[str, torch.Tensor, torch.Tensor]  # (flat key, staging buffer, source)


class FillGate:
    """Which staging buffers hold their snapshot yet; the writer waits per key.

    Lets the background writer serialize tensor i while the training thread still copies
    tensor i+1 (the durable time then overlaps the snapshot instead of following it).
    """

    def __init__(self, keys: list[str]) -> None:
        self._cv = threading.Condition()
        self._pending = set(keys)
        self._aborted = False

    def set(self, key: str) -> None:
        with self._cv:
            self._pending.discard(key)
            self._cv.notify_all()

    def abort(self) -> None:
        """The snapshot failed: every waiter raises instead of reading a half-filled buffer."""
        with self._cv:
            self._aborted = True
            self._cv.notify_all()

    def wait(self, key: str) -> None:
        with self._cv:
            self._cv.wait_for(lambda: self._aborted or key not in self._pending)
            if self._aborted:
                raise SlurmkitError(f"snapshot of {key!r} was aborted; nothing is written")


def fill(copies: list[Copy], gate: FillGate) -> None:
    """Copy every source into its buffer, opening the gate key by key (CPU sources at once,
    accelerator sources after the one synchronize that makes their copies complete)."""
    on_device = []
    for key, buf, src in copies:
        if src.device.type == "cpu":
            buf.copy_(src)
            gate.set(key)
        else:
            buf.copy_(src, non_blocking=True)
            on_device.append(key)
    if on_device:
        torch.cuda.synchronize()
        for key in on_device:
            gate.set(key)


def _rewrap(dt: Any, local: torch.Tensor) -> Any:
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, dt.device_mesh, dt.placements, run_check=False,
                              shape=dt.shape, stride=dt.stride())


def load_targets(template: dict[Any, Any], json_sizes: dict[str, int]) -> dict[str, Any]:
    """The flat DCP state to load into: template tensors themselves, JSON placeholders."""
    flat: dict[str, Any] = {}
    for key, parent, k in walk(template):
        v = parent[k]
        if isinstance(v, torch.Tensor):
            flat[key] = v
        elif JSON_PREFIX + key in json_sizes:
            flat[JSON_PREFIX + key] = torch.empty(json_sizes[JSON_PREFIX + key], dtype=torch.uint8)
    return flat


def apply_json(template: dict[Any, Any], flat: dict[str, Any]) -> None:
    """Write the loaded JSON values back into the template's dicts (tensors are in place)."""
    for key, parent, k in walk(template):
        t = flat.get(JSON_PREFIX + key)
        if t is not None and not isinstance(parent[k], torch.Tensor):
            parent[k] = decode_json(t)
