"""The JSON values of a restored state, decoded within limits and checked against the
template (a step's JSON bytes are whatever its writer put there).

A value is refused, naming its key, when it is not JSON, nests deeper than MAX_DEPTH, or
is of another kind than the template's value (None in the template takes any value; int
and float are one kind). The byte size is bounded before this: ``.metadata`` may declare at
most ``safe_reader.MAX_JSON_BYTES`` for one value, and no more than its records store.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

import torch

from slurmkit.errors import ActionableError

MAX_DEPTH = 64


class UnsafeValueError(ActionableError):
    """A JSON value of a checkpoint is malformed, too deep, or not what the template holds."""

    def __init__(self, key: str, found: str) -> None:
        super().__init__(
            detected=f"checkpoint value {key[:200]!r} {found}",
            requirement=f"JSON values nested at most {MAX_DEPTH} deep, of the template's kind",
            fix="restore falls back to an older step; if the state's layout changed on "
                "purpose, start from a template whose values have the saved kinds")


def kind(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, (list, tuple)):
        return "list"
    names: dict[type, str] = {str: "str", bytes: "bytes", dict: "dict"}
    return names.get(type(v), type(v).__name__)


def _depth_ok(v: Any) -> bool:
    """Containers nest at most MAX_DEPTH deep (iterative: no recursion on attacker data)."""
    todo = [(v, 0)]
    while todo:
        x, d = todo.pop()
        if isinstance(x, (list, dict)):
            if d >= MAX_DEPTH:
                return False
            todo.extend((y, d + 1) for y in (x.values() if isinstance(x, dict) else x))
    return True


def _unjson(v: Any) -> Any:
    if isinstance(v, dict):
        if set(v) == {"__bytes__"} and isinstance(v["__bytes__"], str):
            return base64.b64decode(v["__bytes__"], validate=True)
        return {k: _unjson(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_unjson(x) for x in v]
    return v


def decode(key: str, t: torch.Tensor, template_value: Any) -> Any:
    """The value stored in ``t`` (a uint8 row of JSON), checked; else UnsafeValueError."""
    try:
        raw = json.loads(bytes(t.numpy().tobytes()))
    except (ValueError, RecursionError, MemoryError) as exc:
        raise UnsafeValueError(key, f"is not JSON ({type(exc).__name__})") from None
    if not _depth_ok(raw):
        raise UnsafeValueError(key, f"nests more than {MAX_DEPTH} levels deep")
    try:
        value = _unjson(raw)
    except (binascii.Error, ValueError) as exc:
        raise UnsafeValueError(key, f"holds malformed bytes ({exc})") from None
    if template_value is not None and kind(value) != kind(template_value):
        raise UnsafeValueError(key, f"is a {kind(value)} where the template holds a "
                               f"{kind(template_value)}")
    return value
