"""Processes for the store integration tests (run as real subprocesses / spawned ranks)."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import torch


def model_state(seed: int, numel: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(numel, generator=g)}, "step": seed}


def save_then_hang(root: str, big_numel: int) -> None:
    """Commit step 1, then start saving step 2 and wait to be killed mid-write."""
    from slurmkit.store import CheckpointStore, StoreConfig

    cfg = StoreConfig(nvme_uri=f"{root}/nvme", lustre_uri=f"{root}/lustre", write_threads=1)
    st = CheckpointStore.from_config(cfg, rank=0, world_size=1, node="n0", env={})
    st.save(1, model_state(1, big_numel))
    st.wait()
    print("STEP1_DONE", flush=True)
    st.save(2, model_state(2, big_numel))
    print("SAVING2", flush=True)
    time.sleep(120)  # the test kills us long before this ends


def join_gloo(rank: int, world: int, port: int) -> None:
    """This spawned process becomes ``rank`` of a gloo world rendezvousing on ``port``."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)


def leave_gloo() -> None:
    """Every rank is done with the world before any leaves it: a rank that exits while a peer
    still talks to it (its store thread, its last collective) makes gloo abort that peer."""
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


def restored_equal(res: Any, tmpl: dict[str, Any], state: dict[str, Any], step: int) -> bool:
    """The restore found ``step`` and filled the DTensor-sharded template bit for bit."""
    return (res is not None and res.step == step and tmpl["step"] == step
            and torch.equal(tmpl["model"]["w"].to_local(), state["model"]["w"].to_local())
            and torch.equal(tmpl["model"]["bias"], state["model"]["bias"]))


def rank_main(rank: int, world: int, root: str, port: int, out: str) -> None:
    """One rank of a gloo world: DTensor-sharded + replicated state, save 2 steps, restore."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from slurmkit.store import CheckpointStore, StoreConfig

    join_gloo(rank, world, port)
    mesh = init_device_mesh("cpu", (world,))
    events: list[dict[str, Any]] = []
    cfg = StoreConfig(nvme_uri=f"{root}/nvme", lustre_uri=f"{root}/lustre")
    # one "node" per rank: each node's NVMe holds only its own shards
    st = CheckpointStore.from_config(cfg, rank=rank, world_size=world, node=f"node{rank}",
                                     env={}, on_event=events.append)
    full = torch.arange(64 * 8, dtype=torch.float32).reshape(64, 8)
    state = {"model": {"w": distribute_tensor(full.clone(), mesh, [Shard(0)]),
                       "bias": torch.ones(8)}, "step": 0}
    for step in (1, 2):
        state["model"]["w"].to_local().add_(step)
        state["model"]["bias"].add_(step)
        state["step"] = step
        st.save(step, state)
    st.wait()
    tmpl = {"model": {"w": distribute_tensor(torch.zeros(64, 8), mesh, [Shard(0)]),
                      "bias": torch.zeros(8)}, "step": None}
    res = st.restore(tmpl)
    ok = restored_equal(res, tmpl, state, 2)
    st.close()
    leave_gloo()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"ok": ok, "tier": res.tier if res else None,
                   "events": [e["event"] for e in events],
                   "restored": [e for e in events if e["event"] == "ckpt_restored"]}, f)


def shared_node_main(rank: int, world: int, root: str, port: int, out: str, saves: int,
                     fail_commit: str) -> None:
    """One rank of 4 on 2 emulated nodes (2 ranks share each node's NVMe directory): many
    back-to-back saves of a small, per-step distinct state, then a restore of the last one.

    ``fail_commit`` = "RANK:STEP": that rank's commit of that step on the NVMe tier raises,
    as a full disk or an I/O error would, on that rank only.
    """
    import torch.distributed as dist

    from slurmkit.store import CheckpointStore, StoreConfig
    from slurmkit.store.tier import TierError
    from slurmkit.store.writer import PrimaryWriter

    if fail_commit:
        bad_rank, bad_step = (int(x) for x in fail_commit.split(":"))
        real_commit = PrimaryWriter.commit

        def commit(self: PrimaryWriter, partial: str, manifest: Any,
                   held: set[int] | None = None) -> Any:
            if rank == bad_rank and manifest.step == bad_step and self.tier.name == "nvme":
                raise TierError(f"injected commit failure on rank {rank}")
            return real_commit(self, partial, manifest, held)  # the committed manifest

        PrimaryWriter.commit = commit  # type: ignore[method-assign]

    join_gloo(rank, world, port)
    events: list[dict[str, Any]] = []
    cfg = StoreConfig(nvme_uri=f"{root}/nvme", lustre_uri=f"{root}/lustre",
                      lustre_every_saves=1, keep_nvme=2, keep_lustre=2)
    st = CheckpointStore.from_config(cfg, rank=rank, world_size=world, node=f"vm-{rank // 2}",
                                     env={}, on_event=events.append)
    state = {"model": {"w": torch.zeros(128, 32)}, f"rank{rank}": torch.zeros(4), "step": 0}
    for step in range(1, saves + 1):
        state["model"]["w"].fill_(step)  # replicated: rank 0 writes it
        state[f"rank{rank}"].fill_(step * 10 + rank)  # this rank's own shard
        state["step"] = step
        st.save(step, state)
    st.wait()
    tmpl = {"model": {"w": torch.zeros(128, 32)}, f"rank{rank}": torch.zeros(4), "step": None}
    res = st.restore(tmpl)
    st.close()
    leave_gloo()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"restored_step": res.step if res else None, "step": tmpl["step"],
                   "w": float(tmpl["model"]["w"][0, 0]), "own": float(tmpl[f"rank{rank}"][0]),
                   "events": [{k: e.get(k) for k in ("event", "step", "tier", "error")}
                              for e in events]}, f)


def object_restore_main(rank: int, world: int, root: str, port: int, out: str,
                        object_uri: str, env: dict[str, str]) -> None:
    """Save a DTensor-sharded state to NVMe + the object tier, lose every NVMe, restore:
    from S3, each rank fetching only the files its shard lives in."""
    import shutil

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from slurmkit.store import CheckpointStore, StoreConfig

    join_gloo(rank, world, port)
    mesh = init_device_mesh("cpu", (world,))
    events: list[dict[str, Any]] = []
    cfg = StoreConfig(nvme_uri=f"{root}/nvme", object_uri=object_uri, object_every_saves=1,
                      retry_attempts=2, retry_initial_s=0.2)
    st = CheckpointStore.from_config(cfg, rank=rank, world_size=world, node=f"node{rank}",
                                     env=env, on_event=events.append)
    full = torch.arange(1 << 18, dtype=torch.float32).reshape(-1, 8)
    state = {"model": {"w": distribute_tensor(full.clone(), mesh, [Shard(0)]),
                       "bias": torch.ones(8)}, "step": 3}
    st.save(3, state)
    st.wait()
    dist.barrier()
    shutil.rmtree(f"{root}/nvme/node{rank}")  # the nodes' NVMe is gone
    dist.barrier()
    tmpl = {"model": {"w": distribute_tensor(torch.zeros_like(full), mesh, [Shard(0)]),
                      "bias": torch.zeros(8)}, "step": None}
    res = st.restore(tmpl)
    ok = restored_equal(res, tmpl, state, 3)
    st.close()
    leave_gloo()
    restored = [e for e in events if e["event"] == "ckpt_restored"]
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"ok": ok, "tier": res.tier if res else None, "restored": restored}, f)


if __name__ == "__main__":
    if sys.argv[1] == "save_then_hang":
        save_then_hang(sys.argv[2], int(sys.argv[3]))
