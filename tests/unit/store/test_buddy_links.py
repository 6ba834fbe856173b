"""The buddy pairs' 2-rank gloo groups on a real TCPStore, ranks as threads (each with its
own store client, as each process has its own).

The case that hung with ``dist.new_group(use_local_synchronization=True)``: on 3 or more
nodes the ranks make their pairs after different numbers of earlier pairs, and c10d's name
for a pair depends on that number, so the two members never met. Links names a pair by its
ranks and the store instance's prefix only.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from slurmkit.store.buddy import Links, Ring, _swap_headers
from tests.unit.store.rank_threads import run_ranks, store_clients

TIMEOUT_S = 60.0  # the gloo and store timeout: a lost peer fails the test instead of hanging


def _clients(n: int, prefix: str) -> tuple[Any, list[Any]]:
    return store_clients(n, prefix, TIMEOUT_S)


_run = run_ranks


@pytest.mark.parametrize("world,local,replicas", [(4, 1, 1), (5, 1, 2), (8, 2, 1)])
def test_every_rank_hears_from_each_ring_source_over_its_pairs(world: int, local: int,
                                                              replicas: int) -> None:
    server, clients = _clients(world, "inst0/pairs/")

    def rank(r: int) -> list[Any]:
        ring = Ring(r, world, local, replicas)
        links = Links(r, clients[r], TIMEOUT_S)
        links.ensure(ring.ring_pairs())
        got = []
        for dst, src in zip(ring.targets(), ring.sources()):
            got.append((src, _swap_headers(links, dst, src, [{"from": r, "to": dst}])))
        return got

    out = _run(world, rank)
    for r, got in enumerate(out):
        ring = Ring(r, world, local, replicas)
        assert [src for src, _ in got] == ring.sources()
        for src, theirs in got:
            assert theirs == [{"from": src, "to": r}]
    del server


def test_a_second_store_instance_makes_its_pairs_again_under_its_own_prefix() -> None:
    """A restarted CheckpointStore in the same job (a new instance prefix) pairs again."""
    world = 3
    server, first = _clients(world, "inst0/pairs/")
    second = [dist.PrefixStore("inst1/pairs/", dist.TCPStore(
        "127.0.0.1", server.port, None, False, timeout=timedelta(seconds=TIMEOUT_S),
        wait_for_workers=False)) for _ in range(world)]

    def rank(r: int) -> list[Any]:
        seen = []
        for clients in (first, second):
            ring = Ring(r, world, 1, 1)
            links = Links(r, clients[r], TIMEOUT_S)
            links.ensure(ring.ring_pairs())
            dst, src = ring.targets()[0], ring.sources()[0]
            seen.append(_swap_headers(links, dst, src, [{"from": r}]))
        return seen

    out = _run(world, rank)
    for r, seen in enumerate(out):
        assert seen == [[{"from": (r - 1) % world}]] * 2


def test_without_a_rendezvous_store_links_refuse_instead_of_waiting() -> None:
    with pytest.raises(RuntimeError, match="rendezvous store"):
        Links(0).group(1)
