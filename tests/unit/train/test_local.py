"""spawn_ranks: the node agent's environment contract, including emulated nodes."""

from __future__ import annotations

import os
import stat
from typing import Any

import pytest

from slurmkit.errors import ConfigError
from slurmkit.train.heartbeat import local_heartbeat_path
from slurmkit.train.local import spawn_ranks


def env_of(output: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in output.splitlines() if "=" in line)


def fake_python(tmp: str) -> str:
    """An executable that prints its environment (stands in for ``python -m slurmkit.train``)."""
    path = os.path.join(tmp, "printenv.sh")
    with open(path, "w") as f:
        f.write("#!/bin/sh\nexec env\n")
    os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR)
    return path


def test_two_emulated_nodes_get_local_ranks_and_their_own_node_names(tmp_path: Any) -> None:
    run = spawn_ranks("cfg.yaml", str(tmp_path / "run"), 4, nodes=2,
                      env={"PATH": os.environ["PATH"], "SLURMKIT_NODE": "box"},
                      python=fake_python(str(tmp_path)))
    assert run.wait(30) == [0, 0, 0, 0]
    envs = [env_of(run.output(r)) for r in range(4)]
    assert [(e["RANK"], e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"], e["SLURMKIT_NODE"])
            for e in envs] == [("0", "0", "2", "box-0"), ("1", "1", "2", "box-0"),
                               ("2", "0", "2", "box-1"), ("3", "1", "2", "box-1")]
    assert {e["WORLD_SIZE"] for e in envs} == {"4"}
    assert len({e["MASTER_PORT"] for e in envs}) == 1


def test_one_node_keeps_the_given_node_name(tmp_path: Any) -> None:
    run = spawn_ranks("cfg.yaml", str(tmp_path / "run"), 2,
                      env={"PATH": os.environ["PATH"], "SLURMKIT_NODE": "box"},
                      python=fake_python(str(tmp_path)))
    assert run.wait(30) == [0, 0]
    assert [env_of(run.output(r))["SLURMKIT_NODE"] for r in (0, 1)] == ["box", "box"]
    assert [env_of(run.output(r))["LOCAL_RANK"] for r in (0, 1)] == ["0", "1"]


def test_nodes_must_divide_the_world(tmp_path: Any) -> None:
    with pytest.raises(ConfigError, match="emulated nodes"):
        spawn_ranks("cfg.yaml", str(tmp_path / "run"), 4, nodes=3)
    assert not (tmp_path / "run").exists()


def test_a_heartbeat_left_at_the_run_path_by_an_earlier_run_is_removed_before_ranks_start(
        tmp_path: Any) -> None:
    run_dir = str(tmp_path / "run")
    (tmp_path / "local").mkdir()
    env = {"PATH": os.environ["PATH"], "SLURMKIT_NODE_LOCAL_DIR": str(tmp_path / "local")}
    stale = [local_heartbeat_path(run_dir, r, env) for r in (0, 1)]
    for path in stale:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write('{"rank": 1, "step": 8, "time": 1, "pid": 1, "generation": 0}')
    run = spawn_ranks("cfg.yaml", run_dir, 2, env=env, python=fake_python(str(tmp_path)))
    assert run.wait(30) == [0, 0]
    assert [os.path.exists(p) for p in stale] == [False, False]
