"""Which NICs may carry NCCL traffic, and which one each GPU uses (nearest by PCI path)."""

from __future__ import annotations

from fnmatch import fnmatchcase

from .config import TopologyConfig
from .model import Gpu, Nic, NodeTopology
from .pcidist import path_distance


def usable_nics(topo: NodeTopology, cfg: TopologyConfig) -> tuple[list[Nic], list[Nic], list[str]]:
    """NICs of the wanted kinds allowed by the patterns: (with an active port, without, warnings)."""
    warnings: list[str] = []
    nics = []
    down = []
    for nic in topo.nics:
        if nic.kind not in cfg.nic_kinds:
            continue
        if cfg.nic_include and not any(fnmatchcase(nic.name, p) for p in cfg.nic_include):
            continue
        if any(fnmatchcase(nic.name, p) for p in cfg.nic_exclude):
            continue
        if not nic.active_ports:
            warnings.append(f"NIC {nic.name} ({nic.bdf}) has no active port: not used")
            down.append(nic)
            continue
        nics.append(nic)
    return sorted(nics, key=lambda n: (n.bdf, n.name)), down, warnings


def _nearest(topo: NodeTopology, gpu: Gpu, nics: list[Nic]) -> list[Nic]:
    keys = [(path_distance(gpu.pci_path, n.pci_path, gpu.numa_node, n.numa_node, topo), n) for n in nics]
    top = min(k for k, _ in keys)
    return [n for k, n in keys if k == top]


def assign_nics(
    topo: NodeTopology, gpus: list[Gpu], nics: list[Nic], down: list[Nic] | None = None
) -> dict[str, Nic]:
    """GPU bus id -> its NIC: the nearest one; among equally near NICs the least used so far,
    then the lowest PCI address (never the mlx5_N name: mlx5_N is not GPU N).

    GPUs with fewer equally-near candidates choose first, so a GPU with one nearest NIC is not
    pushed off it by a GPU that had a choice. Only "GPU NICs" (the nearest NIC of some GPU,
    counting NICs whose port is ``down``) are candidates, so that a GPU whose own NIC is down
    falls back to another GPU's NIC, never to a storage NIC that happens to be nearer.
    """
    if not nics or not gpus:
        return {}
    everything = [*nics, *(down or [])]
    affine = {n.bdf + n.name for gpu in gpus for n in _nearest(topo, gpu, everything)}
    candidates = [n for n in nics if n.bdf + n.name in affine] or nics
    best = {gpu.bdf: _nearest(topo, gpu, candidates) for gpu in gpus}
    load = {n.bdf + n.name: 0 for n in nics}
    chosen: dict[str, Nic] = {}
    for gpu in sorted(gpus, key=lambda g: (len(best[g.bdf]), g.bdf)):
        nic = min(best[gpu.bdf], key=lambda n: (load[n.bdf + n.name], n.bdf, n.name))
        load[nic.bdf + nic.name] += 1
        chosen[gpu.bdf] = nic
    return chosen


def nic_port(nic: Nic) -> str:
    """``name:port`` of the first active port, as UCX_NET_DEVICES wants it."""
    ports = nic.active_ports or nic.ports
    return f"{nic.name}:{ports[0].number}" if ports else nic.name


def is_efa(nic: Nic) -> bool:
    """AWS EFA (and its libfabric plugin) chooses NICs itself: leave NCCL's NIC variables alone."""
    return nic.driver == "efa" or nic.name.startswith("rdmap")
