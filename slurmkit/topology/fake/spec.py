"""Declarative description of a fake machine, from which builder.py writes sysfs/procfs."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class FakeCpu:
    id: int
    package: int
    core_id: int
    siblings: tuple[int, ...]


@dataclass(frozen=True)
class FakeNode:
    id: int
    cpus: tuple[int, ...]
    mem_kb: int


@dataclass(frozen=True)
class FakePci:
    """A PCI function below ``chain`` (host bridge "pci0000:15" first, then bridges)."""

    bdf: str
    chain: tuple[str, ...]
    vendor: int
    device: int
    pci_class: int
    numa_node: int
    driver: str = ""
    local_cpulist: str | None = None  # None = the CPUs of numa_node (all CPUs for -1)


@dataclass(frozen=True)
class FakeGpu:
    bdf: str
    uuid: str
    minor: int
    model: str = "NVIDIA H100 80GB HBM3"


@dataclass(frozen=True)
class FakePort:
    state: str = "4: ACTIVE"
    link_layer: str = "InfiniBand"
    rate: str = "400 Gb/sec (4X NDR)"


@dataclass(frozen=True)
class FakeIb:
    name: str
    bdf: str
    ports: tuple[FakePort, ...] = (FakePort(),)
    netdevs: tuple[str, ...] = ()


@dataclass(frozen=True)
class FakeEth:
    name: str
    bdf: str = ""  # "" = a virtual interface (lo, bridges)
    operstate: str = "up"


@dataclass(frozen=True)
class FakeMachine:
    name: str
    cpus: tuple[FakeCpu, ...]
    nodes: tuple[FakeNode, ...]
    distances: tuple[tuple[int, ...], ...]
    pci: tuple[FakePci, ...] = ()
    gpus: tuple[FakeGpu, ...] = ()
    ibs: tuple[FakeIb, ...] = ()
    eths: tuple[FakeEth, ...] = ()
    offline: frozenset[int] = field(default_factory=frozenset)
    nvidia_proc: bool = True  # write /proc/driver/nvidia/gpus/<bdf>/information
    allowed_cpus: str | None = None  # proc/self/status Cpus_allowed_list; None = no status file
    allowed_mems: str | None = None
    numa_in_sysfs: bool = True  # False: a kernel without NUMA (no sys/devices/system/node)
    nccl_topo_xml: str = ""  # written as <root>/nccl-topo.xml when set (cloud VMs)


def smt_cpus(sockets: int, cores_per_socket: int, threads: int) -> tuple[FakeCpu, ...]:
    """Linux numbering on x86: first thread of every core, then the second threads, and so on."""
    total = sockets * cores_per_socket
    cpus = []
    for t in range(threads):
        for c in range(total):
            siblings = tuple(c + k * total for k in range(threads))
            cpus.append(FakeCpu(c + t * total, c // cores_per_socket, c % cores_per_socket, siblings))
    return tuple(cpus)


def nodes_by_range(
    cpus: tuple[FakeCpu, ...], cores_per_node: int, n_nodes: int, mem_kb: int
) -> tuple[FakeNode, ...]:
    """NUMA node n = physical cores [n*k, (n+1)*k) with all their hardware threads."""
    out = []
    for n in range(n_nodes):
        ids = tuple(
            sorted(
                c.id
                for c in cpus
                if n * cores_per_node <= _phys(c) < (n + 1) * cores_per_node
            )
        )
        out.append(FakeNode(n, ids, mem_kb))
    return tuple(out)


def _phys(cpu: FakeCpu) -> int:
    return cpu.siblings[0]


def socket_distances(n_nodes: int, per_socket: int, near: int, far: int) -> tuple[tuple[int, ...], ...]:
    return tuple(
        tuple(10 if a == b else (near if a // per_socket == b // per_socket else far) for b in range(n_nodes))
        for a in range(n_nodes)
    )
