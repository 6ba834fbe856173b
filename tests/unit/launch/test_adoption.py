"""The agents' side of store.adopt over a real TCPStore and the real channel: rank 0's agent names
each save the program finished, every agent copies its ranks' files, rank 0's commits each tier
and applies its retention; a spare in a slot puts that slot's damaged file back (real files,
local tiers; the whole path with torchtitan runs on the cluster)."""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from slurmkit.launch.adoption import Adopter, step_namer
from slurmkit.store.catalog import list_steps, read_latest, read_manifest
from slurmkit.store.config import StoreConfig
from slurmkit.store.tier import make_tier
from slurmkit.supervise.channel import Channel

L = 2
NODES = ["n0", "n1", "n2"]


def _save(folder: str, step: int) -> str:
    d = os.path.join(folder, f"step-{step}")
    os.makedirs(d)
    for r in range(2 * L):
        with open(os.path.join(d, f"__{r}_0.distcp"), "wb") as f:
            f.write(os.urandom(2048 + r))
    with open(os.path.join(d, ".metadata"), "wb") as f:
        f.write(b"index %d" % step)
    return d


def _until(what: str, check: Any, timeout_s: float = 60) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"no {what} within {timeout_s} s")


def test_two_agents_adopt_each_save_then_a_spare_puts_its_slots_file_back(tmp_path) -> None:
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=10), use_libuv=True)
    channel = Channel(server, "job-0", b"t" * 32, NODES)

    def connect() -> Channel:
        return channel.on(dist.TCPStore("127.0.0.1", server.port, 1, False, timeout=timedelta(seconds=10),
                                        use_libuv=True))

    cfg = StoreConfig(lustre_uri=str(tmp_path / "shared"), object_uri=str(tmp_path / "object"),
                      object_every_saves=2, keep_lustre=1, keep_object=2, commit_timeout_s=30)
    folder = str(tmp_path / "titan" / "checkpoint")
    events: list[tuple[str, dict[str, Any]]] = []

    def agent(node_rank: int) -> Adopter:
        return Adopter(cfg, {}, node=NODES[node_rank], node_rank=node_rank, nodes=3, ranks_per_node=L, train_nodes=2,
                       adapter="torchtitan", folder=folder, step_name=step_namer("torchtitan", None) or str,
                       glob=None, connect=connect,
                       append=lambda name, **fields: events.append((name, fields)))
    a0, a1 = agent(0), agent(1)
    a0.slot, a1.slot = 0, 1
    a0.start(), a1.start()
    try:
        def adopted(step: int, tier: str) -> bool:
            return any(n == "ckpt_adopted" and f["step"] == step and f["tier"] == tier for n, f in events)
        a0.saved(2, _save(folder, 2))
        _until("step 2 adopted on the shared tier", lambda: adopted(2, "lustre"))
        a0.saved(4, _save(folder, 4))
        _until("step 4 adopted on both tiers", lambda: adopted(4, "lustre") and adopted(4, "object"))
        # The program completes after a last save no folder scan saw: each agent, its ranks
        # done, waits for its part; rank 0's names the save and commits it before leaving.
        _save(folder, 6)
        done: dict[int, bool] = {}
        other = threading.Thread(target=lambda: done.__setitem__(1, a1.finish(30)))
        other.start()
        done[0] = a0.finish(30)
        other.join()
        assert done == {0: True, 1: True} and adopted(6, "lustre"), events
    finally:
        a0.stop(), a1.stop()
    shared, obj = make_tier("lustre", cfg.lustre_uri, {}), make_tier("object", cfg.object_uri, {})
    assert not adopted(2, "object")  # object_every_saves=2: the second save only
    assert list_steps(shared) == [6] and read_latest(shared) == 6  # keep_lustre=1: steps 2 and 4 gone
    assert list_steps(obj) == [4]  # (step 6 was the third save)
    m = read_manifest(obj, 4)
    assert sorted(e.name for e in m.files) == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp",
                                                "__3_0.distcp"] and m.world_size == 4, m
    assert not [n for n, _ in events if n == "ckpt_failed"], events

    # The node of slot 1 is lost and rank 3's file damaged (cut short); the spare takes slot 1.
    with open(os.path.join(folder, "step-6", "__3_0.distcp"), "r+b") as f:
        f.truncate(100)
    spare = agent(2)
    got = spare.put_back(1, 1)
    assert got is not None and got.fetched == ["__3_0.distcp"] and got.damaged == ["__3_0.distcp"], got
    (back,) = [f for n, f in events if n == "ckpt_put_back"]
    assert back["step"] == 6 and back["node"] == "n2" and back["slot"] == 1 and back["tier"] == "lustre", back
    assert os.path.getsize(os.path.join(folder, "step-6", "__3_0.distcp")) == 2048 + 3
    assert a0.put_back(1, 0) is not None and len([n for n, _ in events if n == "ckpt_put_back"]) == 1
