"""Discovery of CPUs, NUMA nodes and the task's limits from sysfs/procfs; entry point discover().

No vendor tool is needed: everything comes from files that every Linux kernel provides.
"""

from __future__ import annotations

import logging
import os
import re

from slurmkit.errors import ConfigError

from .cpulist import parse_cpulist
from .devices import discover_gpus, discover_nics, discover_pci
from .enrich import enrich_from_nccl_xml, enrich_from_nvml
from .model import Cpu, NodeTopology, NumaNode
from .sysfs import ListDir, Tree

log = logging.getLogger(__name__)

_CPU_DIR = re.compile(r"^cpu(\d+)$")
_NODE_DIR = re.compile(r"^node(\d+)$")
_MEMTOTAL = re.compile(r"MemTotal:\s+(\d+)\s*kB")


def discover(
    sysfs_root: str = "/",
    proc_root: str | None = None,
    *,
    listdir: ListDir = os.listdir,
    nccl_topo_file: str | None = None,
    use_nvml: bool = True,
) -> NodeTopology:
    """Describe this node (or the fake tree at ``sysfs_root``) as an immutable NodeTopology.

    ``proc_root`` defaults to ``<sysfs_root>/proc``. ``nccl_topo_file`` (NCCL's topology XML)
    replaces the PCI paths of the GPUs and NICs it lists, for VMs whose PCI tree is flat.
    NVML only fills in missing UUIDs/minors, and only for the real root "/".
    """
    tree = Tree(sysfs_root, proc_root or os.path.join(sysfs_root, "proc"), listdir)
    _check_root(tree)
    notes: list[str] = []
    nodes = _discover_nodes(tree, notes)
    cpus = _discover_cpus(tree, nodes)
    online = tuple(c.id for c in cpus if c.online)
    allowed_cpus, allowed_mems = _discover_allowed(tree, online, nodes, notes)
    pci = discover_pci(tree)
    single_node = nodes[0].id if len(nodes) == 1 else None
    gpus = discover_gpus(tree, pci, nodes, single_node)
    nics = discover_nics(tree, pci, nodes, single_node)
    topo = NodeTopology(
        cpus=cpus,
        nodes=nodes,
        gpus=gpus,
        nics=nics,
        allowed_cpus=allowed_cpus,
        allowed_mems=allowed_mems,
        pci=pci,
        notes=tuple(notes),
    )
    if use_nvml and os.path.abspath(sysfs_root) == "/":
        topo = enrich_from_nvml(topo)
    if nccl_topo_file:
        topo = enrich_from_nccl_xml(topo, nccl_topo_file)
    return topo


def _check_root(tree: Tree) -> None:
    if not tree.isdir(tree.sys("devices", "system", "cpu")):
        raise ConfigError(
            detected=f"{tree.sysfs_root} has no sys/devices/system/cpu",
            requirement="a root directory that holds a Linux sysfs tree (sys/) and procfs (proc/)",
            fix="pass --sysfs-root / (the default) or a tree made by "
            "`python -m slurmkit.topology.fake dgx_h100 DIR`",
        )


def _discover_nodes(tree: Tree, notes: list[str]) -> tuple[NumaNode, ...]:
    base = tree.sys("devices", "system", "node")
    ids = sorted(int(m.group(1)) for n in tree.listdir(base) if (m := _NODE_DIR.match(n)))
    if not ids:
        # A kernel without NUMA support: one node holding every CPU and all memory.
        notes.append("no NUMA nodes in sysfs: treating the machine as node 0")
        present = tree.read(tree.sys("devices", "system", "cpu", "present")) or ""
        meminfo = tree.read(tree.proc("meminfo")) or ""
        return (NumaNode(0, parse_cpulist(present), _memtotal(meminfo), (10,)),)
    nodes = []
    for node_id in ids:
        path = os.path.join(base, f"node{node_id}")
        cpus = parse_cpulist(tree.read(os.path.join(path, "cpulist")) or "")
        mem = _memtotal(tree.read(os.path.join(path, "meminfo")) or "")
        dist_text = tree.read(os.path.join(path, "distance")) or ""
        distances = tuple(int(d) for d in dist_text.split())
        if len(distances) != len(ids):
            notes.append(f"node{node_id}: distance table missing or malformed")
            distances = tuple(10 if other == node_id else 20 for other in ids)
        nodes.append(NumaNode(node_id, cpus, mem, distances))
    return tuple(nodes)


def _memtotal(text: str) -> int:
    match = _MEMTOTAL.search(text)
    return int(match.group(1)) if match else 0


def _discover_cpus(tree: Tree, nodes: tuple[NumaNode, ...]) -> tuple[Cpu, ...]:
    base = tree.sys("devices", "system", "cpu")
    ids = sorted(int(m.group(1)) for n in tree.listdir(base) if (m := _CPU_DIR.match(n)))
    online_text = tree.read(os.path.join(base, "online"))
    online_set = set(parse_cpulist(online_text)) if online_text is not None else None
    node_of = {cpu: node.id for node in nodes for cpu in node.cpus}
    cpus = []
    for cpu_id in ids:
        path = os.path.join(base, f"cpu{cpu_id}")
        if online_set is not None:
            online = cpu_id in online_set
        else:
            # cpu0 usually has no "online" file because it cannot be taken offline.
            online = tree.read_int(os.path.join(path, "online"), 1) == 1
        topo_dir = os.path.join(path, "topology")
        siblings_text = tree.read(os.path.join(topo_dir, "thread_siblings_list"))
        cpus.append(
            Cpu(
                id=cpu_id,
                core_id=tree.read_int(os.path.join(topo_dir, "core_id"), cpu_id),
                package_id=tree.read_int(os.path.join(topo_dir, "physical_package_id"), 0),
                siblings=parse_cpulist(siblings_text) if siblings_text else (cpu_id,),
                online=online,
                node=node_of.get(cpu_id, nodes[0].id if len(nodes) == 1 else -1),
            )
        )
    return tuple(cpus)


def _discover_allowed(
    tree: Tree, online: tuple[int, ...], nodes: tuple[NumaNode, ...], notes: list[str]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    status = tree.read(tree.proc("self", "status"))
    all_mems = tuple(n.id for n in nodes)
    if status is None:
        notes.append("no proc/self/status: every online CPU and memory node is allowed")
        return online, all_mems
    fields = dict(
        (key.strip(), value.strip())
        for key, _, value in (line.partition(":") for line in status.splitlines())
    )
    cpus_text = fields.get("Cpus_allowed_list")
    mems_text = fields.get("Mems_allowed_list")
    online_set = set(online)
    cpus = tuple(c for c in parse_cpulist(cpus_text) if c in online_set) if cpus_text else online
    mems = parse_cpulist(mems_text) if mems_text else all_mems
    mems = tuple(m for m in mems if m in set(all_mems)) or all_mems
    if not cpus:
        raise ConfigError(
            detected=f"Cpus_allowed_list={cpus_text!r} shares no CPU with the online CPUs",
            requirement="at least one online CPU this task may run on",
            fix="check the job's CPU allocation (cgroup cpuset) and the online CPUs",
        )
    return cpus, mems
