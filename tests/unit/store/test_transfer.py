"""Ranged, hashed downloads: order, bounded parallelism, short reads, no partial file."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from typing import Any

import pytest

from slurmkit.store.transfer import fetch_hashed, ranges


def test_ranges_cover_exactly() -> None:
    assert ranges(0, 4) == []
    assert ranges(10, 4) == [(0, 4), (4, 8), (8, 10)]


def test_out_of_order_completion_is_hashed_in_order(tmp_path: Any) -> None:
    data = os.urandom(100_003)
    state = {"now": 0, "peak": 0, "early_done": 0}
    lock = threading.Lock()

    def wait_for(cond: Any) -> None:
        deadline = time.monotonic() + 5
        while not cond() and time.monotonic() < deadline:
            time.sleep(0.001)

    def read(a: int, b: int) -> bytes:
        with lock:
            state["now"] += 1
            state["peak"] = max(state["peak"], state["now"])
        if a < 3 * 7000:  # the first three ranges are in flight together
            wait_for(lambda: state["peak"] >= 3)
        if a == 0:  # and the first of them finishes last
            wait_for(lambda: state["early_done"] >= 2)
        with lock:
            state["now"] -= 1
            state["early_done"] += 1 if 0 < a < 3 * 7000 else 0
        return data[a:b]

    out = str(tmp_path / "f")
    digest, n = fetch_hashed(read, len(data), out, "sha256", part_bytes=7000, workers=3)
    assert (digest, n) == (hashlib.sha256(data).hexdigest(), len(data))
    assert state["peak"] == 3  # parallel, and never more than ``workers`` ranges in flight
    with open(out, "rb") as f:
        assert f.read() == data


def test_short_object_stops_and_counts(tmp_path: Any) -> None:
    data = b"x" * 50
    digest, n = fetch_hashed(lambda a, b: data[a:b], 80, str(tmp_path / "f"), "crc32",
                             part_bytes=16, workers=2)
    assert n == 50


def test_failed_range_leaves_no_file(tmp_path: Any) -> None:
    def read(a: int, b: int) -> bytes:
        if a >= 32:
            raise ConnectionError("server went away")
        return b"y" * (b - a)

    with pytest.raises(ConnectionError):
        fetch_hashed(read, 100, str(tmp_path / "f"), "crc32", part_bytes=16, workers=2)
    assert os.listdir(tmp_path) == []
