"""Ranks for the promotion tests: one job incarnation on a given set of emulated nodes."""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from tests.integration.store_workers import join_gloo, leave_gloo


def incarnation_main(rank: int, world: int, root: str, port: int, out: str,
                     nodes: list[str], first_step: int, saves: int, object_uri: str,
                     env: dict[str, str], killed_pending: bool) -> None:
    """One incarnation of a 4-rank job: rank r runs on emulated node ``nodes[r]`` (ranks of
    one node share its NVMe directory). ``saves`` saves from ``first_step`` on; Lustre every
    4th save, S3 every 2nd.

    ``killed_pending``: the job dies right after its last save committed on NVMe, before
    that save's promotion could finish (ranks 2 and 3 never copy their files): the next
    incarnation finds it due, on nodes that may no longer hold it."""
    import torch.distributed as dist

    from slurmkit.store import CheckpointStore, StoreConfig

    join_gloo(rank, world, port)
    events: list[dict[str, Any]] = []
    cfg = StoreConfig(nvme_uri=f"{root}/nvme", lustre_uri=f"{root}/lustre",
                      object_uri=object_uri, lustre_every_saves=4, object_every_saves=2,
                      keep_nvme=2, keep_lustre=2, keep_object=2, retry_attempts=2,
                      retry_initial_s=0.1, retry_max_s=0.5, commit_timeout_s=120)
    st = CheckpointStore.from_config(cfg, rank=rank, world_size=world, node=nodes[rank],
                                     env=env, on_event=events.append)
    w, own = torch.zeros(256, 64), torch.zeros(1024)
    state = {"model": {"w": w}, f"rank{rank}": own}
    last = first_step + saves - 1
    for step in range(first_step, last + 1):
        if step == last:
            st.wait()  # every promotion before the last save settled
            dist.barrier()
            if killed_pending and rank >= 2:
                st._promoter.stagger_delay_s = 3600.0  # these ranks die before copying
        w.fill_(step)  # replicated: rank 0 writes it
        own.fill_(step * 10 + rank)  # this rank's own shard
        assert st.save(step, state).wait()
    if not killed_pending:
        st.wait()
    dist.barrier()
    keep = ("event", "step", "tier", "reason", "error", "pending")
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"events": [{k: e.get(k) for k in keep} for e in events],
                   "pending": st.pending_promotions()}, f)
    if killed_pending:
        os._exit(0)  # no close(): promotions die mid-way, as in a killed job
    st.close()
    leave_gloo()
