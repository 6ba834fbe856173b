"""The per-user cache of the site probe and the run directory's copy: real files, real modes and
owners; a cache that is a link, another user's, group-writable, garbage or old is never trusted."""

from __future__ import annotations

import json
import os
import stat

from slurmkit.slurm.capabilities import (
    CAPABILITIES_NAME,
    cache_path,
    read_run_dir_copy,
    site_capabilities,
    write_run_dir_copy,
)
from tests.unit.slurm.test_capabilities import CONFIG_2205, Canned, site

T0 = 1_800_000_000.0


def env_for(tmp_path) -> dict[str, str]:
    return {"SLURMKIT_CACHE_DIR": str(tmp_path / "cache"), "SLURM_CONF": "/site/etc/slurm.conf"}


def cached(tmp_path) -> str:
    """Probe once through the canned 22.05 site at T0; returns the cache file's path."""
    env = env_for(tmp_path)
    site_capabilities(env, runner=site(CONFIG_2205), clock=lambda: T0)
    path = cache_path(env)
    assert path is not None and os.path.isfile(path)
    return path


def again(tmp_path, now: float = T0 + 60) -> tuple[bool, str | None]:
    """Ask again; (whether the site was probed, the version returned)."""
    runner = site(CONFIG_2205)
    caps = site_capabilities(env_for(tmp_path), runner=runner, clock=lambda: now)
    return bool(runner.calls), caps.version


def test_a_fresh_cache_answers_without_asking_slurm(tmp_path) -> None:
    path = cached(tmp_path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    assert again(tmp_path) == (False, "22.05.8")
    assert not [n for n in os.listdir(os.path.dirname(path)) if ".tmp" in n]


def test_the_cache_is_keyed_by_slurm_conf(tmp_path) -> None:
    env = env_for(tmp_path)
    assert cache_path(env) != cache_path({**env, "SLURM_CONF": "/other/slurm.conf"})
    assert cache_path({"HOME": "/home/u"}) is not None and cache_path({}) is None
    assert cache_path({"HOME": "/home/u"}).startswith("/home/u/.cache/slurmkit/")  # type: ignore[union-attr]


def test_an_old_cache_is_probed_again(tmp_path) -> None:
    cached(tmp_path)
    assert again(tmp_path, now=T0 + 3601) == (True, "22.05.8")
    assert again(tmp_path, now=T0 - 3600) == (True, "22.05.8")  # from the future: a clock jump


def test_a_link_is_not_followed_and_is_replaced(tmp_path) -> None:
    path = cached(tmp_path)
    target = tmp_path / "elsewhere.json"
    os.replace(path, target)
    os.symlink(target, path)
    assert again(tmp_path) == (True, "22.05.8")
    assert not os.path.islink(path) and target.is_file()  # the new cache replaced the link only


def test_another_users_cache_is_ignored(tmp_path) -> None:
    path = cached(tmp_path)
    os.chown(path, 4242, -1)  # the tests run as root (CI does)
    assert again(tmp_path) == (True, "22.05.8")
    assert os.stat(path).st_uid == os.getuid()


def test_a_group_writable_cache_is_ignored(tmp_path) -> None:
    path = cached(tmp_path)
    os.chmod(path, 0o620)
    assert again(tmp_path) == (True, "22.05.8")


def test_garbage_is_ignored(tmp_path) -> None:
    path = cached(tmp_path)
    good = json.loads(open(path).read())
    for text in ("", "{", "\xff\xfe", "[]", json.dumps({**good, "kill_wait_s": "10 sec"}),
                 json.dumps({**good, "schema": 0}), "x" * 300_000):
        with open(path, "w") as f:
            f.write(text)
        os.chmod(path, 0o600)
        assert again(tmp_path) == (True, "22.05.8"), text[:40]


def test_a_linked_cache_directory_is_not_written(tmp_path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    os.symlink(real, tmp_path / "cache")
    caps = site_capabilities(env_for(tmp_path), runner=site(CONFIG_2205), clock=lambda: T0)
    assert caps.version == "22.05.8" and os.listdir(real) == []


def test_an_unanswered_probe_is_not_cached(tmp_path) -> None:
    env = env_for(tmp_path)
    assert site_capabilities(env, runner=Canned({}), clock=lambda: T0).version is None
    assert not os.path.exists(cache_path(env))  # type: ignore[arg-type]
    assert again(tmp_path) == (True, "22.05.8")


def test_the_run_directory_copy(tmp_path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    caps = site_capabilities(env_for(tmp_path), runner=site(CONFIG_2205), clock=lambda: T0)
    path = write_run_dir_copy(str(run_dir), caps)
    assert path == str(run_dir / CAPABILITIES_NAME)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644
    assert read_run_dir_copy(str(run_dir), now=T0 + 86_400) == caps  # any age: the job's own record
    assert read_run_dir_copy(str(run_dir), now=T0 + 86_400, max_age_s=3600) is None
    os.replace(path, tmp_path / "moved.json")
    os.symlink(tmp_path / "moved.json", path)
    assert read_run_dir_copy(str(run_dir), now=T0) is None
    os.unlink(path)
    assert read_run_dir_copy(str(run_dir), now=T0) is None
