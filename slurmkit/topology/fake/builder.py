"""Write a FakeMachine as a real-layout sysfs/procfs tree (relative symlinks included)."""

from __future__ import annotations

import os

from ..cpulist import format_cpulist
from .spec import FakeIb, FakeMachine, FakePci

BRIDGE_CLASS = 0x060400


def write_tree(machine: FakeMachine, out_dir: str) -> str:
    """Create ``out_dir/sys`` and ``out_dir/proc`` for ``machine``; returns ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    _write_cpus(machine, out_dir)
    if machine.numa_in_sysfs:
        _write_nodes(machine, out_dir)
    paths = _write_pci(machine, out_dir)
    for ib in machine.ibs:
        _write_ib(ib, paths[ib.bdf], out_dir)
    for eth in machine.eths:
        _write_eth(eth.name, eth.operstate, paths.get(eth.bdf), out_dir)
    _write_proc(machine, out_dir)
    if machine.nccl_topo_xml:
        _put(os.path.join(out_dir, "nccl-topo.xml"), machine.nccl_topo_xml)
    return out_dir


def _put(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text + "\n")


def _link(link: str, target: str) -> None:
    """A relative symlink, as the kernel makes them."""
    os.makedirs(os.path.dirname(link), exist_ok=True)
    if os.path.islink(link):
        os.unlink(link)
    os.symlink(os.path.relpath(target, os.path.dirname(link)), link)


def _write_cpus(machine: FakeMachine, root: str) -> None:
    base = os.path.join(root, "sys", "devices", "system", "cpu")
    ids = [c.id for c in machine.cpus]
    online = [i for i in ids if i not in machine.offline]
    for name, cpus in (("possible", ids), ("present", ids), ("online", online)):
        _put(os.path.join(base, name), format_cpulist(cpus))
    for cpu in machine.cpus:
        cdir = os.path.join(base, f"cpu{cpu.id}")
        os.makedirs(cdir, exist_ok=True)
        if cpu.id != 0:
            _put(os.path.join(cdir, "online"), "0" if cpu.id in machine.offline else "1")
        if cpu.id in machine.offline:
            continue  # the kernel removes topology/ of an offline CPU
        tdir = os.path.join(cdir, "topology")
        package = [c.id for c in machine.cpus if c.package == cpu.package]
        _put(os.path.join(tdir, "core_id"), str(cpu.core_id))
        _put(os.path.join(tdir, "physical_package_id"), str(cpu.package))
        _put(os.path.join(tdir, "thread_siblings_list"), format_cpulist(cpu.siblings))
        _put(os.path.join(tdir, "core_siblings_list"), format_cpulist(package))


def _write_nodes(machine: FakeMachine, root: str) -> None:
    base = os.path.join(root, "sys", "devices", "system", "node")
    ids = [n.id for n in machine.nodes]
    _put(os.path.join(base, "online"), format_cpulist(ids))
    _put(os.path.join(base, "possible"), format_cpulist(ids))
    _put(os.path.join(base, "has_cpu"), format_cpulist(n.id for n in machine.nodes if n.cpus))
    _put(os.path.join(base, "has_memory"), format_cpulist(n.id for n in machine.nodes if n.mem_kb))
    for i, node in enumerate(machine.nodes):
        ndir = os.path.join(base, f"node{node.id}")
        cpus = [c for c in node.cpus if c not in machine.offline]
        _put(os.path.join(ndir, "cpulist"), format_cpulist(cpus))
        _put(os.path.join(ndir, "distance"), " ".join(str(d) for d in machine.distances[i]))
        _put(
            os.path.join(ndir, "meminfo"),
            f"Node {node.id} MemTotal:       {node.mem_kb} kB\n"
            f"Node {node.id} MemFree:        {node.mem_kb // 2} kB",
        )


def _node_cpulist(machine: FakeMachine, numa: int) -> str:
    for node in machine.nodes:
        if node.id == numa:
            return format_cpulist(node.cpus)
    return format_cpulist(c.id for c in machine.cpus)


def _write_pci(machine: FakeMachine, root: str) -> dict[str, str]:
    """Device directories under sys/devices, bridges included; bdf -> directory."""
    devices_dir = os.path.join(root, "sys", "devices")
    bus_dir = os.path.join(root, "sys", "bus", "pci")
    paths: dict[str, str] = {}
    functions: dict[str, FakePci] = {}
    for dev in machine.pci:
        for depth, bridge in enumerate(dev.chain[1:], start=1):
            functions.setdefault(
                bridge,
                FakePci(bridge, dev.chain[:depth], 0x8086, 0x1BB0, BRIDGE_CLASS, dev.numa_node, "pcieport"),
            )
        functions[dev.bdf] = dev
    for dev in functions.values():
        path = os.path.join(devices_dir, *dev.chain, dev.bdf)
        paths[dev.bdf] = path
        _put(os.path.join(path, "vendor"), f"0x{dev.vendor:04x}")
        _put(os.path.join(path, "device"), f"0x{dev.device:04x}")
        _put(os.path.join(path, "class"), f"0x{dev.pci_class:06x}")
        _put(os.path.join(path, "numa_node"), str(dev.numa_node))
        local = dev.local_cpulist
        _put(os.path.join(path, "local_cpulist"), local if local is not None else _node_cpulist(machine, dev.numa_node))
        if dev.driver:
            driver = os.path.join(bus_dir, "drivers", dev.driver)
            os.makedirs(driver, exist_ok=True)
            _link(os.path.join(path, "driver"), driver)
        _link(os.path.join(bus_dir, "devices", dev.bdf), path)
    return paths


def _write_ib(ib: FakeIb, dev_path: str, root: str) -> None:
    ib_dir = os.path.join(dev_path, "infiniband", ib.name)
    for number, port in enumerate(ib.ports, start=1):
        pdir = os.path.join(ib_dir, "ports", str(number))
        _put(os.path.join(pdir, "state"), port.state)
        _put(os.path.join(pdir, "link_layer"), port.link_layer)
        _put(os.path.join(pdir, "rate"), port.rate)
    _link(os.path.join(ib_dir, "device"), dev_path)
    _link(os.path.join(root, "sys", "class", "infiniband", ib.name), ib_dir)
    for netdev in ib.netdevs:
        _write_eth(netdev, "up", dev_path, root)


def _write_eth(name: str, operstate: str, dev_path: str | None, root: str) -> None:
    if dev_path is None:
        net_dir = os.path.join(root, "sys", "devices", "virtual", "net", name)
    else:
        net_dir = os.path.join(dev_path, "net", name)
        _link(os.path.join(net_dir, "device"), dev_path)
    _put(os.path.join(net_dir, "operstate"), operstate)
    _link(os.path.join(root, "sys", "class", "net", name), net_dir)


def _write_proc(machine: FakeMachine, root: str) -> None:
    if machine.allowed_cpus is not None:
        mems = machine.allowed_mems or format_cpulist(n.id for n in machine.nodes)
        _put(
            os.path.join(root, "proc", "self", "status"),
            f"Name:\tpython3\nCpus_allowed_list:\t{machine.allowed_cpus}\n"
            f"Mems_allowed_list:\t{mems}",
        )
    if not machine.nvidia_proc:
        return
    for gpu in machine.gpus:
        _put(
            os.path.join(root, "proc", "driver", "nvidia", "gpus", gpu.bdf, "information"),
            f"Model: \t\t {gpu.model}\nIRQ:   \t\t 0\nGPU UUID: \t {gpu.uuid}\n"
            f"Video BIOS: \t 96.00.74.00.01\nBus Type: \t PCIe\nDMA Size: \t 52 bits\n"
            f"Bus Location: \t {gpu.bdf}\nDevice Minor: \t {gpu.minor}\nGPU Excluded:\t No",
        )
