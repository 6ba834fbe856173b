"""``python -m slurmkit.plan`` and ``check_config`` on configs composed from conf/."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest
from rich.console import Console

from slurmkit.cli import plan
from slurmkit.config.compose import compose
from slurmkit.errors import ConfigError
from slurmkit.train.planner import check_config


def run_plan(*overrides: str) -> tuple[int, str]:
    out = io.StringIO()
    code = plan.main(list(overrides), console=Console(file=out, width=200))
    return code, out.getvalue()


def test_plan_prints_the_estimate_of_a_fitting_layout() -> None:
    code, out = run_plan("+exp=llama70b", "cluster=dgx_h100")
    assert code == 0
    assert "llama70b (70.55 B params)" in out and "dp 64 x tp 1 x pp 1" in out
    assert "fits" in out and "yes" in out and "optimizer state" in out


def test_plan_rejects_too_few_nodes_with_the_fix() -> None:
    code, out = run_plan("+exp=llama70b", "cluster=dgx_h100", "job.nodes=2")
    assert code == 2
    assert "NO" in out and "job.nodes=4" in out


def test_plan_rejects_an_impossible_layout() -> None:
    code, out = run_plan("+exp=llama405b", "cluster=dgx_h100", "parallel.tensor=16")
    assert code == 2 and "divisor of 8" in out


def test_check_config_for_presets() -> None:
    est = check_config(compose(["+exp=llama405b", "cluster=dgx_h100"]))
    assert est.fits and est.tensor == 8 and est.world_size == 256
    tiny = check_config(compose(["+exp=tiny", "cluster=local"]), host_mem_gb=8.0)
    assert tiny.fits and not tiny.on_gpu and tiny.devices_per_node == 2
    with pytest.raises(ConfigError, match="per rank"):
        check_config(compose(["+exp=tiny", "cluster=local", "train.micro_batch=4096"]),
                     host_mem_gb=8.0)


def test_module_entry_point() -> None:
    proc = subprocess.run([sys.executable, "-m", "slurmkit.plan", "+exp=llama70b",
                           "cluster=dgx_h100"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "slurmkit plan: llama70b on dgx_h100" in proc.stdout
