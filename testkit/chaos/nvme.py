"""A full NVMe tier on one emulated node, for real, without filling the machine's disk.

The emulated nodes' NVMe directories (``{store.nvme_uri}/{node}``) share one disk; filling
one would fill every tier of every job on the machine. So the campaign puts a size-limited
tmpfs over that one directory: the tmpfs is mounted at a staging directory next to it, gets a
copy of everything the directory holds (the node's committed checkpoints stay where the ranks
look for them), is bind-mounted over the directory, and a filler file is written into it until
the kernel says ENOSPC. The ranks of that node then meet a real full file system on their next
save. ``release`` removes the filler (an operator cleaning the disk); the tmpfs itself stays
until the job ended (``unmount``, lazily: a rank may still hold a file there), because a
tmpfs unmounted under a running rank would take its newer checkpoints with it.

Needs root (mount); the mounts are in this machine's mount namespace, which the emulated
nodes' slurmd and ranks share.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from slurmkit.runfiles import CONFIG_NAME

FILLER = ".chaos-nvme-filler"
MIB = 1 << 20
Runner = Callable[[list[str]], None]


def run_checked(argv: list[str]) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=60)


def node_nvme_dir(run_dir: str, node: str, env: Mapping[str, str] | None = None) -> str:
    """The NVMe tier directory of ``node`` in the run at ``run_dir``, built as the store builds
    it (``{store.nvme_uri}/{node}``, variables from the rank environment: $SLURMKIT_RUN_DIR
    is the run directory)."""
    import yaml

    from slurmkit.store.tier import expand_env

    with open(os.path.join(run_dir, CONFIG_NAME)) as f:
        uri = str(((yaml.safe_load(f) or {}).get("store") or {}).get("nvme_uri") or "")
    if not uri:
        raise ValueError(f"the run {run_dir} has no NVMe tier (store.nvme_uri is empty)")
    root = expand_env(uri, {**(os.environ if env is None else env), "SLURMKIT_RUN_DIR": run_dir})
    if root.startswith("file://"):
        root = root[len("file://"):]
    if "://" in root:
        raise ValueError(f"the NVMe tier {root} is not a local directory")
    return os.path.join(root.rstrip("/"), node)


def tree_bytes(path: str) -> tuple[int, int]:
    """(bytes under ``path``, bytes of its largest ``step_*`` directory); files that vanish
    while walking (retention) are skipped."""
    total = 0
    per_step: dict[str, int] = {}
    for root, _, files in os.walk(path):
        rel = os.path.relpath(root, path).split(os.sep)[0]
        for name in files:
            try:
                size = os.lstat(os.path.join(root, name)).st_size
            except FileNotFoundError:
                continue
            total += size
            if rel.startswith("step_"):
                per_step[rel] = per_step.get(rel, 0) + size
    return total, max(per_step.values(), default=0)


def tmpfs_size(used: int, largest_step: int, min_free: int = 0) -> int:
    """What the tmpfs holds: today's content, and once the filler is gone, room for two more
    saves (retention keeps the newest ones while the next is written) on top of the free space
    the pre-flight demands (``min_free``: a cleaned disk is a healthy node's disk again; seen
    with 0.08 GiB free: the next generation's pre-flight rejected the node), rounded up to MiB."""
    need = used + max(2 * largest_step, 64 * MIB) + min_free + 16 * MIB
    return -(-need // MIB) * MIB


def preflight_min_free(run_dir: str) -> int:
    """The free space the run's pre-flight demands of an NVMe tier (health.nvme_min_free_gb,
    1 GiB when the frozen config does not say)."""
    import yaml

    with open(os.path.join(run_dir, CONFIG_NAME)) as f:
        health = (yaml.safe_load(f) or {}).get("health") or {}
    return int(float(health.get("nvme_min_free_gb", 1.0)) * (1 << 30))


def copy_tree(src: str, dst: str) -> None:
    """Copy what ``src`` holds into ``dst``; a file retention removes meanwhile is skipped."""
    for root, dirs, files in os.walk(src):
        target = os.path.join(dst, os.path.relpath(root, src))
        os.makedirs(target, exist_ok=True)
        for name in files:
            try:
                shutil.copy2(os.path.join(root, name), os.path.join(target, name))
            except FileNotFoundError:
                continue


def fill(path: str, chunk: int = MIB) -> int:
    """Write ``path`` until the file system is full (ENOSPC): MiB blocks, then pages for the
    rest (unbuffered: a write the kernel refuses is never retried at close); returns the bytes
    written."""
    written = 0
    with open(path, "wb", buffering=0) as f:
        for size in (chunk, 4096):
            block = b"\0" * size
            try:
                while True:
                    n = f.write(block)
                    written += n or 0
                    if not n:
                        break
            except OSError:
                pass
    return written


@dataclass
class FullTier:
    """One node's NVMe directory under a full, size-limited tmpfs."""

    path: str
    size_bytes: int
    filler_bytes: int
    mounted: bool = True

    @property
    def filler(self) -> str:
        return os.path.join(self.path, FILLER)


def fill_tier(path: str, *, min_free: int = 0, run: Runner = run_checked) -> FullTier:
    """Put a size-limited tmpfs over ``path`` holding a copy of its content, and fill it."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no NVMe directory {path} to fill")
    used, step = tree_bytes(path)
    size = tmpfs_size(used, step, min_free)
    staging = tempfile.mkdtemp(prefix=".chaos-nvme-", dir=os.path.dirname(path))
    bound = False
    try:
        run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", staging])
        try:
            copy_tree(path, staging)
            run(["mount", "--bind", staging, path])
            bound = True
        finally:
            run(["umount", staging])  # the bind mount keeps the tmpfs
    finally:
        os.rmdir(staging)
    full = FullTier(path, size, 0)
    try:
        full.filler_bytes = fill(full.filler)
    except BaseException:
        if bound:
            unmount(full, run=run)
        raise
    return full


def free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def release(full: FullTier) -> None:
    """Remove the filler: the disk has room again (the tmpfs stays, see ``unmount``)."""
    try:
        os.unlink(full.filler)
    except FileNotFoundError:
        pass


def unmount(full: FullTier, *, run: Runner = run_checked) -> None:
    """Take the tmpfs away (lazily: a process may still hold a file in it)."""
    if full.mounted:
        run(["umount", "-l", full.path])
        full.mounted = False
