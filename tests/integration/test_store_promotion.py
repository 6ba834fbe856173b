"""Promotion driven by the manifests, with deep verification: real files, real corruption,
real gloo ranks on emulated nodes, the real S3 server (SeaweedFS)."""

from __future__ import annotations

import json
import os
import shutil
import uuid
from typing import Any

import pytest
import torch

from slurmkit.store import CheckpointStore, StoreConfig
from slurmkit.store.catalog import check_step, list_steps, read_latest
from slurmkit.store.manifest import step_dir
from slurmkit.store.tier import make_tier
from testkit.s3server import S3Server, free_port
from tests.integration.helpers import start_workers
from tests.integration.promotion_workers import incarnation_main
from tests.integration.store_workers import model_state

pytestmark = pytest.mark.integration


def _flip_bytes(path: str) -> None:
    """Silent corruption: same size, a few bytes in the middle changed."""
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        chunk = f.read(16)
        f.seek(-len(chunk), os.SEEK_CUR)
        f.write(bytes(b ^ 0xFF for b in chunk))
        f.flush()
        os.fsync(f.fileno())


def test_corrupted_shard_on_nvme_is_never_promoted_and_the_good_step_stays(tmp_path: Any
                                                                           ) -> None:
    """Step 4 reaches Lustre. Step 8 is due there too, but Lustre is away when it commits;
    while the job is down, one of its shards on NVMe rots (same size, other bytes). The next
    process finds step 8 still due, sees that no tier holds a verified copy of that shard,
    and never promotes it: Lustre (keep_lustre=1) keeps the good step 4, NVMe withdraws the
    bad step 8, and a restore without NVMe gets step 4 back bit for bit."""
    root = str(tmp_path)
    lustre = f"{root}/lustre"
    cfg = StoreConfig(nvme_uri=f"{root}/nvme", lustre_uri=lustre, lustre_every_saves=4,
                      keep_nvme=2, keep_lustre=1, retry_attempts=1, retry_initial_s=0.01)
    events: list[dict[str, Any]] = []
    st = CheckpointStore.from_config(cfg, rank=0, world_size=1, node="n0", env={},
                                     on_event=events.append)
    for step in range(1, 5):
        assert st.save(step, model_state(step, 1 << 14)).wait()
    st.wait()
    assert read_latest(make_tier("lustre", lustre, {})) == 4
    os.rename(lustre, f"{lustre}.away")  # the shared file system goes away ...
    with open(lustre, "w") as f:  # ... its mount point is not a directory any more
        f.write("not mounted")
    for step in range(5, 9):
        assert st.save(step, model_state(step, 1 << 14)).wait()
    st.wait()
    assert st.pending_promotions() == [(8, "lustre")]
    st.close()
    os.remove(lustre)
    os.rename(f"{lustre}.away", lustre)
    shard = f"{root}/nvme/n0/{step_dir(8)}/__0_0.distcp"
    _flip_bytes(shard)

    events2: list[dict[str, Any]] = []
    st2 = CheckpointStore.from_config(cfg, rank=0, world_size=1, node="n0", env={},
                                      on_event=events2.append)
    st2.wait()
    lus = make_tier("lustre", lustre, {})
    rejected = [e for e in events2 if e["event"] == "ckpt_rejected"]
    assert rejected and rejected[0]["step"] == 8 and "__0_0.distcp" in rejected[0]["reason"]
    assert not [e for e in events2 if e["event"] == "ckpt_durable"]
    assert read_latest(lus) == 4 and list_steps(lus) == [4]
    assert check_step(lus, 4, deep=True).ok
    assert st2.pending_promotions() == []  # rejected for good, not retried forever
    nvme = make_tier("nvme", f"{root}/nvme/n0", {})
    assert not check_step(nvme, 8, deep=False).ok  # withdrawn: no longer a recovery point
    assert st2.latest_verified() == 7
    shutil.rmtree(f"{root}/nvme/n0")  # the node is lost: only the good shared copy is left
    w = torch.zeros(1 << 14)
    res = st2.restore({"model": {"w": w}, "step": None})
    assert res is not None and (res.step, res.tier) == (4, "lustre")
    assert torch.equal(w, model_state(4, 1 << 14)["model"]["w"])
    st2.close()


