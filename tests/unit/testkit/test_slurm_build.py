"""The built Slurm of the local cluster (testkit/slurm_build.py): what it refuses to
trust. The build itself runs in CI (tools/local-cluster up --slurm 24.11); these are its checks."""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path

import pytest

from testkit import slurm_build as sb


def test_a_cache_others_can_write_is_refused(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o777)
    os.chmod(cache, 0o777)
    with pytest.raises(sb.BuildError, match=r"Detected: .*cache.* mode 777.*Fix"):
        sb.check_cache_dir(str(cache))
    os.chmod(cache, 0o755)
    sb.check_cache_dir(str(cache))  # ours, and /tmp is root's sticky directory
    sb.check_cache_dir(str(cache / "not" / "made" / "yet"))


def test_a_cache_of_another_user_is_refused(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o755)
    if os.geteuid() == 0:
        os.chown(cache, 4242, 4242)  # as root: a directory another user made
        euid = 0
    else:
        euid = os.geteuid() + 4242  # as a user: a directory someone else (we) made
    with pytest.raises(sb.BuildError, match=r"owned by uid \d+ .*Requirement"):
        sb.check_cache_dir(str(cache), euid=euid)


def _fake_install(cache: Path, version: str, sha: str, missing: str = "",
                  configure: tuple[str, ...] = sb.CONFIGURE) -> str:
    prefix = Path(sb.prefix_for(str(cache), version))
    for sub, names in (("sbin", sb.DAEMONS), ("bin", sb.COMMANDS)):
        (prefix / sub).mkdir(parents=True, exist_ok=True)
        for n in names:
            if n != missing:
                (prefix / sub / n).write_text("#!/bin/sh\n")
                os.chmod(prefix / sub / n, 0o755)
    (prefix / sb.MARKER).write_text(json.dumps({"sha256": sha, "configure": list(configure)}))
    return str(prefix)


def test_only_a_finished_build_of_the_pinned_source_is_used(tmp_path: Path) -> None:
    good = sb.SOURCES["24.11"].sha256
    assert sb.installed(str(tmp_path), "24.11") is None  # nothing there
    prefix = _fake_install(tmp_path, "24.11", "0" * 64)
    assert sb.installed(str(tmp_path), "24.11") is None  # another source's build
    half = tmp_path / "half"
    _fake_install(half, "24.11", good, missing="slurmd")
    assert sb.installed(str(half), "24.11") is None  # half installed
    other = tmp_path / "other"
    _fake_install(other, "24.11", good, configure=("--enable-multiple-slurmd",))
    assert sb.installed(str(other), "24.11") is None  # configured otherwise: rebuilt
    _fake_install(tmp_path, "24.11", good)
    assert sb.installed(str(tmp_path), "24.11") == prefix


def test_a_download_that_does_not_match_the_pin_is_removed_and_said(tmp_path: Path) -> None:
    served = tmp_path / "served.tar.gz"
    served.write_bytes(b"not slurm" * 100)
    src = sb.Source("24.11.5", served.as_uri(), sb.SOURCES["24.11"].sha256, 900)
    dest = tmp_path / "got.tar.gz"
    with pytest.raises(sb.BuildError, match=r"Detected: .* has SHA-256 [0-9a-f]{64}\. Requirement"):
        sb.download(src, str(dest), lambda m: None)
    assert not dest.exists() and not Path(f"{dest}.part").exists()
    ok = sb.Source("x", served.as_uri(), sb.sha256_of(str(served)), 900)
    sb.download(ok, str(dest), lambda m: None)
    assert dest.read_bytes() == served.read_bytes()


def _tarball(path: Path, names: list[str]) -> None:
    with tarfile.open(path, "w:gz") as tar:
        for name in names:
            data = b"x"
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_a_tarball_member_leaving_the_build_directory_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "bad.tar.gz"
    _tarball(bad, ["slurm-x/configure", "../../etc/evil"])
    into = tmp_path / "build"
    into.mkdir()
    with pytest.raises(sb.BuildError, match="leaves the build directory"):
        sb._extract(str(bad), str(into))
    assert not (tmp_path / "etc").exists() and os.listdir(into) == []
    good = tmp_path / "good.tar.gz"
    _tarball(good, ["slurm-x/configure", "slurm-x/src/a.c"])
    assert sb._extract(str(good), str(into)) == os.path.join(os.path.realpath(into), "slurm-x")


def test_a_built_slurm_comes_first_on_path_once() -> None:
    bin_dir = "/var/cache/slurmkit/slurm-24.11.5/bin"
    sbin = "/var/cache/slurmkit/slurm-24.11.5/sbin"
    assert sb.path_with(bin_dir, "/usr/bin:/bin") == f"{bin_dir}:{sbin}:/usr/bin:/bin"
    assert sb.path_with(bin_dir, "/venv/bin:/usr/bin", keep_first=True) == f"/venv/bin:{bin_dir}:{sbin}:/usr/bin"
    assert sb.path_with(bin_dir, f"{bin_dir}:{sbin}:/usr/bin") == f"{bin_dir}:{sbin}:/usr/bin"  # once
    assert sb.path_with("", "/usr/bin") == "/usr/bin"  # Debian's 22.05: nothing to add
    env = sb.cluster_environ({"SLURM_CONF": "/c/slurm.conf", "SLURMKIT_SLURM_BIN": bin_dir}, {"PATH": "/usr/bin"})
    assert env == {"SLURM_CONF": "/c/slurm.conf", "SLURMKIT_SLURM_BIN": bin_dir, "PATH": f"{bin_dir}:{sbin}:/usr/bin"}
