"""Integration tests share one real cluster: each starts on a clean one.

A test that fails half-way (an assertion while its job runs, a killed node it never brought
back) would otherwise leave jobs holding nodes and nodes DOWN, and every later test would wait
for them until its own timeout: one failure turning into a suite that never ends.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest

from tests.integration.faults import COMMON, STEPS, diagnose, final, finish, restore_cluster, submit
from tests.integration.helpers import slurm_env


@pytest.fixture(scope="session")
def reference(cluster_env, tmp_path_factory: pytest.TempPathFactory) -> str:
    """param_sha256 of the uninterrupted run of faults.COMMON, for every fault test that trains it
    (supervisor settings and spares change no parameter). A module that trains another config
    defines its own ``reference``."""
    env = slurm_env(cluster_env)
    d = tmp_path_factory.mktemp("ref")
    job, run_dir = submit([*COMMON, "job.name=reference"], env, str(d))
    assert finish(job, env, timeout_s=600, run_dir=run_dir) == "COMPLETED", diagnose(run_dir, job, env)
    out = final(run_dir)
    assert out["step"] == STEPS, out
    return str(out["param_sha256"])


@pytest.fixture(autouse=True)
def _clean_cluster(request: pytest.FixtureRequest) -> Iterator[None]:
    if "cluster_env" not in request.fixturenames:
        yield
        return
    env = slurm_env(request.getfixturevalue("cluster_env"))
    own = str(request.getfixturevalue("tmp_path_factory").getbasetemp())
    before = restore_cluster(env, own)
    if before:
        warnings.warn(f"before {request.node.nodeid}: {'; '.join(before)}", stacklevel=1)
    yield
    after = restore_cluster(env, own)
    if after:
        warnings.warn(f"{request.node.nodeid} left the cluster dirty: {'; '.join(after)}", stacklevel=1)
