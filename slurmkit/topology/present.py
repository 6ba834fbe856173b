"""Human-readable tables of a topology and its plans (rich); the CLI's only output layer."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from .cpulist import format_cpulist
from .model import NodeTopology
from .pcidist import class_name, path_distance
from .rankplan import RankPlan


def show_topology(topo: NodeTopology, console: Console) -> None:
    nodes = Table(title="NUMA nodes")
    for col in ("node", "cpus", "allowed cpus", "memory GiB", "distances"):
        nodes.add_column(col)
    allowed = set(topo.allowed_cpus)
    for node in topo.nodes:
        nodes.add_row(
            str(node.id),
            format_cpulist(node.cpus) or "-",
            format_cpulist(c for c in node.cpus if c in allowed) or "-",
            f"{node.mem_total_kb / 1024**2:.1f}",
            " ".join(str(d) for d in node.distances),
        )
    console.print(nodes)
    gpus = Table(title="GPUs")
    for col in ("index", "bus id", "numa", "minor", "uuid", "nearest NICs"):
        gpus.add_column(col)
    for gpu in topo.gpus:
        near = sorted(
            (path_distance(gpu.pci_path, n.pci_path, gpu.numa_node, n.numa_node, topo), n.bdf, n.name)
            for n in topo.nics
        )
        hint = ", ".join(f"{name} ({class_name(key)})" for key, _, name in near[:2])
        gpus.add_row(str(gpu.index), gpu.bdf, str(gpu.numa_node), str(gpu.minor), gpu.uuid or "-", hint or "-")
    console.print(gpus)
    nics = Table(title="NICs")
    for col in ("name", "kind", "bus id", "numa", "driver", "ports", "netdevs"):
        nics.add_column(col)
    for nic in topo.nics:
        ports = ", ".join(f"{p.number}:{p.state}/{p.link_layer}" for p in nic.ports)
        nics.add_row(nic.name, nic.kind, nic.bdf, str(nic.numa_node), nic.driver, ports, ",".join(nic.netdevs))
    console.print(nics)
    console.print(
        f"allowed CPUs {format_cpulist(topo.allowed_cpus)}; "
        f"allowed memory nodes {format_cpulist(topo.allowed_mems)}"
    )
    for note in topo.notes:
        console.print(f"note: {note}")


def show_plans(plans: list[RankPlan], envs: list[dict[str, str]], console: Console) -> None:
    table = Table(title="Plan per local rank")
    for col in ("rank", "gpus", "cpus", "cores", "mem", "nics"):
        table.add_column(col)
    for plan in plans:
        table.add_row(
            str(plan.local_rank),
            ",".join(plan.gpus) or "-",
            format_cpulist(plan.cpus),
            str(plan.cores),
            f"{plan.mem_mode} {format_cpulist(plan.mem_nodes)}".strip(),
            ",".join(plan.nic_ports) or "-",
        )
    console.print(table)
    shared = {k: v for k, v in envs[0].items() if all(e.get(k) == v for e in envs)} if envs else {}
    for key in sorted(shared):
        if not key.startswith("SLURMKIT_"):
            console.print(f"{key}={shared[key]}", markup=False)
    warnings = sorted({w for p in plans for w in p.warnings})
    for warning in warnings:
        console.print(Text.assemble(("warning", "yellow"), ": ", warning))
