"""Buddy copies with real gloo processes: 2 nodes x 2 ranks, saves that live on NVMe only.

Each node's NVMe must end up holding everything any of its ranks reads (its own files, its
buddy's, and ``.metadata``), and a node lost with its disk, replaced by a spare with an empty
one, must restore the newest save from the buddy copy, bit for bit, not from Lustre.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import pytest

from testkit.s3server import free_port
from tests.integration.helpers import start_workers
from tests.integration.buddy_workers import restore_main, save_main, stop_save_main

pytestmark = pytest.mark.integration
WORLD, STEPS = 4, 2


def _read(path: str) -> dict[str, Any]:
    with open(path) as f:
        return dict(json.load(f))


def _save(tmp: str) -> str:
    root = os.path.join(tmp, "ck")
    start_workers(save_main, (WORLD, root, free_port(), tmp, STEPS), WORLD)
    return root


def _restore(tmp: str, root: str, nodes: list[str]) -> list[dict[str, Any]]:
    start_workers(restore_main, (WORLD, root, free_port(), tmp, nodes), WORLD)
    return [_read(os.path.join(tmp, f"restore{r}.json")) for r in range(WORLD)]


def test_every_node_holds_every_file_its_ranks_read_and_a_spare_restores_from_the_buddy(
        tmp_path: Any) -> None:
    tmp = str(tmp_path)
    root = _save(tmp)
    step = f"step_{STEPS:010d}"
    manifest = _read(os.path.join(root, "nvme", "node0", step, "manifest.json"))
    names = {f["name"] for f in manifest["files"]}
    assert {f["rank"] for f in manifest["files"]} == set(range(WORLD))
    for node in ("node0", "node1"):  # own files + the other node's (buddy) + .metadata
        assert names <= set(os.listdir(os.path.join(root, "nvme", node, step))), node
    assert not os.path.exists(os.path.join(root, "lustre", step))  # NVMe only
    saved = _read(os.path.join(tmp, "save0.json"))["saved"]
    assert [e["step"] for e in saved] == [1, 2] and all(e["copies"] == 2 for e in saved)

    # node1 is lost with its NVMe; a spare (node2, empty NVMe) takes its slot
    shutil.rmtree(os.path.join(root, "nvme", "node1"))
    results = _restore(tmp, root, ["node0", "node2"])
    for r, res in enumerate(results):
        assert res["ok"] and res["step"] == STEPS and res["tier"] == "nvme", (r, res)
    (fetched,) = [e for e in results[0]["events"] if e["event"] == "ckpt_fetched"]
    assert fetched["step"] == STEPS and set(fetched["ranks"]) == {"2", "3"}, fetched
    assert all(v["from"] and all(s < 2 for s in v["from"]) and not v["problem"]
               for v in fetched["ranks"].values()), fetched
    # the spare holds its slot's files and its buddy role again, manifest last
    assert names <= set(os.listdir(os.path.join(root, "nvme", "node2", step)))
    restored = [e for e in results[2]["events"] if e["event"] == "ckpt_restored"]
    assert not restored or restored[0]["bytes_by_tier"].get("lustre", 0) == 0


def test_without_a_buddy_copy_on_any_live_node_the_restore_falls_back(tmp_path: Any) -> None:
    """Both nodes lost: nothing on NVMe can serve step 2, and Lustre has no step at all."""
    tmp = str(tmp_path)
    root = _save(tmp)
    shutil.rmtree(os.path.join(root, "nvme"))
    results = _restore(tmp, root, ["node2", "node3"])
    assert all(r["step"] == -1 and not r["ok"] for r in results), results
    assert not any(e["event"] == "ckpt_fetched" for e in results[0]["events"])


def test_a_stop_save_reaches_the_shared_tier_and_every_rank_is_told(tmp_path: Any) -> None:
    tmp = str(tmp_path)
    root = os.path.join(tmp, "ck")
    start_workers(stop_save_main, (WORLD, root, free_port(), tmp), WORLD)
    assert all(_read(os.path.join(tmp, f"stop{r}.json"))["wait_shared"] for r in range(WORLD))
    assert os.path.exists(os.path.join(root, "lustre", "step_0000000002", "manifest.json"))
    assert not os.path.exists(os.path.join(root, "lustre", "step_0000000001"))
