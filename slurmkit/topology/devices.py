"""Discovery of PCI devices, NVIDIA GPUs and network adapters (RDMA and Ethernet) from sysfs."""

from __future__ import annotations

import os
from collections import Counter

from .cpulist import normalize_bdf, parse_cpulist
from .model import Gpu, Nic, NicPort, NumaNode, PciDevice
from .sysfs import Tree

NVIDIA_VENDOR = 0x10DE
# 0x0302xx: 3D controller (data-centre GPUs), 0x0300xx: VGA controller (workstation GPUs).
GPU_CLASSES = (0x0302, 0x0300)


def discover_pci(tree: Tree) -> tuple[PciDevice, ...]:
    base = tree.sys("bus", "pci", "devices")
    devices = []
    for name in tree.listdir(base):
        path = os.path.join(base, name)
        devices.append(
            PciDevice(
                bdf=normalize_bdf(name),
                path=tree.devices_chain(path),
                vendor=tree.read_int(os.path.join(path, "vendor"), 0, 16),
                device=tree.read_int(os.path.join(path, "device"), 0, 16),
                pci_class=tree.read_int(os.path.join(path, "class"), 0, 16),
                numa_node=tree.read_int(os.path.join(path, "numa_node"), -1),
                local_cpus=parse_cpulist(tree.read(os.path.join(path, "local_cpulist")) or ""),
                driver=tree.link_name(os.path.join(path, "driver")),
            )
        )
    return tuple(sorted(devices, key=lambda d: d.bdf))


def device_numa(dev: PciDevice | None, nodes: tuple[NumaNode, ...], single: int | None) -> int:
    """The device's NUMA node; guessed from local_cpulist when numa_node is -1."""
    if dev is None:
        return single if single is not None else -1
    if dev.numa_node >= 0:
        return dev.numa_node
    if single is not None:
        return single
    local = set(dev.local_cpus)
    # Only trust local_cpulist when it names exactly one node's CPUs (a BIOS that does not
    # know the affinity lists every CPU).
    matches = [n.id for n in nodes if n.cpus and set(n.cpus) == local]
    return matches[0] if len(matches) == 1 else -1


def _nvidia_proc_info(tree: Tree) -> dict[str, dict[str, str]]:
    base = tree.proc("driver", "nvidia", "gpus")
    info: dict[str, dict[str, str]] = {}
    for name in tree.listdir(base):
        text = tree.read(os.path.join(base, name, "information")) or ""
        fields = {}
        for line in text.splitlines():
            key, sep, value = line.partition(":")
            if sep:
                fields[key.strip()] = value.strip()
        bdf = normalize_bdf(fields.get("Bus Location", name))
        info[bdf] = fields
    return info


def discover_gpus(
    tree: Tree, pci: tuple[PciDevice, ...], nodes: tuple[NumaNode, ...], single: int | None
) -> tuple[Gpu, ...]:
    """NVIDIA GPUs from /proc/driver/nvidia, plus any NVIDIA display/3D PCI function."""
    by_bdf = {d.bdf: d for d in pci}
    info = _nvidia_proc_info(tree)
    bdfs = set(info)
    for dev in pci:
        if dev.vendor == NVIDIA_VENDOR and (dev.pci_class >> 8) in GPU_CLASSES:
            bdfs.add(dev.bdf)
    gpus = []
    for index, bdf in enumerate(sorted(bdfs)):
        fields = info.get(bdf, {})
        found = by_bdf.get(bdf)
        minor_text = fields.get("Device Minor", "")
        gpus.append(
            Gpu(
                index=index,
                bdf=bdf,
                uuid=fields.get("GPU UUID", ""),
                minor=int(minor_text) if minor_text.isdigit() else -1,
                numa_node=device_numa(found, nodes, single),
                pci_path=found.path if found else (bdf,),
                model=fields.get("Model", ""),
            )
        )
    return tuple(gpus)


def discover_nics(
    tree: Tree, pci: tuple[PciDevice, ...], nodes: tuple[NumaNode, ...], single: int | None
) -> tuple[Nic, ...]:
    by_bdf = {d.bdf: d for d in pci}
    rdma = _discover_rdma(tree, by_bdf, nodes, single)
    taken = Counter(n.bdf for n in rdma)
    eth = [n for n in _discover_eth(tree, by_bdf, nodes, single) if n.bdf not in taken]
    return tuple(sorted([*rdma, *eth], key=lambda n: (n.bdf, n.name)))


def _discover_rdma(
    tree: Tree, by_bdf: dict[str, PciDevice], nodes: tuple[NumaNode, ...], single: int | None
) -> list[Nic]:
    base = tree.sys("class", "infiniband")
    nics = []
    for name in tree.listdir(base):
        dev_link = os.path.join(base, name, "device")
        if not tree.exists(dev_link):
            continue  # a software RDMA device (rxe) has no PCI function to be near
        bdf = normalize_bdf(os.path.basename(os.path.realpath(dev_link)))
        dev = by_bdf.get(bdf)
        ports = []
        ports_dir = os.path.join(base, name, "ports")
        for port in tree.listdir(ports_dir):
            if not port.isdigit():
                continue
            pdir = os.path.join(ports_dir, port)
            state = tree.read(os.path.join(pdir, "state")) or "UNKNOWN"
            ports.append(
                NicPort(
                    number=int(port),
                    # sysfs says "4: ACTIVE"; keep the word.
                    state=state.split(":", 1)[-1].strip(),
                    link_layer=tree.read(os.path.join(pdir, "link_layer")) or "",
                    rate=tree.read(os.path.join(pdir, "rate")) or "",
                )
            )
        nics.append(
            Nic(
                name=name,
                kind="rdma",
                bdf=bdf,
                pci_path=dev.path if dev else tree.devices_chain(dev_link),
                numa_node=device_numa(dev, nodes, single),
                driver=tree.link_name(os.path.join(dev_link, "driver")),
                ports=tuple(ports),
                netdevs=tuple(tree.listdir(os.path.join(dev_link, "net"))),
            )
        )
    return nics


def _discover_eth(
    tree: Tree, by_bdf: dict[str, PciDevice], nodes: tuple[NumaNode, ...], single: int | None
) -> list[Nic]:
    base = tree.sys("class", "net")
    nics = []
    for name in tree.listdir(base):
        dev_link = os.path.join(base, name, "device")
        if not tree.exists(dev_link):
            continue  # lo, bridges, veths: not a physical adapter
        bdf_name = os.path.basename(os.path.realpath(dev_link))
        if bdf_name.count(":") != 2:
            continue  # a virtio or platform device that is not a PCI function
        bdf = normalize_bdf(bdf_name)
        dev = by_bdf.get(bdf)
        state = (tree.read(os.path.join(base, name, "operstate")) or "unknown").upper()
        nics.append(
            Nic(
                name=name,
                kind="eth",
                bdf=bdf,
                pci_path=dev.path if dev else (bdf,),
                numa_node=device_numa(dev, nodes, single),
                driver=tree.link_name(os.path.join(dev_link, "driver")),
                ports=(NicPort(1, state, "Ethernet"),),
                netdevs=(name,),
            )
        )
    return nics
