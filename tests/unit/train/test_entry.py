"""``python -m slurmkit.train``: typed config sections, strategy resolution, error exits."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest
from omegaconf import OmegaConf

from slurmkit.errors import ConfigError
from slurmkit.train.__main__ import resolve_strategy, section
from slurmkit.train.config import ModelConfig, ParallelConfig, TrainConfig
from slurmkit.launch.localranks import free_port, write_config


def test_section_types_and_rejects_unknown_keys() -> None:
    raw = OmegaConf.create({"model": {"dim": 64, "n_heads": 4, "n_kv_heads": 2}})
    m = section(raw, "model", ModelConfig)
    assert isinstance(m, ModelConfig) and m.dim == 64
    assert section(OmegaConf.create({}), "train", TrainConfig) == TrainConfig()
    with pytest.raises(ConfigError, match="hidden_size"):
        section(OmegaConf.create({"model": {"hidden_size": 64}}), "model", ModelConfig)
    with pytest.raises(ConfigError, match="model.n_kv_heads divides"):
        section(OmegaConf.create({"model": {"n_kv_heads": 3}}), "model", ModelConfig)


def test_auto_strategy_replicates_small_models_and_shards_huge_ones() -> None:
    small = ModelConfig()
    t = TrainConfig(seq_len=64)
    assert resolve_strategy(small, ParallelConfig(), t, world=2, local_world=2,
                            on_gpu=False) == "ddp"
    huge = ModelConfig(name="h", dim=16384, n_layers=126, n_heads=128, n_kv_heads=8,
                       ffn_dim=53248, vocab_size=128256)
    assert resolve_strategy(huge, ParallelConfig(), t, world=2, local_world=2,
                            on_gpu=False) == "fsdp"
    assert resolve_strategy(huge, ParallelConfig(strategy="ddp"), t, world=2,
                            local_world=2, on_gpu=False) == "ddp"


def run_module(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "slurmkit.train"], env=env,
                          capture_output=True, text=True, timeout=120)


def test_missing_config_exits_2_with_the_fix() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURMKIT_")}
    proc = run_module(env)
    assert proc.returncode == 2
    assert "Detected: SLURMKIT_CONFIG is not set" in proc.stderr


def test_tensor_parallel_is_refused_at_start(tmp_path: Any) -> None:
    cfg = write_config(os.path.join(str(tmp_path), "c.yaml"), {
        "model": {"dim": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 2, "ffn_dim": 64,
                  "vocab_size": 64, "max_seq_len": 16},
        "parallel": {"tensor": 2}, "train": {"steps": 1, "seq_len": 8}})
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "SLURMKIT_CONFIG": cfg, "SLURMKIT_RUN_DIR": str(tmp_path)}
    env.pop("SLURMKIT_LEDGER", None)
    proc = run_module(env)
    assert proc.returncode == 2, proc.stderr
    assert "parallel.tensor=2" in proc.stderr and "data parallelism only" in proc.stderr
