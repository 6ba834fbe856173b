"""RankPlan: what one local rank gets. JSON in and out (it crosses exec via the pin wrapper)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from slurmkit.errors import ConfigError


@dataclass(frozen=True)
class RankPlan:
    local_rank: int
    local_size: int
    gpus: tuple[str, ...]  # PCI bus ids, sysfs form (0000:1b:00.0)
    gpu_indices: tuple[int, ...]  # CUDA indices under CUDA_DEVICE_ORDER=PCI_BUS_ID
    gpu_uuids: tuple[str, ...]
    cpus: tuple[int, ...]  # OS CPU ids the rank may run on
    cores: int  # physical cores among cpus (OMP_NUM_THREADS)
    bind_cpus: bool  # False: leave the affinity as inherited (cpu_mode none)
    mem_nodes: tuple[int, ...]
    mem_mode: str  # preferred | bind | interleave | none
    nics: tuple[str, ...]  # NIC names (mlx5_0)
    nic_ports: tuple[str, ...]  # name:port of an active port (mlx5_0:1), for UCX
    nic_kinds: tuple[str, ...]  # "rdma"/"eth" per NIC
    nic_drivers: tuple[str, ...]  # kernel driver per NIC (mlx5_core, efa)
    numa_node: int  # the rank's home node (-1 when unknown)
    warnings: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RankPlan:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        missing = sorted(n for n in names - set(data) if n != "warnings")
        if unknown or missing:
            raise ConfigError(
                detected=f"rank plan with unknown keys {unknown} / missing keys {missing}",
                requirement="a plan written by RankPlan.to_json of the same slurmkit version",
                fix="regenerate the plan with `python -m slurmkit.topo plan --json`",
            )
        values: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}
        return cls(**values)

    @classmethod
    def from_json(cls, text: str) -> RankPlan:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(
                detected=f"rank plan that is not JSON ({exc})",
                requirement="the JSON of RankPlan.to_json",
                fix="pass the plan exactly as slurmkit wrote it",
            ) from exc
        if not isinstance(data, dict):
            raise ConfigError(
                detected=f"rank plan JSON of type {type(data).__name__}",
                requirement="a JSON object",
                fix="pass the plan exactly as slurmkit wrote it",
            )
        return cls.from_dict(data)
