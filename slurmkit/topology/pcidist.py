"""How far two PCI devices are apart, in NCCL's classes, from their ancestor chains."""

from __future__ import annotations

from enum import IntEnum

from .model import NodeTopology


class PathClass(IntEnum):
    """Closest first, as NCCL and `nvidia-smi topo -m` name them."""

    PIX = 0  # at most one PCIe bridge between the two
    PXB = 1  # several bridges, without crossing a host bridge
    PHB = 2  # through the same host bridge (root complex)
    NODE = 3  # different host bridges of the same NUMA node
    SYS = 4  # across NUMA nodes / sockets


def path_distance(
    a: tuple[str, ...], b: tuple[str, ...], numa_a: int, numa_b: int, topo: NodeTopology
) -> tuple[int, int, int]:
    """Sort key, smaller is closer: (class, bridges crossed, NUMA distance).

    Paths are the sysfs chains below /sys/devices, host bridge first, the device itself last.
    """
    common = 0
    for x, y in zip(a[:-1], b[:-1]):
        if x != y:
            break
        common += 1
    numa_dist = topo.distance(numa_a, numa_b) if numa_a >= 0 and numa_b >= 0 else 20
    if common == 0:
        same_node = numa_a == numa_b and numa_a >= 0
        return (int(PathClass.NODE if same_node else PathClass.SYS), 0, numa_dist)
    if common == 1:
        return (int(PathClass.PHB), 0, numa_dist)
    # Bridges on the way: the common ancestor, and each side's bridges below it.
    bridges = 1 + (len(a) - 1 - common) + (len(b) - 1 - common)
    klass = PathClass.PIX if bridges <= 1 else PathClass.PXB
    return (int(klass), bridges, numa_dist)


def class_name(key: tuple[int, int, int]) -> str:
    return PathClass(key[0]).name
