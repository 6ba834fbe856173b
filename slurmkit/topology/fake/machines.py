"""Fake machines built from the public facts in shared/reference/topologies.md.

Each function returns a FakeMachine; ``MACHINES`` maps the names the CLI accepts to them.
"""

from __future__ import annotations

from collections.abc import Callable

from .spec import (
    FakeEth,
    FakeGpu,
    FakeIb,
    FakeMachine,
    FakePci,
    FakePort,
    nodes_by_range,
    smt_cpus,
    socket_distances,
)

NVIDIA, MELLANOX, INTEL = 0x10DE, 0x15B3, 0x8086
GPU_CLASS, IB_CLASS, ETH_CLASS, NVSWITCH_CLASS = 0x030200, 0x020700, 0x020000, 0x068000
TIB_KB = 1024**3  # 1 TiB of memory per node, in kB


def bdf(bus: int, dev: int = 0, fn: int = 0) -> str:
    return f"0000:{bus:02x}:{dev:02x}.{fn}"


def switch_port(root: int, port: int) -> tuple[str, ...]:
    """Chain down to downstream port ``port`` of a PCIe switch behind root port root:01.0."""
    return (f"pci0000:{root:02x}", bdf(root, 1), bdf(root + 1), bdf(root + 2, port))


def root_port(root: int) -> tuple[str, ...]:
    """Chain for a device directly behind root port root:01.0 (no switch)."""
    return (f"pci0000:{root:02x}", bdf(root, 1))


def gpu(bus: int, chain: tuple[str, ...], numa: int, index: int, model: str) -> tuple[FakePci, FakeGpu]:
    dev = FakePci(bdf(bus), chain, NVIDIA, 0x2330, GPU_CLASS, numa, "nvidia")
    uuid = f"GPU-{index:08x}-5e1f-4c2a-9b3d-{bus:012x}"
    return dev, FakeGpu(bdf(bus), uuid, index, model)


def ib(name: str, address: str, chain: tuple[str, ...], numa: int, **kw: object) -> tuple[FakePci, FakeIb]:
    dev = FakePci(address, chain, MELLANOX, 0x1021, IB_CLASS, numa, "mlx5_core")
    return dev, FakeIb(name, address, **kw)  # type: ignore[arg-type]


def _assemble(name: str, base: dict[str, object], parts: list[tuple[FakePci, object]]) -> FakeMachine:
    pci = tuple(p for p, _ in parts)
    gpus = tuple(x for _, x in parts if isinstance(x, FakeGpu))
    ibs = tuple(x for _, x in parts if isinstance(x, FakeIb))
    extra: tuple[FakePci, ...] = base.pop("pci", ())  # type: ignore[assignment]
    return FakeMachine(name=name, pci=(*pci, *extra), gpus=gpus, ibs=ibs, **base)  # type: ignore[arg-type]


def _h100_base() -> dict[str, object]:
    cpus = smt_cpus(sockets=2, cores_per_socket=56, threads=2)
    nvswitches = tuple(
        FakePci(bdf(0x05 + i), ("pci0000:00", bdf(0, 1, 1)), NVIDIA, 0x22A3, NVSWITCH_CLASS, 0, "nvidia")
        for i in range(4)
    )
    mgmt = FakePci(bdf(0x0A), ("pci0000:00", bdf(0, 2)), INTEL, 0x1533, ETH_CLASS, 0, "igb")
    return {
        "cpus": cpus,
        "nodes": nodes_by_range(cpus, 56, 2, TIB_KB),
        "distances": socket_distances(2, 1, 10, 21),
        "eths": (FakeEth("lo"), FakeEth("eno3", mgmt.bdf)),
        "pci": (*nvswitches, mgmt),
        "allowed_cpus": "0-223",
        "allowed_mems": "0-1",
    }


def _storage_card(names: tuple[str, str], bus: int, root: int, numa: int) -> list[tuple[FakePci, object]]:
    port = FakePort("4: ACTIVE", "Ethernet", "200 Gb/sec (2X NDR)")
    return [
        ib(names[fn], bdf(bus, 0, fn), root_port(root), numa, ports=(port,), netdevs=(f"enp{bus}s0f{fn}np{fn}",))
        for fn in (0, 1)
    ]


def dgx_h100() -> FakeMachine:
    """2 x 56-core Xeon with SMT, 8 H100, 8 compute CX-7 + 2 dual-port storage cards."""
    pairs = [  # (GPU bus, NIC bus, NIC name, root bus, NUMA)
        (0x1B, 0x18, "mlx5_0", 0x15, 0), (0x43, 0x40, "mlx5_3", 0x3D, 0),
        (0x52, 0x4F, "mlx5_4", 0x4B, 0), (0x61, 0x5E, "mlx5_5", 0x5A, 0),
        (0x9D, 0x9A, "mlx5_6", 0x97, 1), (0xC3, 0xC0, "mlx5_9", 0xBD, 1),
        (0xD1, 0xCE, "mlx5_10", 0xCA, 1), (0xDF, 0xDC, "mlx5_11", 0xD8, 1),
    ]
    parts: list[tuple[FakePci, object]] = []
    for i, (gbus, nbus, name, root, numa) in enumerate(pairs):
        parts.append(gpu(gbus, switch_port(root, 1), numa, i, "NVIDIA H100 80GB HBM3"))
        parts.append(ib(name, bdf(nbus), switch_port(root, 0), numa, netdevs=(f"ibp{nbus}s0",)))
    parts += _storage_card(("mlx5_1", "mlx5_2"), 0x29, 0x25, 0)
    parts += _storage_card(("mlx5_7", "mlx5_8"), 0xAA, 0xA8, 1)
    return _assemble("dgx_h100", _h100_base(), parts)


