"""How slurmkit's pinning and Slurm's own task binding share the work."""

from __future__ import annotations

from collections.abc import Mapping

from .config import TopologyConfig
from .model import NodeTopology


def srun_binding_args(cfg: TopologyConfig) -> list[str]:
    """Extra srun arguments for the step that starts the node agents.

    When slurmkit binds (the default), Slurm must not: a Slurm mask on the agent would confine
    every rank to the agent's cores. GPUs are requested per node (--gpus-per-node), never per
    task, by the renderer, so that each rank can still reach its NVLink peers.
    """
    if not cfg.enabled or cfg.binder == "slurm":
        return []
    return ["--cpu-bind=none"]


def slurm_prebound(env: Mapping[str, str], topo: NodeTopology) -> bool:
    """True when Slurm (or a cgroup) already restricted this task to part of the node.

    Then the planner keeps inside the mask and chooses GPUs and NICs near it.
    """
    bind_type = env.get("SLURM_CPU_BIND_TYPE", "").strip().rstrip(",")
    if bind_type and not bind_type.startswith("none"):
        return True
    bind_list = env.get("SLURM_CPU_BIND_LIST", "").strip()
    if bind_list and bind_type != "none":
        return True
    online = set(topo.online_cpus)
    return bool(env.get("SLURM_JOB_ID")) and set(topo.allowed_cpus) < online
