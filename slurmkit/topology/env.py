"""The environment variables that tell a rank (and CUDA, NCCL, UCX, OpenMP) its plan."""

from __future__ import annotations

from collections.abc import Mapping

from .config import TopologyConfig
from .cpulist import format_cpulist
from .rankplan import RankPlan


def rank_env(
    plan: RankPlan, all_plans: list[RankPlan], base_env: Mapping[str, str], cfg: TopologyConfig
) -> dict[str, str]:
    """Variables to ADD to ``base_env`` for this rank; anything already set there is kept.

    NCCL_IB_HCA is node-wide (the union of every rank's NICs, exact match with a leading ``=``
    because ``mlx5_1`` would also select mlx5_10 and mlx5_11); UCX_NET_DEVICES is the rank's own.
    """
    if not cfg.enabled:
        return {}
    wanted: dict[str, str] = {
        "SLURMKIT_CPUS": format_cpulist(plan.cpus),
        "SLURMKIT_CPU_BIND": "1" if plan.bind_cpus else "0",
        "SLURMKIT_MEM_NODES": ",".join(str(n) for n in plan.mem_nodes),
        "SLURMKIT_MEM_POLICY": plan.mem_mode if plan.mem_nodes else "none",
        "SLURMKIT_PIN_VERIFY": cfg.verify,
        "OMP_NUM_THREADS": str(max(1, plan.cores)),
    }
    if plan.gpus:
        wanted["SLURMKIT_GPUS"] = ",".join(plan.gpus)
    if plan.nics:
        wanted["SLURMKIT_NICS"] = ",".join(plan.nics)
    if any(p.gpus for p in all_plans):
        wanted["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        if cfg.gpu_visibility == "rank" and plan.gpus:
            wanted["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in plan.gpu_indices)
    if not _nic_plugin_chooses(all_plans, base_env):
        wanted.update(_nic_env(plan, all_plans))
    return {k: v for k, v in wanted.items() if k not in base_env}


def _nic_plugin_chooses(all_plans: list[RankPlan], base_env: Mapping[str, str]) -> bool:
    """EFA (libfabric) picks its NICs itself; NCCL_IB_HCA would only get in its way."""
    if base_env.get("FI_PROVIDER", "").lower() == "efa":
        return True
    for plan in all_plans:
        for name, driver in zip(plan.nics, plan.nic_drivers):
            if driver == "efa" or name.startswith("rdmap"):
                return True
    return False


def _nic_env(plan: RankPlan, all_plans: list[RankPlan]) -> dict[str, str]:
    out: dict[str, str] = {}
    rdma: list[str] = []
    eth: list[str] = []
    for p in all_plans:
        for name, kind in zip(p.nics, p.nic_kinds):
            bucket = rdma if kind == "rdma" else eth
            if name not in bucket:
                bucket.append(name)
    if rdma:
        out["NCCL_IB_HCA"] = "=" + ",".join(rdma)
    if eth:
        out["NCCL_SOCKET_IFNAME"] = "=" + ",".join(eth)
    ports = [port for port, kind in zip(plan.nic_ports, plan.nic_kinds) if kind == "rdma"]
    if ports:
        out["UCX_NET_DEVICES"] = ",".join(ports)
    return out
