"""Verification, promotion and retention read ``.metadata`` with restore's safe reader.

A crafted step whose manifest was rewritten to match has the right sizes and checksums, so
a check of the bytes alone calls it verified: it would be promoted to every tier and
retention would delete the older good step for it. Each attack here (real files written by
the real store, then rewritten as an attacker would) must fail ``check_step(deep=True)``,
never reach a slower tier, and never cost the older good step; nothing it carries runs.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest

from slurmkit.store.catalog import check_step, read_manifest
from slurmkit.store.manifest import MANIFEST, step_dir
from slurmkit.store.promote import SourceError, promote_step
from slurmkit.store.retention import gc_tier
from slurmkit.store.tier import make_tier
from tests.unit.store.hostile_steps import byte_item_pickle, storage_outside, truncated_rewritten
from tests.unit.store.test_hostile import saved_store, the_step


def _byte_item(d: str, tmp: Any) -> str:
    byte_item_pickle(d, "model.b", str(tmp / "pwned"))
    return "BytesStorageMetadata"


def _outside(d: str, tmp: Any) -> str:
    storage_outside(d, "model.w", str(tmp / "elsewhere.distcp"))
    return "absolute path"


def _truncated(d: str, tmp: Any) -> str:
    truncated_rewritten(d, "model.w")
    return "truncated"


ATTACKS: dict[str, Callable[[str, Any], str]] = {
    "byte item carrying a pickle": _byte_item,
    "storage_data outside the step": _outside,
    "truncated shard, manifest rewritten": _truncated,
}


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_a_crafted_metadata_never_verifies_is_never_promoted_and_costs_no_good_step(
        tmp_path: Any, attack: str) -> None:
    events: list[dict[str, Any]] = []
    st = saved_store(tmp_path, events)  # steps 1 and 2, both good
    st.close()
    d = the_step(tmp_path, 2)
    nvme = make_tier("nvme", os.path.dirname(d), {})
    assert check_step(nvme, 2, deep=True).ok  # the store's own step verifies
    found = ATTACKS[attack](d, tmp_path)
    assert check_step(nvme, 2, deep=False).ok  # sizes (and checksums) all match again

    status = check_step(nvme, 2, deep=True)
    assert not status.ok
    assert ".metadata refused" in (status.problem or "") and found in (status.problem or "")

    shared = make_tier("lustre", str(tmp_path / "shared"), {})
    with pytest.raises(SourceError, match=r"\.metadata refused"):
        promote_step([nvme], shared, read_manifest(nvme, 2))
    assert not shared.exists(f"{step_dir(2)}/{MANIFEST}")
    promote_step([nvme], shared, read_manifest(nvme, 1))  # the good step still promotes
    assert check_step(shared, 1, deep=True).ok

    assert gc_tier(nvme, keep=1, protected=set()) == []  # step 1 is the newest verified
    assert check_step(nvme, 1, deep=True).ok
    assert not (tmp_path / "pwned").exists()
