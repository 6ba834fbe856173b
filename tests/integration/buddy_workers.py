"""Ranks for the buddy-copy tests: real gloo processes, 2 "nodes" x 2 ranks, one NVMe
directory per node name, Lustre promoted rarely (so the saves live on NVMe only)."""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from tests.integration.store_workers import join_gloo, leave_gloo

LOCAL = 2  # ranks per node


def _state(rank: int, world: int, step: int) -> dict[str, Any]:
    """A sharded part (each rank's own rows) and a replicated part, as FSDP/DDP state is."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(world * 4 * 1024, dtype=torch.float32).reshape(world * 4, 1024) + step
    return {"model": {"w": distribute_tensor(full, mesh, [Shard(0)]),
                      "bias": torch.full((256,), float(step))},
            "step": step}


def _store(root: str, rank: int, world: int, node: str, events: list[dict[str, Any]]) -> Any:
    from slurmkit.store import CheckpointStore, StoreConfig

    cfg = StoreConfig(nvme_uri=f"{root}/nvme", lustre_uri=f"{root}/lustre",
                      lustre_every_saves=100, write_threads=1)
    return CheckpointStore.from_config(cfg, rank=rank, world_size=world, node=node,
                                       env={"LOCAL_WORLD_SIZE": str(LOCAL)},
                                       on_event=events.append)


def save_main(rank: int, world: int, root: str, port: int, out: str, steps: int) -> None:
    """Save ``steps`` steps (none promoted to Lustre), on nodes node0 and node1."""
    join_gloo(rank, world, port)
    events: list[dict[str, Any]] = []
    st = _store(root, rank, world, f"node{rank // LOCAL}", events)
    for step in range(1, steps + 1):
        st.save(step, _state(rank, world, step))
    st.wait()
    st.close()
    leave_gloo()
    with open(os.path.join(out, f"save{rank}.json"), "w") as f:
        json.dump({"saved": [e for e in events if e["event"] == "ckpt_saved"]}, f)


def restore_main(rank: int, world: int, root: str, port: int, out: str, nodes: list[str]
                 ) -> None:
    """A new generation: rank r runs on ``nodes[r // LOCAL]``; restore and compare."""
    join_gloo(rank, world, port)
    events: list[dict[str, Any]] = []
    st = _store(root, rank, world, nodes[rank // LOCAL], events)
    tmpl = _state(rank, world, 0)
    res = st.restore(tmpl)
    step = res.step if res is not None else -1
    want = _state(rank, world, step)
    ok = (res is not None and tmpl["step"] == step
          and torch.equal(tmpl["model"]["w"].to_local(), want["model"]["w"].to_local())
          and torch.equal(tmpl["model"]["bias"], want["model"]["bias"]))
    st.close()
    leave_gloo()
    with open(os.path.join(out, f"restore{rank}.json"), "w") as f:
        json.dump({"ok": ok, "step": step, "tier": res.tier if res else None,
                   "events": events}, f)


def stop_save_main(rank: int, world: int, root: str, port: int, out: str) -> None:
    """A periodic save (NVMe only), then a stop save: it must reach Lustre, and every rank
    must hear so from wait_shared."""
    join_gloo(rank, world, port)
    events: list[dict[str, Any]] = []
    st = _store(root, rank, world, f"node{rank // LOCAL}", events)
    st.save(1, _state(rank, world, 1))
    st.save(2, _state(rank, world, 2), shared=True).wait()
    ok = st.wait_shared(2)
    st.close()
    leave_gloo()
    with open(os.path.join(out, f"stop{rank}.json"), "w") as f:
        json.dump({"wait_shared": ok}, f)
