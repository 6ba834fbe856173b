"""Per-rank pinning: sysfs discovery -> NodeTopology -> plan per local rank -> env, apply, verify.

The node agent calls exactly these names; everything else is internal.
"""

from .apply import PinningError, apply_plan, pin_command, verify_current, verify_from_env
from .config import TopologyConfig, register_configs
from .discover import discover
from .env import rank_env
from .model import Cpu, Gpu, Nic, NicPort, NodeTopology, NumaNode, PciDevice
from .plan import plan_node
from .rankplan import RankPlan
from .slurm import slurm_prebound, srun_binding_args

__all__ = [
    "Cpu",
    "Gpu",
    "Nic",
    "NicPort",
    "NodeTopology",
    "NumaNode",
    "PciDevice",
    "PinningError",
    "RankPlan",
    "TopologyConfig",
    "apply_plan",
    "discover",
    "pin_command",
    "plan_node",
    "rank_env",
    "register_configs",
    "slurm_prebound",
    "srun_binding_args",
    "verify_current",
    "verify_from_env",
]
