"""The layout frozen at submit is what runs on the real local Slurm cluster: the ranks the agents
start and the device each rank is told to use (slurmkit.layout, slurmkit.contract)."""

from __future__ import annotations

import os

import pytest

from slurmkit.contract import parse_device, visible_count
from slurmkit.layout import read_layout
from tests.integration.helpers import (
    ALLREDUCE, parse_submitted, read_json, read_ledger, slurm_env, submit_cli, wait_terminal,
)

pytestmark = pytest.mark.integration


def _run(args: list[str], cluster_env, tmp_path) -> tuple[str, dict]:
    env = slurm_env(cluster_env)
    res = submit_cli([*args, "cluster=local_slurm", ALLREDUCE, f"submit.run_root={tmp_path}"], env, str(tmp_path))
    assert res.returncode == 0, res.stderr + res.stdout
    job_id, run_dir = parse_submitted(res.stdout)
    state = wait_terminal(job_id, env)
    assert state == "COMPLETED", open(os.path.join(run_dir, "logs", "rank0.log")).read()
    return run_dir, read_json(os.path.join(run_dir, "allreduce.json"))


def test_cpu_job_on_a_gpu_cluster_runs_the_ranks_its_layout_says(cluster_env, tmp_path) -> None:
    """job.gpus_per_node=0 on the 4-GPU local_slurm nodes: one CPU rank per node everywhere
    (the agent used to start 4, one per cluster GPU, while the batch script asked for 1)."""
    run_dir, out = _run(["+exp=tiny", "job.name=cpulayout", "job.gpus_per_node=0", "job.ranks_per_node=null"],
                        cluster_env, tmp_path)
    layout = read_layout(run_dir)
    assert (layout.nodes, layout.ranks_per_node, layout.gpus_per_node, layout.world_size) == (2, 1, 0, 2)
    assert out["world_size"] == layout.world_size and out["sum"] == out["expected"] == 1
    assert sorted(r["node"] for r in out["ranks"]) == sorted({r["node"] for r in out["ranks"]})
    assert [r["device"] for r in out["ranks"]] == ["cpu", "cpu"]
    started = [e for e in read_ledger(run_dir) if e["event"] == "ranks_started"]
    assert sorted(r for e in started for r in e["ranks"]) == [0, 1]
    assert all(len(e["ranks"]) == layout.ranks_per_node for e in started)


def test_gpu_ranks_are_told_a_device_inside_slurms_visible_devices(cluster_env, tmp_path) -> None:
    """Slurm's GRES sets CUDA_VISIBLE_DEVICES (never narrowed then): each rank's SLURMKIT_DEVICE
    is an index among what it sees, and the two ranks of the node take different GPUs."""
    run_dir, out = _run(["+exp=tiny", "job.name=gpulayout", "job.nodes=1", "job.gpus_per_node=2",
                         "job.ranks_per_node=null"], cluster_env, tmp_path)
    layout = read_layout(run_dir)
    assert (layout.ranks_per_node, layout.gpus_per_node, layout.world_size) == (2, 2, 2)
    ranks = sorted(out["ranks"], key=lambda r: r["rank"])
    assert [int(r["local_rank"]) for r in ranks] == [0, 1]
    for r in ranks:
        choice = parse_device(r["device"])
        assert choice.kind == "cuda" and choice.index is not None
        assert r["cuda_visible_devices"] is not None
        assert choice.index < visible_count(r["cuda_visible_devices"]), r
    if all(visible_count(r["cuda_visible_devices"]) == 2 for r in ranks):
        assert [parse_device(r["device"]).index for r in ranks] == [0, 1]
