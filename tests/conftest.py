"""Shared fixtures.

Integration fixtures never skip: CI starts the local cluster (tools/local-cluster up) before
the suite; a missing cluster is a failure with the command that fixes it.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
from collections.abc import Iterator

import pytest

from testkit.s3server import S3Server, start_s3_server, stop_pid
from testkit.slurm_build import path_with

CLUSTER_DIR = os.environ.get("SLURMKIT_CLUSTER_DIR", "/tmp/slurmkit-cluster")

# The suite runs as if its interpreter's environment were activated: a tool started through its
# shebang (tools/local-cluster: `env python3`), a bare `python` and the S3 server's `weed` are
# the ones of the environment running the tests (CI's .venv), not what else is first on PATH.
_BIN = os.path.dirname(sys.executable)
if os.environ.get("PATH", "").split(os.pathsep)[0] != _BIN:
    os.environ["PATH"] = os.pathsep.join(filter(None, [_BIN, os.environ.get("PATH")]))


def _slurm_first_on_path() -> None:
    """A local cluster running a built Slurm (tools/local-cluster up --slurm 24.11): its
    commands come before the system's for the whole session, tests and the jobs they submit."""
    try:
        with open(os.path.join(CLUSTER_DIR, "env.json")) as f:
            bin_dir = str(json.load(f).get("SLURMKIT_SLURM_BIN") or "")
    except (OSError, ValueError, AttributeError):
        return
    os.environ["PATH"] = path_with(bin_dir, os.environ.get("PATH", ""), keep_first=True)


_slurm_first_on_path()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test that uses the local cluster (``cluster_env``, directly or through another
    fixture) ``cluster``. CI (.ci/run) runs the ``cluster`` and ``realtime`` tests (real-time
    detection that a starved process would trip) in the foreground, one at a time on the one
    cluster, and everything else beside them at a lower CPU priority: the two sets are
    complementary by construction, so no test is left out of either."""
    for item in items:
        if "cluster_env" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.cluster)


SHARD_WEIGHTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shard_weights.json")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("slurmkit")
    group.addoption("--shard", default="", metavar="K/N",
                    help="run shard K of N: whole test files, spread over the shards by their "
                         "seconds in tests/shard_weights.json (CI runs shards side by side, each "
                         "on its own cluster or process)")
    group.addoption("--shard-head", action="append", default=[], metavar="K:SECONDS",
                    help="shard K starts SECONDS late (or has SECONDS of other work): it gets "
                         "that much less of the files")


def _shard_spec(config: pytest.Config) -> tuple[int, int, dict[int, float]] | None:
    spec = str(config.getoption("--shard") or "")
    if not spec:
        return None
    k, _, n = spec.partition("/")
    if not (k.isdigit() and n.isdigit() and 1 <= int(k) <= int(n)):
        raise pytest.UsageError(f"--shard {spec!r}: Detected: not K/N with 1 <= K <= N. "
                                "Requirement: e.g. --shard 1/2. Fix: pass --shard K/N")
    head: dict[int, float] = {}
    for item in config.getoption("--shard-head"):
        hk, _, secs = str(item).partition(":")
        try:
            head[int(hk)] = float(secs)
        except ValueError:
            raise pytest.UsageError(f"--shard-head {item!r}: Detected: not K:SECONDS. "
                                    "Requirement: e.g. --shard-head 2:300. Fix: pass K:SECONDS") from None
    return int(k), int(n), head


def shard_of_files(weights: dict[str, float], n: int, head: dict[int, float]) -> dict[str, int]:
    """Whole files onto ``n`` shards (1-based), heaviest first onto the least loaded shard (a
    shard's load starts at its head start): the same answer in every process given the same
    files, so the shards of one run are complementary and together cover every file."""
    load = {k: head.get(k, 0.0) for k in range(1, n + 1)}
    out: dict[str, int] = {}
    for f in sorted(weights, key=lambda f: (-weights[f], f)):
        k = min(load, key=lambda k: (load[k], k))
        out[f] = k
        load[k] += weights[f]
    return out


class _Shards:
    """``--shard K/N``: keep the tests of this shard's files, once -m and -k have selected (the
    hook runs last, after the marks above and pytest's own deselection)."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        spec = _shard_spec(config)
        if spec is None:
            return
        k, n, head = spec
        try:
            with open(SHARD_WEIGHTS) as f:
                known = {str(p): float(s) for p, s in json.load(f).items()}
        except (OSError, ValueError, TypeError, AttributeError) as exc:
            raise pytest.UsageError(f"--shard: Detected: {SHARD_WEIGHTS} unreadable ({exc}). Requirement: "
                                    "a JSON object of test file -> seconds. Fix: restore it from git") from None
        files: dict[str, list[pytest.Item]] = {}
        for item in items:
            files.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
        # The files marked slurm_version go to shard 1: CI runs them there on Slurm 22.05 and
        # again, whole, on its second cluster's Slurm 24.11 (-m slurm_version).
        pinned = {f for f, its in files.items() if any(it.get_closest_marker("slurm_version") for it in its)}
        # a file not in the table weighs a tenth of a second a test (a unit test file; a new
        # cluster test file goes into the table with its CI time)
        weights = {f: known.get(f, 0.1 * len(its)) for f, its in files.items() if f not in pinned}
        head = dict(head)
        head[1] = head.get(1, 0.0) + sum(known.get(f, 0.1 * len(files[f])) for f in pinned)
        where = shard_of_files(weights, n, head)
        where.update({f: 1 for f in pinned})
        keep = [it for it in items if where[it.nodeid.split("::", 1)[0]] == k]
        drop = [it for it in items if where[it.nodeid.split("::", 1)[0]] != k]
        if drop:
            config.hook.pytest_deselected(items=drop)
            items[:] = keep


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(_Shards(), "slurmkit-shards")


def load_cluster_env() -> dict[str, str] | None:
    path = os.path.join(CLUSTER_DIR, "env.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return dict(json.load(f))


@pytest.fixture(scope="session")
def cluster_env() -> dict[str, str]:
    """The environment of the running local Slurm cluster (SLURM_CONF, S3 endpoint, keys)."""
    env = load_cluster_env()
    if env is None:
        pytest.fail(
            f"no local cluster state in {CLUSTER_DIR}: run `tools/local-cluster up` first "
            "(CI does this in .ci/run)"
        )
    return env


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """A real S3 server: the local cluster's if it runs, else one started for this session."""
    env = load_cluster_env()
    if env is not None and env.get("SLURMKIT_S3_ENDPOINT"):
        yield S3Server(
            endpoint=env["SLURMKIT_S3_ENDPOINT"],
            access_key=env["AWS_ACCESS_KEY_ID"],
            secret_key=env["AWS_SECRET_ACCESS_KEY"],
            bucket=env["SLURMKIT_S3_BUCKET"],
            pid=-1,
            state_dir=CLUSTER_DIR,
        )
        return
    d = str(tmp_path_factory.mktemp("s3"))
    server = start_s3_server(d, access_key="sk" + secrets.token_hex(6),
                             secret_key=secrets.token_hex(16))
    try:
        yield server
    finally:
        stop_pid(server.pid)
