"""Shared fixtures.

Integration fixtures never skip: CI starts the local cluster (tools/local-cluster up) before
the suite; a missing cluster is a failure with the command that fixes it.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import sys
import urllib.parse
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


def _answers(endpoint: str) -> bool:
    url = urllib.parse.urlsplit(endpoint)
    try:
        with socket.create_connection((url.hostname or "127.0.0.1", url.port or 80), timeout=2):
            return True
    except OSError:
        return False


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """A real S3 server: the local cluster's if it runs, else one started for this session (a
    cluster brought down without `tools/local-cluster down` leaves its env.json behind: its
    endpoint must answer to count)."""
    env = load_cluster_env()
    if env is not None and env.get("SLURMKIT_S3_ENDPOINT") and _answers(env["SLURMKIT_S3_ENDPOINT"]):
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