def _incarnation(tmp_path: Any, name: str, nodes: list[str], first: int, saves: int,
                 uri: str, env: dict[str, str], killed_pending: bool) -> list[dict[str, Any]]:
    out = tmp_path / name
    out.mkdir()
    start_workers(incarnation_main, (4, str(tmp_path / "ck"), free_port(), str(out), nodes, first,
                                     saves, uri, env, killed_pending), 4)
    results = []
    for r in range(4):
        with open(out / f"rank{r}.json") as f:
            results.append(json.load(f))
    return results


def _durable(tier: Any) -> int | None:
    step = read_latest(tier)
    assert step is not None and check_step(tier, step, deep=True).ok, (tier.uri, step)
    return step


@pytest.mark.timeout(900)
def test_shared_and_object_tiers_keep_advancing_after_a_spare_and_a_requeue(
        tmp_path: Any, s3_server: S3Server) -> None:
    """4 gloo ranks, 2 per emulated node; Lustre every 4th save, S3 every 2nd.

    1. On vm-0 + vm-1, 4 saves; the job dies with step 4 committed but not promoted.
    2. vm-1 is lost (its NVMe with it) and a spare vm-2 takes its ranks: step 4 is still
       due on vm-0 but vm-2 never had its files. 10 more saves: both tiers advance to the
       newest due step (step 4 is dropped as superseded, with a ledger event); the job dies
       again with step 14 due on S3.
    3. A requeue onto other nodes: ranks 0-1 on a new vm-3, ranks 2-3 on vm-0 (which holds
       the other ranks' files of step 14). 10 more saves: both tiers advance again."""
    ck = tmp_path / "ck"
    env = s3_server.env()
    uri = f"s3://{s3_server.bucket}/promotion-{uuid.uuid4().hex[:8]}"
    lus = make_tier("lustre", str(ck / "lustre"), {})
    obj = make_tier("object", uri, env)

    _incarnation(tmp_path, "a", ["vm-0", "vm-0", "vm-1", "vm-1"], 1, 4, uri, env, True)
    assert read_latest(lus) is None and _durable(obj) == 2
    assert check_step(make_tier("nvme", str(ck / "nvme" / "vm-0"), {}), 4, deep=False,
                      files=lambda m: [f for f in m.files if f.rank < 2]).ok  # its ranks'

    shutil.rmtree(ck / "nvme" / "vm-1")  # the node and its NVMe are gone
    res = _incarnation(tmp_path, "b", ["vm-0", "vm-0", "vm-2", "vm-2"], 5, 10, uri, env,
                       True)
    assert _durable(lus) == 12 and _durable(obj) == 12
    rank0 = res[0]["events"]
    # the stale step 4 was given up with its reason in the ledger, never retried forever
    dropped = {(e["step"], e["tier"]) for e in rank0 if e["event"] == "ckpt_dropped"}
    assert (4, "lustre") in dropped, rank0
    assert not [e for r in res for e in r["events"]
                if e["event"] == "ckpt_durable" and e["step"] == 4]
    assert res[0]["pending"] == [[14, "object"]]

    res = _incarnation(tmp_path, "c", ["vm-3", "vm-3", "vm-0", "vm-0"], 15, 10, uri, env,
                       False)
    assert _durable(lus) == 22 and _durable(obj) == 24
    assert len(list_steps(lus)) <= 2 and len(list_steps(obj)) <= 2  # retention held
    for r, rr in enumerate(res):
        assert rr["pending"] == [], (r, rr)
        assert r == 0 or not [e for e in rr["events"] if e["event"] == "ckpt_durable"]
    durable = {(e["step"], e["tier"]) for e in res[0]["events"] if e["event"] == "ckpt_durable"}
    assert {(22, "lustre"), (24, "object")} <= durable  # this incarnation promoted them
    # no node's NVMe grows: what is not due anywhere is retained per keep_nvme
    for node in ("vm-0", "vm-2", "vm-3"):
        steps = list_steps(make_tier("nvme", str(ck / "nvme" / node), {}))
        assert len(steps) <= 3, (node, steps)
