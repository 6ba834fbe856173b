"""Typed configuration: schema dataclasses, Hydra composition, frozen YAML."""

from slurmkit.config.compose import (
    available,
    compose,
    conf_dir,
    config_hash,
    load_frozen,
    register_configs,
    to_yaml,
)
from slurmkit.config.schema import (
    ClusterConfig,
    JobConfig,
    SlurmkitConfig,
    SubmitConfig,
    SupervisorConfig,
)

__all__ = [
    "ClusterConfig", "JobConfig", "SlurmkitConfig", "SubmitConfig", "SupervisorConfig",
    "available", "compose", "conf_dir", "config_hash", "load_frozen", "register_configs", "to_yaml",
]
