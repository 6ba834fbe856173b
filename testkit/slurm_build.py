"""A Slurm newer than Debian 12's 22.05 for the local cluster, built once from upstream source.

Production sites run Slurm 23.02-25.11; Debian 12 packages 22.05. ``tools/local-cluster up
--slurm 24.11`` uses this module: the upstream tarball (Debian's archive serves it as the orig
tarball of trixie's ``slurm-wlm``) is downloaded, checked against its pinned SHA-256, configured
with ``--enable-multiple-slurmd`` (several slurmd on one host), shared libraries only and no
optimisation (CONFIGURE), and installed under a root-owned
cache directory. A finished install carries a marker naming the tarball's hash; anything else in
the cache is rebuilt. The cache directory must belong to root (or to whoever runs the tool) and
be writable by nobody else: the cluster's daemons run as root from it.

Standard library only: it runs before the project's environment exists.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

#: Debian 12's own Slurm: the system packages, nothing to build.
SYSTEM = "22.05"


@dataclass(frozen=True)
class Source:
    version: str
    url: str
    sha256: str
    size: int  # bytes, for the progress line and a bound on the download


SOURCES = {
    "24.11": Source(
        "24.11.5",
        "http://deb.debian.org/debian/pool/main/s/slurm-wlm/slurm-wlm_24.11.5.orig.tar.gz",
        "e1a5547edd212c38b5e3230a284133f777b32746551f094aaa81cc4af375e332",
        9_907_599,
    ),
}
#: Debian packages the build needs (configure finds munge, json-c, hwloc, mariadb, dbus).
BUILD_PACKAGES = ["build-essential", "libmunge-dev", "libmariadb-dev", "libjson-c-dev",
                  "libhwloc-dev", "libyaml-dev", "libdbus-1-dev"]
MARKER = ".slurmkit-build.json"
#: How the build is configured (recorded in the marker: an install made otherwise is rebuilt).
#: Shared libraries only: with static ones too libtool compiles every library source twice.
#: ``-O0`` without ``-g``: the test cluster's four nodes need no optimised daemons, and the
#: build (CI builds it on a fresh machine, beside the tests) takes about a third of the CPU.
CONFIGURE = ("--enable-multiple-slurmd", "--disable-debug", "--disable-static", "CFLAGS=-O0 -pipe")
DAEMONS = ("slurmctld", "slurmd", "slurmdbd", "slurmstepd")
COMMANDS = ("sbatch", "srun", "scontrol", "squeue", "sacct", "sacctmgr", "sinfo", "scancel")


class BuildError(Exception):
    """The build cannot be made or trusted; the message says what was found and what to do."""


def path_with(bin_dir: str, path: str, keep_first: bool = False) -> str:
    """``path`` with a built Slurm's ``bin`` and its ``sbin`` in front (after the first entry
    with ``keep_first``: a test session keeps its interpreter's directory first)."""
    parts = [p for p in path.split(os.pathsep) if p]
    if not bin_dir or bin_dir in parts:
        return path
    ours = [bin_dir, os.path.join(os.path.dirname(bin_dir), "sbin")]
    return os.pathsep.join([*parts[:1], *ours, *parts[1:]] if keep_first and parts else [*ours, *parts])


def cluster_environ(cluster: dict[str, object], base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) with the local cluster's ``env.json``
    values, its built Slurm's commands first on PATH when it runs one (SLURMKIT_SLURM_BIN)."""
    env = {**(dict(os.environ) if base is None else base), **{k: str(v) for k, v in cluster.items()}}
    env["PATH"] = path_with(str(cluster.get("SLURMKIT_SLURM_BIN") or ""), env.get("PATH", ""))
    return env


def versions() -> list[str]:
    return [SYSTEM, *SOURCES]


def prefix_for(cache: str, version: str) -> str:
    return os.path.join(os.path.abspath(cache), f"slurm-{SOURCES[version].version}")


def check_cache_dir(cache: str, euid: int | None = None) -> None:
    """The cache must be a real directory owned by root or by us, writable by nobody else, under
    parents equally safe: the daemons it holds run as root. Raises BuildError."""
    euid = os.geteuid() if euid is None else euid
    path = os.path.abspath(cache)
    while True:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            path = os.path.dirname(path)
            continue
        if not os.path.isdir(path) or os.path.islink(path):
            raise BuildError(f"Detected: {path} is not a directory. Requirement: the Slurm build cache "
                             "is a directory. Fix: remove it or pass another --slurm-cache.")
        sticky_tmp = bool(st.st_mode & 0o1000) and st.st_uid == 0
        if st.st_uid not in (0, euid) or (st.st_mode & 0o022 and not sticky_tmp):
            raise BuildError(
                f"Detected: {path} is owned by uid {st.st_uid} with mode {st.st_mode & 0o7777:o}. "
                "Requirement: the Slurm build cache and its parents belong to root (or you) and "
                "are writable by no one else (its daemons run as root). Fix: pass "
                "--slurm-cache under a directory only root can write (default /var/cache/slurmkit).")
        if path == os.path.dirname(path):
            return
        path = os.path.dirname(path)


