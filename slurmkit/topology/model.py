"""The discovered node: immutable dataclasses (tuples only), built once per node by discovery.

Everything the planner needs is here, so planning is a pure function of this value.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Cpu:
    """One logical CPU (hardware thread) as the kernel numbers it."""

    id: int
    core_id: int
    package_id: int
    # Every hardware thread of the same physical core, this one included (sysfs thread_siblings).
    siblings: tuple[int, ...]
    online: bool
    node: int  # NUMA node; 0 on a kernel without NUMA


@dataclass(frozen=True)
class NumaNode:
    id: int
    cpus: tuple[int, ...]
    mem_total_kb: int
    # distances[i] is the SLIT distance to the i-th entry of NodeTopology.nodes (10 = local).
    distances: tuple[int, ...]

    @property
    def has_cpus(self) -> bool:
        return bool(self.cpus)

    @property
    def has_memory(self) -> bool:
        return self.mem_total_kb > 0


@dataclass(frozen=True)
class PciDevice:
    bdf: str  # sysfs form, 0000:1b:00.0
    # Ancestor chain from the host bridge down to this device, itself last:
    # ("pci0000:15", "0000:15:01.0", "0000:16:00.0", ..., "0000:1b:00.0").
    path: tuple[str, ...]
    vendor: int
    device: int
    pci_class: int  # 24-bit class code, 0x030200 = 3D controller
    numa_node: int  # -1 when the firmware does not say
    local_cpus: tuple[int, ...]
    driver: str


@dataclass(frozen=True)
class Gpu:
    index: int  # position in PCI bus order = CUDA index under CUDA_DEVICE_ORDER=PCI_BUS_ID
    bdf: str
    uuid: str  # "" when neither the driver nor NVML told us
    minor: int  # /dev/nvidia<minor>; -1 when unknown
    numa_node: int  # -1 when unknown even after using local_cpulist
    pci_path: tuple[str, ...]
    model: str = ""


@dataclass(frozen=True)
class NicPort:
    number: int
    state: str  # "ACTIVE", "DOWN", ... (the text after "4: " in sysfs); "UP"/"DOWN" for Ethernet
    link_layer: str  # "InfiniBand", "Ethernet"
    rate: str = ""

    @property
    def active(self) -> bool:
        return self.state.upper() in ("ACTIVE", "UP")


@dataclass(frozen=True)
class Nic:
    name: str  # mlx5_0 for RDMA devices, the interface name for plain Ethernet
    kind: str  # "rdma" or "eth"
    bdf: str
    pci_path: tuple[str, ...]
    numa_node: int
    driver: str
    ports: tuple[NicPort, ...]
    netdevs: tuple[str, ...] = ()

    @property
    def active_ports(self) -> tuple[NicPort, ...]:
        return tuple(p for p in self.ports if p.active)


@dataclass(frozen=True)
class NodeTopology:
    cpus: tuple[Cpu, ...]
    nodes: tuple[NumaNode, ...]
    gpus: tuple[Gpu, ...]
    nics: tuple[Nic, ...]
    allowed_cpus: tuple[int, ...]  # this task's Cpus_allowed_list, restricted to online CPUs
    allowed_mems: tuple[int, ...]  # Mems_allowed_list
    pci: tuple[PciDevice, ...] = ()
    notes: tuple[str, ...] = ()  # what discovery had to guess, for `topo show`

    @property
    def online_cpus(self) -> tuple[int, ...]:
        return tuple(c.id for c in self.cpus if c.online)

    def node(self, node_id: int) -> NumaNode | None:
        for node in self.nodes:
            if node.id == node_id:
                return node
        return None

    def distance(self, a: int, b: int) -> int:
        """SLIT distance between two NUMA nodes; 10 local, 20 when the table is missing."""
        if a == b:
            return 10
        ids = [n.id for n in self.nodes]
        node = self.node(a)
        if node is None or b not in ids or len(node.distances) != len(ids):
            return 20
        return node.distances[ids.index(b)]

    def cpu(self, cpu_id: int) -> Cpu | None:
        for cpu in self.cpus:
            if cpu.id == cpu_id:
                return cpu
        return None
