"""The agent's start-up heap leaves the cyclic collector (slurmkit.launch.agent.settle_heap):
what start-up built is no longer walked by a full collection, what comes later still is, and
garbage made later is still collected."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from typing import Any

import pytest

from slurmkit.launch.agent import settle_heap


class Node:
    def __init__(self) -> None:
        self.me: Any = self  # a cycle: only the cyclic collector frees it


@pytest.fixture
def unfrozen() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()  # the rest of the test session as it was


def tracked(obj: object) -> bool:
    return any(o is obj for o in gc.get_objects())


def test_what_start_up_built_is_held_back_and_later_objects_are_not(unfrozen: None) -> None:
    before = Node()
    held = settle_heap()
    after = Node()
    assert held >= 1 and gc.get_freeze_count() == held
    assert not tracked(before)  # a full collection no longer walks it
    assert tracked(after)


def test_garbage_made_after_is_still_collected(unfrozen: None) -> None:
    settle_heap()
    ref = weakref.ref(Node())  # unreachable at once: a cycle only a collection frees
    gc.collect()
    assert ref() is None


def test_the_heap_held_back_grows_with_what_start_up_built(unfrozen: None) -> None:
    first = settle_heap()
    built = [Node() for _ in range(1000)]
    second = settle_heap()
    assert second - first >= len(built)
