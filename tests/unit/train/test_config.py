"""Config schemas: validation messages, unknown keys, and the YAML presets' published shapes."""

from __future__ import annotations

import os

import pytest
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError

from slurmkit.errors import ConfigError
from slurmkit.train.config import ModelConfig, ParallelConfig, TrainConfig
from slurmkit.train.flops import flops_per_token, param_count

CONF = os.path.join(os.path.dirname(__file__), "..", "..", "..", "conf")


def load(group: str, name: str, schema: type) -> object:
    raw = OmegaConf.load(os.path.join(CONF, group, f"{name}.yaml"))
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), raw))


@pytest.mark.parametrize("name,params_b,shape", [
    ("llama8b", 8.03, (4096, 32, 32, 8, 14336)),
    ("llama70b", 70.55, (8192, 80, 64, 8, 28672)),
    ("llama405b", 405.85, (16384, 126, 128, 8, 53248)),
])
def test_presets_have_published_shapes_and_sizes(name: str, params_b: float,
                                                 shape: tuple[int, ...]) -> None:
    m = load("model", name, ModelConfig)
    assert isinstance(m, ModelConfig)
    assert (m.dim, m.n_layers, m.n_heads, m.n_kv_heads, m.ffn_dim) == shape
    assert m.vocab_size == 128256 and m.rope_theta == 500000.0
    assert round(param_count(m).total / 1e9, 2) == params_b


def test_tiny_preset_is_a_few_million_parameters() -> None:
    m = load("model", "tiny", ModelConfig)
    assert isinstance(m, ModelConfig)
    assert 1e6 < param_count(m).total < 2e7
    assert 2048 <= m.vocab_size <= 8192 and 64 <= m.max_seq_len <= 128


def test_default_train_and_parallel_yaml_load() -> None:
    t = load("train", "default", TrainConfig)
    p = load("parallel", "default", ParallelConfig)
    assert isinstance(t, TrainConfig) and isinstance(p, ParallelConfig)
    assert t.ckpt_interval_steps > 0 and p.strategy == "auto"


def test_flops_per_token_is_6n_plus_attention() -> None:
    m = ModelConfig(name="x", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128,
                    vocab_size=100)
    n = param_count(m).non_embedding
    assert flops_per_token(m, 10) == 6 * n + 12 * 2 * 64 * 10
    # Llama 3 8B at 8192 tokens: about 58 GFLOP per token.
    big = load("model", "llama8b", ModelConfig)
    assert isinstance(big, ModelConfig)
    assert 55e9 < flops_per_token(big, 8192) < 60e9


@pytest.mark.parametrize("kwargs,fragment", [
    ({"dim": 100, "n_heads": 8}, "multiple of model.n_heads"),
    ({"n_heads": 8, "n_kv_heads": 3}, "n_kv_heads divides"),
    ({"dim": 24, "n_heads": 8}, "even head dimension"),
    ({"vocab_size": 0}, "model.vocab_size is greater than 0"),
])
def test_model_validation(kwargs: dict[str, int], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment) as info:
        ModelConfig(**kwargs)  # type: ignore[arg-type]
    assert str(info.value).startswith("Detected:") and "Fix:" in str(info.value)


@pytest.mark.parametrize("kwargs,fragment", [
    ({"dtype": "fp16"}, "train.dtype"),
    ({"data": "memmap"}, "data_path"),
    ({"min_lr_ratio": 2.0}, "min_lr_ratio"),
    ({"ckpt_interval_steps": -1}, "ckpt_interval_steps"),
    ({"steps": 0}, "train.steps"),
])
def test_train_validation(kwargs: dict[str, object], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        TrainConfig(**kwargs)  # type: ignore[arg-type]


def test_parallel_validation_and_unknown_keys() -> None:
    with pytest.raises(ConfigError, match="parallel.strategy"):
        ParallelConfig(strategy="zero3")
    with pytest.raises(ConfigError, match="parallel.tensor"):
        ParallelConfig(tensor=0)
    with pytest.raises(ConfigKeyError):
        OmegaConf.merge(OmegaConf.structured(ParallelConfig), {"tensr": 2})
