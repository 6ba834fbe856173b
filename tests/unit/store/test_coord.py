"""The store's coordinator on a real TCPStore: ranks are threads, each with its own client
(as each process has its own); the message patterns, their cleanup and their refusals."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest

from slurmkit.store.coord import CoordinationError, Coordinator
from tests.unit.store.rank_threads import run_ranks, store_clients


def _world(n: int, timeout_s: float = 30.0) -> tuple[Any, list[Coordinator]]:
    server, clients = store_clients(n, "t/", timeout_s)
    return server, [Coordinator(c, r, n) for r, c in enumerate(clients)]


def _run(coords: list[Coordinator], fn: Callable[[Coordinator], Any]) -> list[Any]:
    return run_ranks(len(coords), lambda r: fn(coords[r]))


def test_broadcast_gather_scatter_and_reductions_give_every_rank_the_right_answer() -> None:
    _, coords = _world(4)

    def steps(c: Coordinator) -> dict[str, Any]:
        return {
            "bcast": c.broadcast_json({"token": "abc"} if c.rank == 0 else None),
            "gather": c.gather_json({"r": c.rank}),
            "scatter": c.scatter_json([f"plan{r}" for r in range(4)] if c.rank == 0 else None),
            "any": c.any_true(c.rank == 2),
            "none": c.any_true(False),
            "max": c.max_int(None if c.rank == 1 else c.rank * 10),
            "agree_ok": c.agree(True),
            "agree_bad": c.agree(c.rank != 3, f"disk full on {c.rank}"),
            "all": c.all_gather_json(c.rank * c.rank),
        }

    res = _run(coords, steps)
    for r, x in enumerate(res):
        assert x["bcast"] == {"token": "abc"}
        assert x["gather"] == ([{"r": i} for i in range(4)] if r == 0 else None)
        assert x["scatter"] == f"plan{r}"
        assert x["any"] is True and x["none"] is False
        assert x["max"] == 30
        assert x["agree_ok"] == (True, [])
        assert x["agree_bad"] == (False, [(3, "disk full on 3")])
        assert x["all"] == [0, 1, 4, 9]


def test_the_root_reclaims_every_finished_operations_keys() -> None:
    """A save runs a handful of operations; over many saves the store must not grow."""
    server, coords = _world(3)

    def many(c: Coordinator) -> None:
        for i in range(40):
            c.broadcast_json(i)
            c.gather_json(i)
            c.scatter_json([i] * 3 if c.rank == 0 else None)
            c.agree(True)

    _run(coords, many)
    assert server.num_keys() < 20  # the last operations' keys only, never 40 saves' worth


def test_an_agreement_carries_a_bounded_number_of_reasons() -> None:
    _, coords = _world(12)
    res = _run(coords, lambda c: c.agree(False, "x" * 10_000))
    ok, bad = res[5]
    assert not ok and len(bad) == 9 and bad[-1] == (-1, "... and 4 more ranks")
    assert all(len(w) <= 300 for _, w in bad)


def test_a_forged_or_duplicate_line_is_refused_not_trusted() -> None:
    _, coords = _world(2)
    root, other = coords
    # a stranger on the rendezvous port appends a line claiming to be rank 1, then rank 1
    # itself arrives: rank 1 is heard twice
    other.store.append("1/a", json.dumps([1, {"evil": True}]) + "\n")
    with pytest.raises(CoordinationError, match="heard twice"):
        _run(coords, lambda c: c.gather_json("mine"))


def test_malformed_json_from_the_store_is_a_coordination_error() -> None:
    _, coords = _world(2)
    coords[0].store.set("1/b", b"\x80not json")
    with pytest.raises(CoordinationError, match="malformed"):
        coords[1].broadcast_json(None)


def test_a_missing_rank_times_out_with_a_clear_error() -> None:
    _, coords = _world(2)  # connect with the ordinary timeout (a busy host is slow to)
    coords[0].store.set_timeout(timedelta(seconds=1.0))  # then wait for rank 1 only 1 s
    with pytest.raises(CoordinationError, match="waiting for"):
        coords[0].gather_json("only me")  # rank 1 never arrives


def test_a_world_of_one_needs_no_store() -> None:
    c = Coordinator(None, 0, 1)
    assert not c.distributed
    assert c.broadcast_json(3) == 3 and c.gather_json(3) == [3] and c.scatter_json([7]) == 7
    assert c.agree(False, "why") == (False, [(0, "why")]) and c.max_int(None) is None


def _plant(store: Any, key: str, value: str) -> None:
    """Set ``key`` and return once the store holds it. A TCPStore ``set`` is not answered, so
    a get on another connection right after it can be served first (a large value arrives in
    pieces): that read the previous value now and then. A get on the same connection is
    served after the set."""
    store.set(key, value)
    store.get(key)


def test_a_manifest_is_fetched_once_checked_against_its_digest_and_never_inflated() -> None:
    from slurmkit.store.manifest_share import SharedManifest, digest, pack

    _, coords = _world(2)
    body = b'{"files": []}' * 50
    keys = _run(coords, lambda c: c.publish(pack(body) if c.rank == 0 else None))
    assert keys[0] == keys[1]
    theirs = SharedManifest(coords[1], 7, keys[1], digest(body))
    assert theirs.body() == body and theirs.matches(body) and not theirs.matches(None)
    # someone rewrites the key: a different body, or a zlib bomb, is refused
    _plant(coords[0].store, keys[0], json.dumps(pack(b"other")))
    with pytest.raises(CoordinationError, match="does not match"):
        SharedManifest(coords[1], 7, keys[1], digest(body)).body()
    import base64
    import zlib

    z, chunk = zlib.compressobj(9), b"\0" * (1 << 20)
    bomb_z = b"".join(z.compress(chunk) for _ in range(300)) + z.flush()  # 300 MiB inflated
    bomb = base64.b64encode(bomb_z).decode()
    _plant(coords[0].store, keys[0], json.dumps(bomb))
    with pytest.raises(CoordinationError, match="does not decode"):
        SharedManifest(coords[1], 7, keys[1], digest(body)).body()
