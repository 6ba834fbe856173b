"""Optional enrichment of a discovered topology: NVML (UUIDs, minors) and NCCL's topology XML.

Both are best-effort: a node without pynvml or without NCCL_TOPO_FILE is planned from sysfs.
"""

from __future__ import annotations

import dataclasses
import logging
import xml.etree.ElementTree as ET

from slurmkit.errors import ConfigError

from .cpulist import normalize_bdf
from .model import Gpu, NodeTopology

log = logging.getLogger(__name__)


def enrich_from_nvml(topo: NodeTopology) -> NodeTopology:
    """Fill in GPU UUIDs and minors that /proc/driver/nvidia did not give (containers hide it)."""
    if not topo.gpus or all(g.uuid and g.minor >= 0 for g in topo.gpus):
        return topo
    try:
        import pynvml  # optional dependency: imported lazily, absent on CPU nodes
    except ImportError:
        return topo
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        log.debug("NVML unavailable: %s", exc)
        return topo
    try:
        found = _nvml_devices(pynvml)
    finally:
        pynvml.nvmlShutdown()
    gpus = tuple(_merge_nvml(g, found.get(g.bdf)) for g in topo.gpus)
    return dataclasses.replace(topo, gpus=gpus)


def _nvml_devices(pynvml: object) -> dict[str, tuple[str, int]]:
    nv: object = pynvml
    found: dict[str, tuple[str, int]] = {}
    for i in range(nv.nvmlDeviceGetCount()):  # type: ignore[attr-defined]
        handle = nv.nvmlDeviceGetHandleByIndex(i)  # type: ignore[attr-defined]
        bus = nv.nvmlDeviceGetPciInfo(handle).busId  # type: ignore[attr-defined]
        uuid = nv.nvmlDeviceGetUUID(handle)  # type: ignore[attr-defined]
        minor = nv.nvmlDeviceGetMinorNumber(handle)  # type: ignore[attr-defined]
        bus_text = bus.decode() if isinstance(bus, bytes) else str(bus)
        uuid_text = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
        found[normalize_bdf(bus_text)] = (uuid_text, int(minor))
    return found


def _merge_nvml(gpu: Gpu, nvml: tuple[str, int] | None) -> Gpu:
    if nvml is None:
        return gpu
    return dataclasses.replace(
        gpu, uuid=gpu.uuid or nvml[0], minor=gpu.minor if gpu.minor >= 0 else nvml[1]
    )


def parse_nccl_topo_xml(text: str) -> dict[str, tuple[tuple[str, ...], int]]:
    """Map bus id -> (PCI path as NCCL describes it, NUMA id) from an NCCL topology XML.

    The path starts with a pseudo host bridge ``nccl-cpu<numaid>`` so that devices under one
    ``<cpu>`` compare as PHB and devices under different ``<cpu>`` elements as NODE/SYS.
    """
    try:
        root = ET.fromstring(text)
    except ET.ParseError as exc:
        raise ConfigError(
            detected=f"NCCL topology XML that does not parse ({exc})",
            requirement="the XML file NCCL_TOPO_FILE names (e.g. Azure's ndv4-topo.xml)",
            fix="fix or unset NCCL_TOPO_FILE",
        ) from exc
    found: dict[str, tuple[tuple[str, ...], int]] = {}
    for cpu in root.iter("cpu"):
        numa = int(cpu.get("numaid", "-1"))
        _walk(cpu, (f"nccl-cpu{numa}",), numa, found)
    return found


def _walk(
    elem: ET.Element, path: tuple[str, ...], numa: int, found: dict[str, tuple[tuple[str, ...], int]]
) -> None:
    for child in elem:
        if child.tag != "pci" or not child.get("busid"):
            continue
        bdf = normalize_bdf(child.get("busid", ""))
        child_path = (*path, bdf)
        found[bdf] = (child_path, numa)
        _walk(child, child_path, numa, found)


def enrich_from_nccl_xml(topo: NodeTopology, path: str) -> NodeTopology:
    """Replace the PCI paths (and unknown NUMA nodes) of the GPUs and NICs the XML lists."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ConfigError(
            detected=f"NCCL_TOPO_FILE={path} cannot be read ({exc.strerror})",
            requirement="a readable NCCL topology XML",
            fix="point NCCL_TOPO_FILE at the file or unset it",
        ) from exc
    xml = parse_nccl_topo_xml(text)

    def numa_of(current: int, bdf: str) -> int:
        return current if current >= 0 else xml[bdf][1]

    gpus = tuple(
        dataclasses.replace(g, pci_path=xml[g.bdf][0], numa_node=numa_of(g.numa_node, g.bdf))
        if g.bdf in xml
        else g
        for g in topo.gpus
    )
    nics = tuple(
        dataclasses.replace(n, pci_path=xml[n.bdf][0], numa_node=numa_of(n.numa_node, n.bdf))
        if n.bdf in xml
        else n
        for n in topo.nics
    )
    note = f"GPU/NIC PCI paths from NCCL topology XML {path}"
    return dataclasses.replace(topo, gpus=gpus, nics=nics, notes=(*topo.notes, note))
