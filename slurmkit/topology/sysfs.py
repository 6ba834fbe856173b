"""Read-only access to a sysfs/procfs tree under an injectable root.

Discovery never touches ``/sys`` or ``/proc`` directly: tests point the reader at a fake tree,
and may inject a ``listdir`` that shuffles entries to prove that nothing depends on the order
the kernel (or a file system) lists a directory in.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable

ListDir = Callable[[str], list[str]]

_NATURAL = re.compile(r"(\d+)")


def natural_key(name: str) -> tuple[object, ...]:
    """Sort key so that cpu2 < cpu10 and mlx5_2 < mlx5_10."""
    return tuple(int(p) if p.isdigit() else p for p in _NATURAL.split(name))


class Tree:
    """Files of one machine: ``sys`` under ``sysfs_root/sys``, ``proc`` under ``proc_root``."""

    def __init__(self, sysfs_root: str, proc_root: str, listdir: ListDir = os.listdir) -> None:
        self.sysfs_root = os.path.abspath(sysfs_root)
        self.proc_root = os.path.abspath(proc_root)
        self._listdir = listdir

    def sys(self, *parts: str) -> str:
        return os.path.join(self.sysfs_root, "sys", *parts)

    def proc(self, *parts: str) -> str:
        return os.path.join(self.proc_root, *parts)

    def read(self, path: str) -> str | None:
        """The file's text stripped, or None when it is missing or unreadable."""
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                return f.read().strip()
        except OSError:
            # Missing attributes are normal in sysfs (offline CPUs, virtual devices).
            return None

    def read_int(self, path: str, default: int, base: int = 10) -> int:
        text = self.read(path)
        if text is None:
            return default
        try:
            return int(text, base)
        except ValueError:
            return default

    def listdir(self, path: str) -> list[str]:
        """Entries of a directory in natural order, [] when it does not exist."""
        try:
            names = list(self._listdir(path))
        except OSError:
            return []
        return sorted(names, key=natural_key)

    def isdir(self, path: str) -> bool:
        return os.path.isdir(path)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def link_name(self, path: str) -> str:
        """Basename of a symlink's target (a driver's name), "" when there is no link."""
        try:
            return os.path.basename(os.readlink(path))
        except OSError:
            return ""

    def devices_chain(self, path: str) -> tuple[str, ...]:
        """Components of ``realpath(path)`` below ``sys/devices``: the PCI ancestor chain."""
        real = os.path.realpath(path)
        base = os.path.realpath(self.sys("devices"))
        rel = os.path.relpath(real, base)
        if rel.startswith(".."):
            return (os.path.basename(real),)
        return tuple(p for p in rel.split(os.sep) if p and p != ".")
