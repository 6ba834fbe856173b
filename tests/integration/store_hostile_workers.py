"""Ranks of a real gloo world restoring from checkpoints an attacker rewrote (spawned)."""

from __future__ import annotations

import glob
import json
import os
from typing import Any

import torch

from tests.integration.store_workers import join_gloo, leave_gloo
from tests.unit.store.hostile_steps import (
    OpenAudit,
    byte_item_pickle,
    garbage_record,
    manifest_dotdot,
    storage_outside,
    truncated_rewritten,
)

SAVES = 6


def state_at(step: int, world: int, mesh: Any) -> dict[str, Any]:
    from torch.distributed.tensor import Shard, distribute_tensor

    g = torch.Generator().manual_seed(step)
    full = torch.randn(64 * world, 8, generator=g)
    return {"model": {"w": distribute_tensor(full, mesh, [Shard(0)]),
                      "bias": torch.randn(8, generator=g)},
            "step": torch.tensor(step), "note": f"step {step}"}


def step_path(root: str, step: int) -> str:
    (p,) = glob.glob(f"{root}/lustre/**/step_{step:010d}", recursive=True)
    return p


def outside_files(root: str) -> dict[str, str]:
    """The files outside every step that the crafted steps point at (copies of real shards,
    so reading one would succeed): a restore must never open them."""
    return {"abs": os.path.join(root, "outside.distcp"),
            "dotdot": os.path.join(os.path.dirname(step_path(root, 3)), "stolen.distcp")}


def craft(root: str, marker: str) -> None:
    """Rank 0, as the attacker: five of the six committed steps rewritten, each with its
    manifest resealed to match. Step 6 is well-formed but rank 1's chunk of ``model.w``
    does not load (its bytes rewritten): rank 0 loads its part, and both must skip it."""
    outside = outside_files(root)
    garbage_record(step_path(root, 6), "model.w", nth=1)
    byte_item_pickle(step_path(root, 5), "model.bias", marker)
    storage_outside(step_path(root, 4), "model.w", outside["abs"])
    manifest_dotdot(step_path(root, 3), "model.w", outside["dotdot"])
    truncated_rewritten(step_path(root, 2), "model.w")


def hostile_main(rank: int, world: int, root: str, port: int, out: str) -> None:
    """Save SAVES steps through the real store on a shared tier, let rank 0 craft five of
    them, then restore on every rank while recording every file this process opens."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from slurmkit.store import CheckpointStore, StoreConfig
    from slurmkit.ledger.ledger import Ledger

    join_gloo(rank, world, port)
    mesh = init_device_mesh("cpu", (world,))
    ledger = Ledger(os.path.join(out, "run", "ledger.jsonl"), source="rank0") \
        if rank == 0 else None

    def forward(event: dict[str, Any]) -> None:  # what the trainer does with store events
        if ledger is not None:
            ledger.append(str(event["event"]), **{k: v for k, v in event.items()
                                                  if k != "event"})

    cfg = StoreConfig(lustre_uri=f"{root}/lustre", keep_lustre=SAVES + 1)
    st = CheckpointStore.from_config(cfg, rank=rank, world_size=world, node=f"node{rank}",
                                     env={}, on_event=forward)
    for step in range(1, SAVES + 1):
        st.save(step, state_at(step, world, mesh))
    st.wait()
    dist.barrier()
    if rank == 0:
        craft(root, os.path.join(root, "pwned"))
    dist.barrier()
    outside = outside_files(root)
    tmpl = {"model": {"w": distribute_tensor(torch.zeros(64 * world, 8), mesh, [Shard(0)]),
                      "bias": torch.zeros(8)}, "step": torch.tensor(0), "note": None}
    with OpenAudit.get().recording() as opened:
        res = st.restore(tmpl)
    want = state_at(1, world, mesh)
    ok = (res is not None and res.step == 1 and int(tmpl["step"]) == 1
          and tmpl["note"] == "step 1"
          and torch.equal(tmpl["model"]["w"].to_local(), want["model"]["w"].to_local())
          and torch.equal(tmpl["model"]["bias"], want["model"]["bias"]))
    under_root = sorted({p for p in opened if p.startswith(os.path.abspath(root) + os.sep)})
    st.close()
    leave_gloo()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"ok": ok, "step": res.step if res else None, "outside": outside,
                   "opened_under_root": under_root,
                   "skipped": [list(s) for s in res.skipped] if res else []}, f)
