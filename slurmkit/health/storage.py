"""The checkpoint tiers: this node's NVMe writable, with room for a save and a speed floor; the
shared tiers reachable within a deadline.

A full or read-only NVMe, or one that writes at a fraction of its speed, is this node's fault:
``bad_node``. A shared file system or object store that does not answer is everyone's problem,
and replacing this node would not help: ``wait``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from slurmkit.health.result import CheckResult, bad, ok, wait
from slurmkit.store.tiertrust import make_private_dirs

GIB = 1 << 30
MIB = 1 << 20
PROBE_NAME = ".slurmkit-preflight"
_CHUNK = 4 * MIB


def free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return int(st.f_bavail * st.f_frsize)


def newest_step_bytes(path: str) -> int:
    """Bytes of the newest step directory under ``path`` (what the next save adds before
    retention drops the oldest); 0 when there is none."""
    from slurmkit.store.manifest import parse_step_dir

    try:
        steps = [(s, e.path) for e in os.scandir(path) if e.is_dir(follow_symlinks=False)
                 and (s := parse_step_dir(e.name)) is not None]
    except OSError:
        return 0
    if not steps:
        return 0
    total = 0
    for root, _dirs, files in os.walk(max(steps)[1]):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def _write_probe(path: str, nbytes: int, clock: Callable[[], float]) -> float:
    """Write and fsync ``nbytes`` in ``path``; seconds it took. The file is removed."""
    probe = os.path.join(path, f"{PROBE_NAME}-{os.getpid()}")
    block = os.urandom(min(_CHUNK, max(nbytes, 1)))  # incompressible: a compressing FS cannot flatter it
    t = clock()
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, block[:min(left, len(block))])
        os.fsync(fd)
    finally:
        os.close(fd)
        try:
            os.unlink(probe)
        except OSError:
            pass
    return clock() - t


def check_nvme(path: str, *, min_free_bytes: int, probe_bytes: int, min_write_mb_s: float,
               free: Callable[[str], int] = free_bytes, clock: Callable[[], float] = time.monotonic) -> CheckResult:
    name = "nvme"
    fix_space = (f"free space under {path} (old runs' checkpoints), lower store.keep_nvme or "
                 "health.nvme_min_free_gb, or drain the node")
    try:
        make_private_dirs(path)  # 0700, as the store makes it (a group-writable tier is refused)
    except OSError as exc:
        return bad(name, f"cannot create the NVMe tier directory {path}: {exc.strerror or exc}",
                   "a writable NVMe tier on every node", fix_space)
    need = max(min_free_bytes, newest_step_bytes(path))
    try:
        avail = free(path)
    except OSError as exc:
        return bad(name, f"cannot read the free space of {path}: {exc.strerror or exc}",
                   "a working NVMe tier", "drain the node and check its local disk")
    figures: dict[str, Any] = {"free_gb": round(avail / GIB, 3), "need_gb": round(need / GIB, 3)}
    if avail < need:
        return bad(name, f"{avail / GIB:.2f} GiB free on the NVMe tier {path}",
                   f"at least {need / GIB:.2f} GiB free (health.nvme_min_free_gb, or the newest save here)",
                   fix_space, **figures)
    if probe_bytes > 0:
        try:
            seconds = _write_probe(path, probe_bytes, clock)
        except OSError as exc:
            return bad(name, f"writing {probe_bytes / MIB:.0f} MiB to {path} failed: {exc.strerror or exc}",
                       "the NVMe tier takes a save's writes", fix_space, **figures)
        mb_s = probe_bytes / MIB / max(seconds, 1e-6)
        if min_write_mb_s and mb_s < min_write_mb_s:
            # A neighbour's burst can slow one write: only a second slow probe fails the node.
            try:
                mb_s = max(mb_s, probe_bytes / MIB / max(_write_probe(path, probe_bytes, clock), 1e-6))
            except OSError:
                pass
        figures["write_mb_s"] = round(mb_s, 1)
        if min_write_mb_s and mb_s < min_write_mb_s:
            return bad(name, f"the NVMe tier {path} wrote {probe_bytes / MIB:.0f} MiB at {mb_s:.1f} MiB/s",
                       f"at least health.nvme_min_write_mb_s={min_write_mb_s:g} MiB/s",
                       "drain the node and check its disk (smartctl/nvme smart-log), or lower "
                       "health.nvme_min_write_mb_s", **figures)
    return ok(name, f"{avail / GIB:.1f} GiB free at {path}" +
              (f", {figures['write_mb_s']} MiB/s" if "write_mb_s" in figures else ""), **figures)


def check_shared_path(name: str, path: str, *, clock: Callable[[], float] = time.monotonic) -> CheckResult:
    """A shared file system tier: its directory (or, before the run's first save made it, the
    nearest directory above it) lists, and takes a small write when it exists. Nothing is
    created: a missing mount would otherwise look healthy on the node's root disk."""
    t = clock()
    where = path
    try:
        while not os.path.exists(where) and os.path.dirname(where) != where:
            where = os.path.dirname(where)
        os.listdir(where)  # a round trip to the file server, not only the client's cache
        if where == path:
            _write_probe(path, 4096, clock)
    except OSError as exc:
        return _unreachable(name, path, f"{exc.strerror or exc}")
    what = "answered" if where == path else f"not made yet; {where} answered"
    return ok(name, f"{path} {what}", reach_s=round(clock() - t, 4))


def check_remote(name: str, tier: Any, *, clock: Callable[[], float] = time.monotonic) -> CheckResult:
    """An object-store tier: one request that needs the server (does latest.json exist)."""
    from slurmkit.store.manifest import LATEST

    t = clock()
    try:
        tier.exists(LATEST)
    except Exception as exc:  # noqa: BLE001 - fsspec backends raise their own error types
        return _unreachable(name, tier.uri, f"{type(exc).__name__}: {exc}"[:300])
    return ok(name, f"{tier.uri} answered", reach_s=round(clock() - t, 4))


def _unreachable(name: str, where: str, why: str) -> CheckResult:
    return wait(name, f"the shared tier {where} is not reachable ({why})",
                "the shared checkpoint tiers answer", "wait for the file system or object store; "
                "ask the site if it stays down (this node is not the cause)")
