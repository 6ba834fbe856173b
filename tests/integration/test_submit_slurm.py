"""Real jobs on the real local Slurm cluster (tools/local-cluster); local mode without Slurm is
test_submit_local.py (no Slurm version matters there)."""

from __future__ import annotations

import os

import pytest

from tests.integration.helpers import (
    ALLREDUCE,
    parse_submitted,
    read_json,
    read_ledger,
    slurm_env,
    submit_cli,
    wait_terminal,
)

pytestmark = [pytest.mark.integration, pytest.mark.slurm_version]  # CI: on 22.05 and 24.11


def _submit_and_wait(args, env, tmp_path):
    res = submit_cli([*args, ALLREDUCE, f"submit.run_root={tmp_path}"], env, str(tmp_path))
    assert res.returncode == 0, res.stderr + res.stdout
    job_id, run_dir = parse_submitted(res.stdout)
    assert "follow" in res.stdout and os.path.exists(os.path.join(run_dir, "config.yaml"))
    return job_id, run_dir, wait_terminal(job_id, env)


def test_single_node_job_completes(cluster_env, tmp_path) -> None:
    env = slurm_env(cluster_env)
    job_id, run_dir, state = _submit_and_wait(["+exp=tiny", "job.nodes=1", "job.name=single"], env, tmp_path)
    assert state == "COMPLETED", open(os.path.join(run_dir, "logs", "rank0.log")).read()
    out = read_json(os.path.join(run_dir, "allreduce.json"))
    assert out["world_size"] == 2 and out["sum"] == out["expected"] == 1


def test_two_nodes_two_ranks_each_allreduce(cluster_env, tmp_path) -> None:
    env = slurm_env(cluster_env)
    job_id, run_dir, state = _submit_and_wait(["+exp=tiny", "job.name=twobytwo"], env, tmp_path)
    assert state == "COMPLETED"
    out = read_json(os.path.join(run_dir, "allreduce.json"))
    assert out["world_size"] == 4 and out["sum"] == 6.0
    nodes = [r["node"] for r in sorted(out["ranks"], key=lambda r: r["rank"])]
    assert nodes[0] == nodes[1] and nodes[2] == nodes[3] and nodes[0] != nodes[2]
    assert sorted(int(r["local_rank"]) for r in out["ranks"]) == [0, 0, 1, 1]
    events = [e["event"] for e in read_ledger(run_dir)]
    assert events[0] == "submitted" and "allocation_start" in events and events.count("ranks_started") == 2
    for rank in range(4):
        assert os.path.getsize(os.path.join(run_dir, "logs", f"rank{rank}.log")) > 0


def test_gres_gpu_request_reaches_the_ranks(cluster_env, tmp_path) -> None:
    env = slurm_env(cluster_env)
    job_id, run_dir, state = _submit_and_wait(
        ["+exp=tiny", "job.name=gres", "job.nodes=1", "job.gpus_per_node=2", "cluster=local_slurm"],
        env, tmp_path)
    assert state == "COMPLETED"
    out = read_json(os.path.join(run_dir, "allreduce.json"))
    # Slurm's GRES plugin set the visible devices for the task: both ranks see the 2 GPUs.
    seen = {r["cuda_visible_devices"] for r in out["ranks"]}
    assert seen and all(v is not None and len(v.split(",")) in (1, 2) for v in seen), seen


def test_bad_partition_is_refused_and_nothing_is_left(cluster_env, tmp_path) -> None:
    env = slurm_env(cluster_env)
    res = submit_cli(["+exp=tiny", "cluster=local_slurm", "cluster.partition=nosuchpart",
                      "job.name=badpart", f"submit.run_root={tmp_path}"], env, str(tmp_path))
    assert res.returncode == 1
    assert "Invalid partition" in res.stderr and "Fix:" in res.stderr
    # Neither the run directory nor its parent submit.run_root/<job.name> is left behind.
    assert not (tmp_path / "badpart").exists()


def test_expedited_requeue_refused_by_sbatch_falls_back_to_requeue(cluster_env, tmp_path) -> None:
    # The site probe (cached) says 25.11 with enable_expedited_requeue, so submit asks for
    # --requeue=expedite; the real 22.05 sbatch refuses it ("option '--requeue' doesn't allow an
    # argument"), and the job goes in with plain --requeue, saying so.
    import time

    from slurmkit.slurm.capabilities import SiteCapabilities, cache_path, write_capabilities

    env = {**slurm_env(cluster_env), "SLURMKIT_CACHE_DIR": str(tmp_path / "cache")}
    (tmp_path / "cache").mkdir(mode=0o700)
    write_capabilities(cache_path(env), SiteCapabilities(probed_at=time.time(), version="25.11.0",
                                                         expedited_requeue=True, json_output=True))
    res = submit_cli(["+exp=tiny", "job.nodes=1", "job.name=expedite", ALLREDUCE, f"submit.run_root={tmp_path}"],
                     env, str(tmp_path))
    assert res.returncode == 0, res.stderr + res.stdout
    assert "sbatch refused --requeue=expedite" in res.stderr and "doesn't allow an argument" in res.stderr
    job_id, run_dir = parse_submitted(res.stdout)
    scripts = [os.path.join(run_dir, "submitit", n) for n in os.listdir(os.path.join(run_dir, "submitit"))
               if n.endswith("_submission.sh")]
    text = open(scripts[0]).read()
    assert "#SBATCH --requeue\n" in text and "--requeue=expedite" not in text
    assert wait_terminal(job_id, env) == "COMPLETED"
