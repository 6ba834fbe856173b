"""A real gloo world of 2 processes saving and restoring, then a reshard 2 -> 1."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.multiprocessing as mp

from slurmkit.store import CheckpointStore, StoreConfig
from slurmkit.testing.s3server import free_port
from tests.integration.store_workers import rank_main

pytestmark = pytest.mark.integration


def test_two_ranks_save_restore_then_reshard_to_one(tmp_path: str) -> None:
    root, out = str(tmp_path / "ck"), str(tmp_path)
    mp.start_processes(rank_main, args=(2, root, free_port(), out), nprocs=2, join=True,
                       start_method="spawn")
    for r in (0, 1):
        with open(os.path.join(out, f"rank{r}.json")) as f:
            res = json.load(f)
        assert res["ok"], res
        # each node's NVMe holds half of the step, so restore must come from the shared tier
        assert res["tier"] == "lustre"
    with open(f"{root}/lustre/step_0000000002/manifest.json") as f:
        manifest = json.load(f)
    assert manifest["world_size"] == 2
    assert {e["rank"] for e in manifest["files"]} == {0, 1}

    # reshard: a single process (no process group) loads the 2-rank checkpoint
    st = CheckpointStore.from_config(StoreConfig(nvme_uri=f"{root}/nvme",
                                                 lustre_uri=f"{root}/lustre"),
                                     rank=0, world_size=1, node="other", env={})
    tmpl = {"model": {"w": torch.zeros(64, 8), "bias": torch.zeros(8)}, "step": None}
    res1 = st.restore(tmpl)
    assert res1 is not None and res1.step == 2
    expected = torch.arange(64 * 8, dtype=torch.float32).reshape(64, 8) + 3  # +1 then +2
    assert torch.equal(tmpl["model"]["w"], expected)
    assert torch.equal(tmpl["model"]["bias"], torch.ones(8) + 3)
    st.close()
