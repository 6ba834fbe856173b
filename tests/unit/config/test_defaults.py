"""One source per default: the schema's dataclasses hold every default, and a config group's
default.yaml restates none of them (it only holds what differs, such as the store's tiers), so
the two can never disagree again. docs/config.md says the same to users."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from slurmkit.config import compose, load_frozen
from slurmkit.config.schema import REMOVED_KEYS, SlurmkitConfig
from slurmkit.errors import ConfigError
from slurmkit.resources import packaged
from slurmkit.train.config import TrainConfig

CONF = Path(str(packaged("conf")))
GROUP_DEFAULTS = sorted(CONF.glob("*/default.yaml"))
SECTIONS = typing.get_type_hints(SlurmkitConfig)
FROZEN_BEFORE = Path(__file__).resolve().parents[2] / "data" / "report" / "three_faults" / "config.yaml"


def _defaults(cls: type) -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(cls):
        if f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
        elif f.default is not dataclasses.MISSING:
            out[f.name] = f.default
    return out


def test_every_group_default_is_found() -> None:
    assert {p.parent.name for p in GROUP_DEFAULTS} >= {"health", "parallel", "store", "supervisor",
                                                      "topology", "train"}


@pytest.mark.parametrize("path", GROUP_DEFAULTS, ids=lambda p: p.parent.name)
def test_a_group_default_restates_no_dataclass_default(path: Path) -> None:
    cls = SECTIONS[path.parent.name]
    defaults = _defaults(cls)
    loaded = OmegaConf.to_container(OmegaConf.load(path), resolve=False) or {}
    assert isinstance(loaded, dict)
    loaded.pop("defaults", None)
    unknown = sorted(set(loaded) - {f.name for f in dataclasses.fields(cls)})
    assert not unknown, f"{path} sets keys {cls.__name__} does not have: {unknown}"
    restated = sorted(k for k, v in loaded.items() if k in defaults and v == defaults[k])
    assert not restated, (f"{path} restates the defaults of {cls.__name__} for {restated}: "
                          "remove them from the YAML (the dataclass is where defaults live)")


def test_the_composed_defaults_are_the_dataclass_defaults() -> None:
    cfg = compose(["cluster=local"])
    for name in ("parallel", "train", "topology", "supervisor", "health"):
        assert getattr(cfg, name) == SECTIONS[name](), name


def test_the_train_defaults_users_got_from_the_yaml_moved_into_the_dataclass() -> None:
    t = TrainConfig()  # the tiny model on CPU, as conf/train/default.yaml used to say
    assert (t.steps, t.seq_len, t.micro_batch, t.warmup_steps) == (200, 128, 4, 20)
    llama = compose(["+exp=llama70b", "cluster=dgx_h100"]).train
    assert (llama.steps, llama.seq_len, llama.micro_batch, llama.warmup_steps) == (10000, 8192, 1, 200)


def test_a_removed_key_is_refused_when_set_but_a_frozen_config_still_loads() -> None:
    assert REMOVED_KEYS == ("topology.nccl_topo_file",)
    with pytest.raises(ConfigError, match="nccl_topo_file"):
        compose(["cluster=local", "topology.nccl_topo_file=/etc/topo.xml"])
    assert "  nccl_topo_file: ''\n" in FROZEN_BEFORE.read_text()  # frozen before its removal
    cfg = load_frozen(str(FROZEN_BEFORE))
    assert not hasattr(cfg.topology, "nccl_topo_file") and cfg.topology.cpu_mode == "exclusive"