def dgx_a100() -> FakeMachine:
    """2 x 64-core EPYC, NPS4 (8 NUMA nodes), 8 A100 on NUMA 3, 1, 7, 5; 8 compute HCAs."""
    cpus = smt_cpus(sockets=2, cores_per_socket=64, threads=2)
    quads = [  # (root bus, NUMA, GPU buses, (NIC bus, name) pairs)
        (0x00, 3, (0x07, 0x0F), ((0x0C, "mlx5_0"), (0x12, "mlx5_1"))),
        (0x40, 1, (0x47, 0x4E), ((0x4B, "mlx5_2"), (0x54, "mlx5_3"))),
        (0x80, 7, (0x87, 0x90), ((0x8D, "mlx5_6"), (0x94, "mlx5_7"))),
        (0xB0, 5, (0xB7, 0xBD), ((0xBA, "mlx5_8"), (0xCC, "mlx5_9"))),
    ]
    parts: list[tuple[FakePci, object]] = []
    index = 0
    for root, numa, gbuses, nics in quads:
        for k, gbus in enumerate(gbuses):
            parts.append(gpu(gbus, switch_port(root, 2 * k), numa, index, "NVIDIA A100-SXM4-80GB"))
            index += 1
        for k, (nbus, name) in enumerate(nics):
            parts.append(ib(name, bdf(nbus), switch_port(root, 2 * k + 1), numa, netdevs=(f"ibp{nbus}s0",)))
    parts += _storage_card(("mlx5_4", "mlx5_5"), 0x61, 0x60, 0)
    base: dict[str, object] = {
        "cpus": cpus,
        "nodes": nodes_by_range(cpus, 16, 8, TIB_KB // 4),
        "distances": socket_distances(8, 4, 12, 32),
        "eths": (FakeEth("lo"),),
        "allowed_cpus": "0-255",
        "allowed_mems": "0-7",
    }
    return _assemble("dgx_a100", base, parts)


def awkward_reverse() -> FakeMachine:
    """Layout (a): NICs numbered in reverse of GPU order, GPU and NIC behind one bridge (PIX)."""
    base = _h100_base()
    base["pci"] = ()
    base["eths"] = (FakeEth("lo"),)
    pix = [  # (GPU bus, NIC bus, NIC name, root, NUMA)
        (0x1B, 0x1C, "mlx5_3", 0x15, 0), (0x43, 0x44, "mlx5_2", 0x3D, 0),
        (0x52, 0x53, "mlx5_1", 0x4B, 0), (0x61, 0x62, "mlx5_0", 0x5A, 0),
        (0x9D, 0x9E, "mlx5_5", 0x97, 1), (0xC3, 0xC4, "mlx5_4", 0xBD, 1),
    ]
    parts: list[tuple[FakePci, object]] = []
    for i, (gbus, nbus, name, root, numa) in enumerate(pix):
        chain = (f"pci0000:{root:02x}", bdf(root, 1), bdf(root + 1))
        parts.append(gpu(gbus, chain, numa, i, "NVIDIA H100 80GB HBM3"))
        parts.append(ib(name, bdf(nbus), chain, numa))
    parts.append(gpu(0xD1, switch_port(0xCA, 0), 1, 6, "NVIDIA H100 80GB HBM3"))
    parts.append(gpu(0xDF, switch_port(0xD8, 0), 1, 7, "NVIDIA H100 80GB HBM3"))
    for nbus, name, root in ((0xA5, "mlx5_9", 0xA3), (0xB0, "mlx5_8", 0xAE), (0xE8, "mlx5_7", 0xE6), (0xF0, "mlx5_6", 0xEE)):
        parts.append(ib(name, bdf(nbus), root_port(root), 1))
    return _assemble("awkward_reverse", base, parts)


def awkward_nps4() -> FakeMachine:
    """Layout (b): AMD NPS4, two GPUs per NIC, NIC names not in PCI order."""
    cpus = smt_cpus(sockets=2, cores_per_socket=32, threads=2)
    quads = [  # (root, NUMA, GPU buses, NIC bus, NIC name)
        (0x00, 3, (0x05, 0x06), 0x07, "mlx5_1"),
        (0x40, 1, (0x45, 0x46), 0x47, "mlx5_0"),
        (0x80, 7, (0x85, 0x86), 0x87, "mlx5_5"),
        (0xC0, 5, (0xC5, 0xC6), 0xC7, "mlx5_2"),
    ]
    parts: list[tuple[FakePci, object]] = []
    index = 0
    for root, numa, gbuses, nbus, name in quads:
        for k, gbus in enumerate(gbuses):
            parts.append(gpu(gbus, switch_port(root, k), numa, index, "AMD-host H100"))
            index += 1
        parts.append(ib(name, bdf(nbus), switch_port(root, 2), numa))
    parts.append(ib("mlx5_3", bdf(0x25), root_port(0x20), 0))
    parts.append(ib("mlx5_4", bdf(0x65), root_port(0x60), 2))
    base: dict[str, object] = {
        "cpus": cpus,
        "nodes": nodes_by_range(cpus, 8, 8, TIB_KB // 4),
        "distances": socket_distances(8, 4, 12, 32),
        "eths": (FakeEth("lo"),),
        "allowed_cpus": "0-127",
        "allowed_mems": "0-7",
    }
    return _assemble("awkward_nps4", base, parts)


def cpu_only() -> FakeMachine:
    """A 2-socket CPU node without GPUs or RDMA (like the local Slurm cluster, but bigger)."""
    cpus = smt_cpus(sockets=2, cores_per_socket=8, threads=2)
    return FakeMachine(
        name="cpu_only",
        cpus=cpus,
        nodes=nodes_by_range(cpus, 8, 2, TIB_KB // 8),
        distances=socket_distances(2, 1, 10, 21),
        eths=(FakeEth("lo"),),
        allowed_cpus="0-31",
        allowed_mems="0-1",
    )


def _flat_vm_xml(groups: list[tuple[tuple[int, int], tuple[int, int]]]) -> str:
    lines = ['<system version="1">']
    for numa, (gpu_domains, nic_domains) in enumerate(groups):
        mask = ((1 << 24) - 1) << (24 * numa)
        lines.append(
            f'  <cpu numaid="{numa}" affinity="{mask:024x}" arch="x86_64" vendor="AuthenticAMD">'
        )
        lines.append(f'    <pci busid="ffff:ff:{numa + 1:02x}.0" class="0x060400" link_width="16">')
        for dom in gpu_domains:
            lines.append(f'      <pci busid="{dom:04x}:00:00.0" class="0x030200" link_width="16"/>')
        for dom in nic_domains:
            lines.append(f'      <pci busid="{dom:04x}:00:00.0" class="0x020700" link_width="16">')
            lines.append(f'        <nic><net name="mlx5_{dom - 0x101}" dev="{dom - 0x101}"/></nic>')
            lines.append("      </pci>")
        lines.append("    </pci>")
        lines.append("  </cpu>")
    lines.append("</system>")
    return "\n".join(lines)


def flat_vm() -> FakeMachine:
    """A VM like Azure NDv4: every device on its own PCI domain (flat tree), numa_node -1.

    Only NCCL's topology XML (written to <root>/nccl-topo.xml) knows that each NUMA node's
    virtual switch holds two GPUs and two NICs; here the NIC domains are deliberately not in
    GPU order, so pairing by PCI order alone would be wrong.
    """
    cpus = smt_cpus(sockets=2, cores_per_socket=48, threads=1)
    groups = [((0x1, 0x2), (0x105, 0x106)), ((0x3, 0x4), (0x107, 0x108)),
              ((0x5, 0x6), (0x101, 0x102)), ((0x7, 0x8), (0x103, 0x104))]
    parts: list[tuple[FakePci, object]] = []
    for index in range(8):
        dom = index + 1
        address = f"{dom:04x}:00:00.0"
        dev = FakePci(address, (f"pci{dom:04x}:00",), NVIDIA, 0x20B0, GPU_CLASS, -1, "nvidia")
        parts.append((dev, FakeGpu(address, f"GPU-{index:08x}-0000-0000-0000-00000000000{index}", index, "NVIDIA A100-SXM4-40GB")))
    for k in range(8):
        dom = 0x101 + k
        address = f"{dom:04x}:00:00.0"
        parts.append(ib(f"mlx5_{k}", address, (f"pci{dom:04x}:00",), -1, ports=(FakePort("4: ACTIVE", "InfiniBand", "200 Gb/sec (4X HDR)"),)))
    base: dict[str, object] = {
        "cpus": cpus,
        "nodes": nodes_by_range(cpus, 24, 4, TIB_KB // 4),
        "distances": socket_distances(4, 2, 12, 32),
        "eths": (FakeEth("lo"),),
        "allowed_cpus": "0-95",
        "allowed_mems": "0-3",
        "nccl_topo_xml": _flat_vm_xml(groups),
    }
    return _assemble("flat_vm", base, parts)


MACHINES: dict[str, Callable[[], FakeMachine]] = {
    "dgx_h100": dgx_h100,
    "dgx_a100": dgx_a100,
    "awkward_reverse": awkward_reverse,
    "awkward_nps4": awkward_nps4,
    "cpu_only": cpu_only,
    "flat_vm": flat_vm,
}
