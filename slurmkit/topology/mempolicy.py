"""set_mempolicy/get_mempolicy through ctypes: glibc has no wrapper and libnuma may be absent."""

from __future__ import annotations

import ctypes
import os
import platform

from slurmkit.errors import SlurmkitError

MPOL = {"none": 0, "preferred": 1, "bind": 2, "interleave": 3}
MPOL_NAMES = {v: k for k, v in MPOL.items()}
# Syscall numbers per architecture (asm/unistd_64.h); they differ between x86_64 and arm64.
_SYSCALLS = {
    "x86_64": (238, 239),
    "aarch64": (237, 236),
    "ppc64le": (261, 260),
}
_MAX_NODES = 1024  # bits in the node mask we pass; the kernel ignores bits beyond its nodes
_WORD_BITS = ctypes.sizeof(ctypes.c_ulong) * 8


class MemPolicyError(SlurmkitError):
    """The kernel refused (or this platform lacks) the memory-policy syscall."""


def _numbers() -> tuple[int, int]:
    machine = platform.machine()
    if machine not in _SYSCALLS:
        raise MemPolicyError(f"no set_mempolicy syscall number known for {machine}")
    return _SYSCALLS[machine]


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def set_mempolicy(mode: str, nodes: tuple[int, ...]) -> None:
    """Set this thread's NUMA memory policy (inherited across fork and exec)."""
    words = (ctypes.c_ulong * (_MAX_NODES // _WORD_BITS))()
    for node in nodes:
        words[node // _WORD_BITS] |= 1 << (node % _WORD_BITS)
    mask = None if mode == "none" else words
    # maxnode + 1: the kernel reads maxnode - 1 bits (a historical off-by-one).
    maxnode = 0 if mask is None else _MAX_NODES + 1
    rc = _libc().syscall(_numbers()[0], MPOL[mode], mask, ctypes.c_ulong(maxnode))
    if rc != 0:
        err = ctypes.get_errno()
        raise MemPolicyError(f"set_mempolicy({mode}, {list(nodes)}) failed: {os.strerror(err)}")


def get_mempolicy() -> tuple[str, tuple[int, ...]]:
    """This thread's memory policy as (mode name, nodes)."""
    mode = ctypes.c_int(0)
    words = (ctypes.c_ulong * (_MAX_NODES // _WORD_BITS))()
    rc = _libc().syscall(
        _numbers()[1], ctypes.byref(mode), words, ctypes.c_ulong(_MAX_NODES + 1), None,
        ctypes.c_ulong(0),
    )
    if rc != 0:
        err = ctypes.get_errno()
        raise MemPolicyError(f"get_mempolicy failed: {os.strerror(err)}")
    nodes = tuple(
        w * _WORD_BITS + b for w in range(len(words)) for b in range(_WORD_BITS) if words[w] >> b & 1
    )
    # Flags such as MPOL_F_STATIC_NODES live in the high bits of the mode.
    return MPOL_NAMES.get(mode.value & 0xFF, f"mode{mode.value}"), nodes
