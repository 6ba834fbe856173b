"""Linux cpulist strings ("0-3,8,10-11"): the format of sysfs, procfs, numactl and Slurm."""

from __future__ import annotations

from collections.abc import Iterable

from slurmkit.errors import ConfigError


def parse_cpulist(text: str) -> tuple[int, ...]:
    """Parse a cpulist such as ``"0-3,8"`` into sorted unique ids; ``""`` is empty.

    Ranges with a stride (``"0-7:2"``, accepted by the kernel) are honoured too.
    """
    ids: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        try:
            ids.update(_parse_part(part))
        except ValueError as exc:
            raise ConfigError(
                detected=f"cpulist {text.strip()!r} with a bad part {part!r}",
                requirement="a list like 0-3,8,10-11",
                fix="check the file or variable that holds the list",
            ) from exc
    return tuple(sorted(ids))


def _parse_part(part: str) -> range:
    stride = 1
    if ":" in part:
        part, stride_text = part.split(":", 1)
        stride = int(stride_text.split("/")[0])
    if "-" in part:
        low, high = part.split("-", 1)
        return range(int(low), int(high) + 1, stride)
    return range(int(part), int(part) + 1)


def format_cpulist(ids: Iterable[int]) -> str:
    """Inverse of :func:`parse_cpulist`: ``[0, 1, 2, 8]`` -> ``"0-2,8"``."""
    ordered = sorted(set(ids))
    parts: list[str] = []
    start = prev = None
    for cpu in ordered:
        if start is None:
            start = prev = cpu
        elif prev is not None and cpu == prev + 1:
            prev = cpu
        else:
            parts.append(_span(start, prev))
            start = prev = cpu
    if start is not None:
        parts.append(_span(start, prev))
    return ",".join(parts)


def _span(start: int, end: int | None) -> str:
    return str(start) if end is None or end == start else f"{start}-{end}"


def normalize_bdf(bus_id: str) -> str:
    """Normalise a PCI bus id to sysfs form: ``00000000:1B:00.0`` -> ``0000:1b:00.0``.

    nvidia-smi and NVML print an 8-digit domain and upper case; sysfs uses 4 digits.
    """
    text = bus_id.strip().lower()
    parts = text.split(":")
    if len(parts) == 2:
        parts = ["0000", *parts]
    if len(parts) != 3 or "." not in parts[2]:
        raise ConfigError(
            detected=f"PCI bus id {bus_id!r}",
            requirement="a bus id like 0000:1b:00.0",
            fix="pass the id as sysfs or nvidia-smi prints it",
        )
    domain = parts[0][-4:].rjust(4, "0")
    return f"{domain}:{parts[1].rjust(2, '0')}:{parts[2]}"
