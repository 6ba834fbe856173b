"""The memory/layout planner: presets that must fit, layouts that must fail with a fix."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
from omegaconf import OmegaConf

from slurmkit.errors import ConfigError
from slurmkit.train.config import ModelConfig, ParallelConfig, TrainConfig
from slurmkit.train.planner import check, estimate

CONF = os.path.join(os.path.dirname(__file__), "..", "..", "..", "conf", "model")
H100 = {"gpus_per_node": 8, "gpu_mem_gb": 80.0}
LLAMA_TRAIN = TrainConfig(seq_len=8192, micro_batch=1)
AC = ParallelConfig(activation_checkpointing=True)


def preset(name: str) -> ModelConfig:
    raw = OmegaConf.load(os.path.join(CONF, f"{name}.yaml"))
    obj = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), raw))
    assert isinstance(obj, ModelConfig)
    return obj


@pytest.mark.parametrize("name,parallel,nodes", [
    ("llama8b", AC, 1),
    ("llama8b", AC, 2),
    ("llama70b", AC, 8),
    ("llama405b", replace(AC, tensor=8), 32),
    ("llama405b", replace(AC, tensor=8), 64),
])
def test_presets_fit_on_h100_nodes(name: str, parallel: ParallelConfig, nodes: int) -> None:
    est = check(preset(name), parallel, LLAMA_TRAIN, nodes=nodes, **H100)
    assert est.fits and est.strategy == "fsdp"
    assert est.world_size == nodes * 8 == est.data_parallel * est.tensor
    assert 0 < est.total_gb <= 72.0


def test_tiny_on_cpu_uses_host_memory_and_stays_replicated() -> None:
    est = check(preset("tiny"), ParallelConfig(), TrainConfig(seq_len=128, micro_batch=4),
                nodes=1, gpus_per_node=0, gpu_mem_gb=16.0, ranks_per_node=2)
    assert est.strategy == "ddp" and not est.on_gpu and est.capacity_gb == 8.0
    # fp32 on CPU: 16 bytes of model state per parameter, replicated.
    assert est.params_gb + est.grads_gb + est.optimizer_gb == pytest.approx(
        est.params_total * 16 / 1e9)


def test_more_nodes_or_sharding_never_need_more_memory() -> None:
    m = preset("llama70b")
    totals = [estimate(m, AC, LLAMA_TRAIN, nodes=n, **H100).total_gb for n in (4, 8, 16)]
    assert totals[0] > totals[1] > totals[2]
    ddp = estimate(m, replace(AC, strategy="ddp"), LLAMA_TRAIN, nodes=8, **H100)
    assert ddp.params_gb == pytest.approx(m_params(m) * 4 / 1e9)
    assert estimate(m, AC, LLAMA_TRAIN, nodes=8, **H100).params_gb < ddp.params_gb / 60


def m_params(m: ModelConfig) -> float:
    from slurmkit.train.flops import param_count
    return param_count(m).total


def test_activation_checkpointing_cuts_activation_memory() -> None:
    m = preset("llama8b")
    off = estimate(m, ParallelConfig(), LLAMA_TRAIN, nodes=2, **H100)
    on = estimate(m, AC, LLAMA_TRAIN, nodes=2, **H100)
    assert on.activations_gb < off.activations_gb / 3


def test_too_big_suggests_the_smallest_node_count() -> None:
    with pytest.raises(ConfigError) as info:
        check(preset("llama70b"), AC, LLAMA_TRAIN, nodes=1, **H100)
    msg = str(info.value)
    assert "Detected: llama70b needs about" in msg and "per GPU" in msg
    assert "Requirement: at most 72.0 GB" in msg
    smallest = next(n for n in range(1, 64)
                    if estimate(preset("llama70b"), AC, LLAMA_TRAIN, nodes=n, **H100).fits)
    assert f"job.nodes={smallest}" in msg


def test_405b_without_tensor_parallel_is_told_to_use_it() -> None:
    with pytest.raises(ConfigError, match=r"parallel\.tensor=\d") as info:
        check(preset("llama405b"), AC, LLAMA_TRAIN, nodes=32, **H100)
    assert "fsdp, dp=256, tp=1" in str(info.value)


def test_ddp_of_70b_is_told_to_shard_and_recompute() -> None:
    with pytest.raises(ConfigError, match="parallel.strategy=fsdp and "
                                          "parallel.activation_checkpointing=true"):
        check(preset("llama70b"), ParallelConfig(strategy="ddp"), LLAMA_TRAIN, nodes=8,
              **H100)


@pytest.mark.parametrize("parallel,train,nodes,fragment", [
    (ParallelConfig(tensor=3), LLAMA_TRAIN, 8, "divides the number of heads"),
    (ParallelConfig(tensor=16, activation_checkpointing=True), LLAMA_TRAIN, 8,
     "divides the number of heads"),
    (ParallelConfig(pipeline=3), LLAMA_TRAIN, 1, "world size = data x tensor x pipeline"),
    (AC, replace(LLAMA_TRAIN, global_batch=100), 8, "multiple of 64"),
    (AC, replace(LLAMA_TRAIN, seq_len=16384), 8, "max_seq_len"),
])
def test_broken_layouts_fail_with_a_fix(parallel: ParallelConfig, train: TrainConfig,
                                        nodes: int, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment) as info:
        check(preset("llama70b"), parallel, train, nodes=nodes, **H100)
    assert "Fix: " in str(info.value)


def test_tensor_parallel_stays_inside_a_node() -> None:
    m = replace(preset("llama8b"), n_heads=64, n_kv_heads=16)
    with pytest.raises(ConfigError, match="stays inside one node") as info:
        check(m, replace(AC, tensor=16), LLAMA_TRAIN, nodes=4, **H100)
    assert "parallel.tensor=8" in str(info.value)


def test_rows_render_the_layout() -> None:
    est = check(preset("llama70b"), AC, LLAMA_TRAIN, nodes=8, **H100)
    rows = dict(est.rows())
    assert rows["fits"] == "yes" and "dp 64 x tp 1 x pp 1" in rows["layout"]