def installed(cache: str, version: str) -> str | None:
    """The install prefix when a finished build of ``version`` is there, else None."""
    prefix = prefix_for(cache, version)
    try:
        with open(os.path.join(prefix, MARKER)) as f:
            mark = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(mark, dict) or mark.get("sha256") != SOURCES[version].sha256:
        return None
    if mark.get("configure") != list(CONFIGURE):
        return None
    if not all(os.access(os.path.join(prefix, "sbin", d), os.X_OK) for d in DAEMONS):
        return None
    if not all(os.access(os.path.join(prefix, "bin", c), os.X_OK) for c in COMMANDS):
        return None
    return prefix


def sha256_of(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def download(src: Source, dest: str, log: Callable[[str], None]) -> None:
    """``src`` to ``dest``, checked; a file that does not match is removed, never used."""
    if os.path.exists(dest) and sha256_of(dest) == src.sha256:
        return
    log(f"downloading {src.url} ({src.size / 1e6:.1f} MB)")
    tmp = f"{dest}.part"
    with urllib.request.urlopen(src.url, timeout=120) as resp, open(tmp, "wb") as out:
        got = 0
        while block := resp.read(1 << 20):
            got += len(block)
            if got > 4 * src.size:
                raise BuildError(f"Detected: {src.url} sent more than {4 * src.size} bytes. "
                                 f"Requirement: the {src.size}-byte tarball. Fix: check the mirror.")
            out.write(block)
    digest = sha256_of(tmp)
    if digest != src.sha256:
        os.unlink(tmp)
        raise BuildError(f"Detected: {src.url} has SHA-256 {digest}. Requirement: {src.sha256} "
                         "(the pinned Slurm source). Fix: check the mirror, or the network in between.")
    os.replace(tmp, dest)


def _extract(tarball: str, into: str) -> str:
    """Unpack, refusing members that leave ``into`` or are links out of it; the top directory."""
    root = os.path.realpath(into)
    with tarfile.open(tarball, "r:gz") as tar:
        tops = set()
        for m in tar.getmembers():
            target = os.path.realpath(os.path.join(root, m.name))
            if not target.startswith(root + os.sep) or m.isdev():
                raise BuildError(f"Detected: {tarball} member {m.name!r} leaves the build directory. "
                                 "Requirement: a plain source tarball. Fix: remove the download.")
            tops.add(m.name.split("/", 1)[0])
        if hasattr(tarfile, "data_filter"):  # Python 3.11.4+: no links out, no devices, no setuid
            tar.extractall(root, filter="data")
        else:
            tar.extractall(root)  # members checked above
    if len(tops) != 1:
        raise BuildError(f"Detected: {tarball} holds {len(tops)} top directories. "
                         "Requirement: one. Fix: remove the download.")
    return os.path.join(root, tops.pop())


def build(cache: str, version: str, log: Callable[[str], None], jobs: int | None = None) -> str:
    """Build and install ``version`` under ``cache`` unless a finished build is there; the
    prefix. Needs the BUILD_PACKAGES; takes minutes (its progress is logged)."""
    src = SOURCES[version]
    check_cache_dir(cache)
    os.makedirs(cache, mode=0o755, exist_ok=True)
    check_cache_dir(cache)
    done = installed(cache, version)
    if done is not None:
        return done
    prefix = prefix_for(cache, version)
    tarball = os.path.join(cache, os.path.basename(src.url))
    download(src, tarball, log)
    shutil.rmtree(prefix, ignore_errors=True)  # a half-made install is never used
    jobs = jobs or os.cpu_count() or 2
    with tempfile.TemporaryDirectory(prefix="slurm-build-", dir=cache) as tmp:
        top = _extract(tarball, tmp)
        logfile = os.path.join(cache, f"build-{src.version}.log")
        steps = [["./configure", f"--prefix={prefix}", *CONFIGURE],
                 ["make", f"-j{jobs}"], ["make", "install"]]
        with open(logfile, "w") as out:
            for step in steps:
                t0 = time.monotonic()
                log(f"Slurm {src.version}: {' '.join(step)} (log: {logfile})")
                res = subprocess.run(step, cwd=top, stdout=out, stderr=subprocess.STDOUT)
                if res.returncode != 0:
                    shutil.rmtree(prefix, ignore_errors=True)
                    raise BuildError(f"Detected: `{' '.join(step)}` of Slurm {src.version} exited "
                                     f"{res.returncode}. Requirement: a build that succeeds. Fix: read "
                                     f"{logfile}; the build needs the Debian packages "
                                     f"{' '.join(BUILD_PACKAGES)}.")
                log(f"Slurm {src.version}: {step[0]} {step[-1]} took {time.monotonic() - t0:.0f} s")
    with open(os.path.join(prefix, MARKER), "w") as f:
        json.dump({"version": src.version, "sha256": src.sha256, "configure": list(CONFIGURE),
                   "built": time.time()}, f)
    if installed(cache, version) is None:
        raise BuildError(f"Detected: the install under {prefix} lacks one of {', '.join(DAEMONS + COMMANDS)}. "
                         f"Requirement: a complete install. Fix: read {logfile}.")
    return prefix


if __name__ == "__main__":  # python -m testkit.slurm_build 24.11 [CACHE] (from the repository root)
    print(build(sys.argv[2] if len(sys.argv) > 2 else "/var/cache/slurmkit", sys.argv[1],
                lambda m: print(m, file=sys.stderr, flush=True)))
