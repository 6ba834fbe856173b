"""Compose conf/ with Hydra into a typed, validated SlurmkitConfig, and freeze it to YAML."""

from __future__ import annotations

import hashlib
import os
from typing import Any

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException, MissingConfigException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from slurmkit.config.schema import SlurmkitConfig
from slurmkit.errors import ConfigError

_REGISTERED = False


def conf_dir(env: dict[str, str] | None = None) -> str:
    """The conf/ directory: $SLURMKIT_CONF_DIR, else the one beside the package."""
    env = dict(os.environ) if env is None else env
    if env.get("SLURMKIT_CONF_DIR"):
        return os.path.abspath(env["SLURMKIT_CONF_DIR"])
    return os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "conf")


def register_configs() -> None:
    """Register the schema in Hydra's ConfigStore (explicitly, never at import time)."""
    global _REGISTERED
    if _REGISTERED:
        return
    ConfigStore.instance().store(name="slurmkit_schema", node=SlurmkitConfig)
    _REGISTERED = True


def available(group: str, directory: str | None = None) -> list[str]:
    d = os.path.join(directory or conf_dir(), group)
    if not os.path.isdir(d):
        return []
    return sorted(f[:-5] for f in os.listdir(d) if f.endswith(".yaml"))


def _check_group_choices(overrides: list[str], directory: str) -> None:
    for ov in overrides:
        key, sep, value = ov.lstrip("+~").partition("=")
        if not sep or "." in key or not os.path.isdir(os.path.join(directory, key)):
            continue
        choices = available(key, directory)
        if value not in choices:
            raise ConfigError(
                f"{key}={value!r}, which is not in {os.path.join(directory, key)}",
                f"one of: {', '.join(choices)}",
                f"pick one of those, or add {os.path.join(directory, key, value)}.yaml",
            )


def compose_dict(overrides: list[str], directory: str | None = None) -> Any:
    """Hydra-compose conf/config.yaml with ``overrides``; returns the raw DictConfig."""
    directory = directory or conf_dir()
    register_configs()
    _check_group_choices(overrides, directory)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=directory, version_base="1.3", job_name="slurmkit"):
            return hydra_compose(config_name="config", overrides=list(overrides))
    except MissingConfigException as exc:
        raise ConfigError(str(exc).splitlines()[0], "an existing config option",
                          f"see the files under {directory}") from exc
    except (HydraException, OmegaConfBaseException) as exc:
        raise ConfigError(f"invalid configuration or override: {exc}".replace("\n", " "),
                          "keys and values that the schema in slurmkit/config/schema.py defines",
                          "check the spelling of the override (key=value, +key=value to add)") from exc
    finally:
        GlobalHydra.instance().clear()


def to_typed(raw: Any) -> SlurmkitConfig:
    """DictConfig -> SlurmkitConfig, running every component's validation."""
    try:
        obj = OmegaConf.to_object(raw)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"invalid configuration: {exc}".replace("\n", " "),
                          "values of the types the schema defines",
                          "fix the value named above") from exc
    if not isinstance(obj, SlurmkitConfig):
        raise ConfigError(f"config composed to {type(obj).__name__}", "a SlurmkitConfig",
                          "keep `slurmkit_schema` first in conf/config.yaml's defaults")
    return obj


def compose(overrides: list[str], directory: str | None = None) -> SlurmkitConfig:
    """Compose and validate: the one way to get a config from conf/ and command-line overrides."""
    return to_typed(compose_dict(overrides, directory))


def to_yaml(cfg: SlurmkitConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def config_hash(cfg: SlurmkitConfig) -> str:
    return hashlib.sha256(to_yaml(cfg).encode()).hexdigest()[:16]


def load_frozen(path: str) -> SlurmkitConfig:
    """Load a config frozen into a run directory (a requeued job runs exactly this)."""
    register_configs()
    try:
        raw = OmegaConf.merge(OmegaConf.structured(SlurmkitConfig), OmegaConf.load(path))
    except (OSError, OmegaConfBaseException) as exc:
        raise ConfigError(f"cannot load the frozen config {path}: {exc}",
                          "the config.yaml that submit wrote into the run directory",
                          "resubmit the experiment") from exc
    return to_typed(raw)
