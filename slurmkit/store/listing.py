"""Listings that stay O(1) per rank: a shared tier is listed once (rank 0, broadcast), a
step directory on it is never listed by every rank.

A shared tier (Lustre, the object store) is one directory for the whole job: N ranks each
listing it is N metadata requests to one server, and a step directory there holds every
rank's files, so each rank listing it reads O(N) entries (O(N^2) for the job). A node-local
tier (NVMe, scratch) is listed by its own ranks: a local directory, a few entries per rank.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from slurmkit.store.catalog import file_size, list_steps, step_sizes
from slurmkit.store.coord import Coordinator
from slurmkit.store.manifest import step_dir
from slurmkit.store.tier import Tier, TierError

log = logging.getLogger(__name__)
SHARED_TIERS = ("lustre", "object")
MAX_STEPS = 64  # steps one rank proposes for a restore (retention keeps far fewer)


def is_shared(tier: Tier) -> bool:
    """One directory for every node of the job (else each node has its own)."""
    return tier.name in SHARED_TIERS


def _steps(tier: Tier) -> list[int]:
    try:
        return list_steps(tier)[:MAX_STEPS]
    except TierError as exc:
        log.warning("cannot list %s: %s", tier.uri, exc)
        return []


def broadcast_listing(tier: Tier, coord: Coordinator) -> list[int]:
    """The steps on a shared ``tier``, newest first, listed by rank 0 only."""
    steps = _steps(tier) if coord.rank == coord.root else None
    got = coord.broadcast_json(steps)
    return [int(s) for s in got if isinstance(s, int) and not isinstance(s, bool)] \
        if isinstance(got, list) else []


def agreed_steps(tiers: Sequence[Tier], coord: Coordinator) -> list[int]:
    """Every step any rank can see, newest first, the same list on every rank.

    Shared tiers: one listing (rank 0), broadcast. Node-local tiers: each rank lists its
    own; rank 0 unions the ranks' lists and broadcasts the union (a few steps)."""
    shared: set[int] = set()
    for t in tiers:
        if is_shared(t):
            shared.update(broadcast_listing(t, coord))
    local: set[int] = set()
    for t in tiers:
        if not is_shared(t):
            local.update(_steps(t))

    def union(xs: list[Any]) -> list[int]:
        out: set[int] = set()
        for x in xs:
            if isinstance(x, list):
                out.update(s for s in x if isinstance(s, int) and not isinstance(s, bool))
        return sorted(out, reverse=True)[:MAX_STEPS]

    merged = coord.reduce_json(sorted(local, reverse=True)[:MAX_STEPS], union)
    return sorted(shared | {int(s) for s in merged}, reverse=True)


class StepSizes(Mapping[str, int]):
    """File sizes in one step directory, as a mapping, without listing a shared tier.

    Node-local: one listing of the directory. Shared: each name asked for is looked up on
    its own (one stat or HEAD), so a rank pays for the files it reads, not for N ranks'."""

    def __init__(self, tier: Tier, step: int) -> None:
        self.tier, self.step = tier, step
        self._known: dict[str, int | None] = {}
        self._listed = not is_shared(tier)
        if self._listed:
            try:
                self._known = dict(step_sizes(tier, step))  # (links left out)
            except TierError as exc:
                log.warning("cannot list step %d on %s: %s", step, tier.uri, exc)

    def _size(self, name: str) -> int | None:
        if self._listed:
            return self._known.get(name)
        if name not in self._known:
            rel = f"{step_dir(self.step)}/{name}"
            try:
                self._known[name] = file_size(self.tier, rel)
            except (TierError, OSError):
                self._known[name] = None  # missing (or unreadable: the step falls back)
        return self._known[name]

    def __getitem__(self, name: str) -> int:
        size = self._size(name)
        if size is None:
            raise KeyError(name)
        return size

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self._size(name) is not None

    def __iter__(self) -> Iterator[str]:
        return iter([n for n, s in self._known.items() if s is not None])

    def __len__(self) -> int:
        return sum(1 for s in self._known.values() if s is not None)
