"""`python -m slurmkit.topo` and `python -m slurmkit.topology.fake` as a user runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from .test_reference import H100, H100_HCA


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "NCCL_"))}
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=120, env=env)


def test_plan_json_of_a_fake_dgx_h100(tmp_path):
    root = str(tmp_path / "h100")
    made = _run("slurmkit.topology.fake", "dgx_h100", root)
    assert made.returncode == 0, made.stderr
    out = _run("slurmkit.topo", "plan", "--sysfs-root", root, "--local-size", "8", "--json")
    assert out.returncode == 0, out.stderr
    ranks = json.loads(out.stdout)
    assert [r["local_rank"] for r in ranks] == list(range(8))
    for rank, (bus, cpus, mem, nics) in zip(ranks, H100):
        assert rank["gpus"] == [bus]
        assert all(isinstance(c, int) for c in rank["cpus"])
        assert rank["env"]["SLURMKIT_CPUS"] == cpus
        assert tuple(rank["mem_nodes"]) == mem and tuple(rank["nics"]) == nics
        assert rank["env"]["NCCL_IB_HCA"] == H100_HCA
    assert ranks[0]["cpus"][:3] == [0, 1, 2] and ranks[0]["cpus"][-1] == 125


def test_show_and_table_output(tmp_path):
    root = str(tmp_path / "a100")
    assert _run("slurmkit.topology.fake", "dgx_a100", root).returncode == 0
    show = _run("slurmkit.topo", "show", "--sysfs-root", root)
    assert show.returncode == 0 and "0000:07:00.0" in show.stdout and "mlx5_0 (PXB)" in show.stdout
    table = _run("slurmkit.topo", "plan", "--sysfs-root", root)
    assert table.returncode == 0 and "48-55,176-183" in table.stdout and "NCCL_IB_HCA=" in table.stdout


def test_this_machine_without_gpus(tmp_path):
    out = _run("slurmkit.topo", "plan", "--local-size", "2", "--json")
    assert out.returncode == 0, out.stderr
    ranks = json.loads(out.stdout)
    cpus = [c for r in ranks for c in r["cpus"]]
    assert sorted(cpus) == sorted(os.sched_getaffinity(0)) or len(os.sched_getaffinity(0)) < 2
    assert all(r["gpus"] == [] and "CUDA_VISIBLE_DEVICES" not in r["env"] for r in ranks)


def test_bad_input_exits_2_with_detected_requirement_fix(tmp_path):
    not_sysfs = _run("slurmkit.topo", "plan", "--sysfs-root", str(tmp_path))
    assert not_sysfs.returncode == 2
    assert "Detected:" in not_sysfs.stderr and "Fix:" in not_sysfs.stderr
    root = str(tmp_path / "cpu")
    assert _run("slurmkit.topology.fake", "cpu_only", root).returncode == 0
    zero = _run("slurmkit.topo", "plan", "--sysfs-root", root, "--local-size", "0")
    assert zero.returncode == 2 and "local_size=0" in zero.stderr
