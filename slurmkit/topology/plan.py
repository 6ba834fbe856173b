"""plan_node: a pure function from (NodeTopology, local ranks, policy) to one RankPlan per rank."""

from __future__ import annotations

import math
from collections.abc import Mapping

from slurmkit.errors import ConfigError

from .config import TopologyConfig
from .cores import exclusive_slices, majority_node, physical_cores, widen
from .memory import memory_nodes
from .model import Gpu, Nic, NodeTopology
from .nics import assign_nics, nic_port, usable_nics
from .rankplan import RankPlan
from .slurm import slurm_prebound


def plan_node(
    topo: NodeTopology,
    local_size: int,
    cfg: TopologyConfig,
    env: Mapping[str, str] | None = None,
) -> list[RankPlan]:
    """One plan per local rank: GPU(s), cores, NUMA memory, NIC(s).

    ``env`` (the agent's environment) only tells whether Slurm already bound the task
    (SLURM_CPU_BIND_*); then GPUs are chosen from the cores, as Slurm's ``closest`` does.
    """
    if local_size < 1:
        raise ConfigError(
            detected=f"local_size={local_size}",
            requirement="at least one rank per node",
            fix="set the number of tasks/ranks per node to 1 or more",
        )
    prebound = cfg.binder == "slurm" or slurm_prebound(env or {}, topo)
    cpu_first = cfg.gpu_order == "cpu_first" or prebound
    gpus = list(topo.gpus)
    if cpu_first:
        # Only the GPUs near the allowed cores count; a task Slurm bound gets one GPU.
        near = _gpus_near_allowed(topo, gpus)
        per_rank = 1 if prebound and gpus else _gpus_per_rank(len(near), local_size, 0)
        per_rank = min(cfg.gpus_per_rank, len(gpus)) if cfg.gpus_per_rank else per_rank
    else:
        per_rank = _gpus_per_rank(len(gpus), local_size, cfg.gpus_per_rank)
    if cpu_first:
        slices, warnings = exclusive_slices(topo, [-1] * local_size, cfg.keep_smt_siblings)
        homes = [majority_node(topo, s) for s in slices]
        rank_gpus = _gpus_near_cores(topo, gpus, homes, per_rank)
    else:
        rank_gpus = _gpus_in_pci_order(gpus, local_size, per_rank)
        homes = [g[0].numa_node if g else -1 for g in rank_gpus]
        slices, warnings = exclusive_slices(topo, homes, cfg.keep_smt_siblings)
        homes = [h if h >= 0 else majority_node(topo, s) for h, s in zip(homes, slices)]
    nics, down, nic_warnings = usable_nics(topo, cfg)
    used = sorted({g.bdf: g for gs in rank_gpus for g in gs}.values(), key=lambda g: g.index)
    nic_of = assign_nics(topo, used, nics, down) if cfg.nic_mode == "closest" else {}
    notes = tuple(warnings + nic_warnings)
    return [
        _rank_plan(topo, cfg, r, local_size, rank_gpus[r], slices[r], homes[r], nics, nic_of, notes)
        for r in range(local_size)
    ]


def _gpus_per_rank(n_gpus: int, local_size: int, wanted: int) -> int:
    if n_gpus == 0:
        return 0
    if wanted:
        return min(wanted, n_gpus)
    return max(1, n_gpus // local_size)


def _gpus_near_allowed(topo: NodeTopology, gpus: list[Gpu]) -> list[Gpu]:
    node_of = {c.id: c.node for c in topo.cpus}
    nodes = {node_of.get(c, -1) for c in topo.allowed_cpus}
    return [g for g in gpus if g.numa_node in nodes] or gpus


def _gpus_in_pci_order(gpus: list[Gpu], local_size: int, per_rank: int) -> list[list[Gpu]]:
    """Rank r -> the r-th block of GPUs; with more ranks than GPUs, neighbours share one."""
    if not gpus:
        return [[] for _ in range(local_size)]
    out = []
    for rank in range(local_size):
        if local_size * per_rank <= len(gpus):
            start = rank * per_rank
        else:
            start = rank * len(gpus) // local_size
        out.append([gpus[(start + i) % len(gpus)] for i in range(per_rank)])
    return out


def _gpus_near_cores(
    topo: NodeTopology, gpus: list[Gpu], homes: list[int], per_rank: int
) -> list[list[Gpu]]:
    """Each rank takes the least used GPU(s) nearest its cores' node (then PCI order)."""
    if not gpus:
        return [[] for _ in homes]
    cap = math.ceil(len(homes) * per_rank / len(gpus))
    load = {g.bdf: 0 for g in gpus}
    out = []
    for home in homes:
        mine: list[Gpu] = []
        for _ in range(per_rank):
            free = [g for g in gpus if load[g.bdf] < cap and g not in mine] or gpus
            gpu = min(free, key=lambda g: (_numa_distance(topo, home, g.numa_node), load[g.bdf], g.index))
            load[gpu.bdf] += 1
            mine.append(gpu)
        out.append(sorted(mine, key=lambda g: g.index))
    return out


def _numa_distance(topo: NodeTopology, a: int, b: int) -> int:
    return topo.distance(a, b) if a >= 0 and b >= 0 else 255


def _rank_plan(
    topo: NodeTopology,
    cfg: TopologyConfig,
    rank: int,
    local_size: int,
    gpus: list[Gpu],
    cpus: tuple[int, ...],
    home: int,
    nics: list[Nic],
    nic_of: dict[str, Nic],
    warnings: tuple[str, ...],
) -> RankPlan:
    if cfg.cpu_mode in ("numa", "socket"):
        cpus = widen(topo, cpus, cfg.cpu_mode)
    elif cfg.cpu_mode == "none":
        cpus = tuple(topo.allowed_cpus)
    rank_nics = _rank_nics(cfg, gpus, nics, nic_of)
    return RankPlan(
        local_rank=rank,
        local_size=local_size,
        gpus=tuple(g.bdf for g in gpus),
        gpu_indices=tuple(g.index for g in gpus),
        gpu_uuids=tuple(g.uuid for g in gpus),
        cpus=cpus,
        cores=physical_cores(topo, cpus),
        bind_cpus=cfg.cpu_mode != "none",
        mem_nodes=memory_nodes(topo, home, cfg.mem_mode),
        mem_mode=cfg.mem_mode,
        nics=tuple(n.name for n in rank_nics),
        nic_ports=tuple(nic_port(n) for n in rank_nics),
        nic_kinds=tuple(n.kind for n in rank_nics),
        nic_drivers=tuple(n.driver for n in rank_nics),
        numa_node=home,
        warnings=warnings,
    )


def _rank_nics(
    cfg: TopologyConfig, gpus: list[Gpu], nics: list[Nic], nic_of: dict[str, Nic]
) -> list[Nic]:
    if not gpus or cfg.nic_mode == "none":
        return []
    if cfg.nic_mode == "all":
        return list(nics)
    out: list[Nic] = []
    for gpu in gpus:
        nic = nic_of.get(gpu.bdf)
        if nic is not None and nic not in out:
            out.append(nic)
    return out
