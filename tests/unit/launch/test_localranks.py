"""spawn_ranks: the node agent's environment contract, including emulated nodes."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import stat
from typing import Any

import pytest

from slurmkit.errors import ConfigError
from slurmkit.train.heartbeat import local_heartbeat_path
from slurmkit.launch import localranks
from slurmkit.launch.forkserver import ForkedProc
from slurmkit.launch.localranks import spawn_ranks, write_config


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


def _subreaper() -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    flag = ctypes.c_int(-1)
    assert libc.prctl(37, ctypes.byref(flag), 0, 0, 0) == 0  # PR_GET_CHILD_SUBREAPER
    return flag.value


def _config(tmp: str) -> str:
    return write_config(os.path.join(tmp, "cfg.yaml"), {
        "model": {"name": "test", "dim": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 2,
                  "ffn_dim": 64, "vocab_size": 128, "max_seq_len": 32},
        "parallel": {"strategy": "ddp", "pg_timeout_s": 60},
        "train": {"steps": 2, "micro_batch": 1, "global_batch": 2, "seq_len": 16, "warmup_steps": 1,
                  "ckpt_interval_steps": 0, "cpu_peak_tflops": 0.1},
        "store": {"nvme_uri": "$SLURMKIT_RUN_DIR/ckpt/nvme", "lustre_uri": "$SLURMKIT_RUN_DIR/ckpt/shared"},
    })


def test_real_ranks_are_forked_children_of_this_process_from_one_kept_server(tmp_path: Any) -> None:
    cfg, base = _config(str(tmp_path)), {**os.environ, "SLURMKIT_NODE_LOCAL_DIR": str(tmp_path / "local")}
    first = spawn_ranks(cfg, str(tmp_path / "a"), 2, env=base)
    assert first.wait(120) == [0, 0], first.tail()
    assert all(isinstance(p, ForkedProc) for p in first.procs)  # forked, not started cold
    assert first.server_pid is not None
    assert _subreaper() == 0  # a subreaper only while it forked: nothing else comes to it
    # the second run (its own identity, SLURMKIT_* settings, the caller's test name) is forked
    # from the same server
    second = spawn_ranks(cfg, str(tmp_path / "b"), 2, generation=1,
                         env={**base, "SLURMKIT_STEP_DELAY_S": "0.01", "PYTEST_CURRENT_TEST": "another"})
    assert all(isinstance(p, ForkedProc) for p in second.procs)
    assert second.wait(120) == [0, 0], second.tail()
    assert second.server_pid == first.server_pid
    for run in (first, second):
        with open(os.path.join(run.run_dir, "final.json")) as f:
            assert json.load(f)["world_size"] == 2
    # another value outside a rank's identity: another server (the first one's would be wrong)
    third = spawn_ranks(cfg, str(tmp_path / "c"), 2, env={**base, "OMP_NUM_THREADS": "2"})
    assert third.wait(120) == [0, 0], third.tail()
    assert third.server_pid is not None and third.server_pid != first.server_pid
    localranks.stop_servers()
    assert not localranks._servers


def test_a_forked_rank_is_signalled_and_its_status_read_as_a_cold_ones(tmp_path: Any) -> None:
    cfg = _config(str(tmp_path))
    run = spawn_ranks(cfg, str(tmp_path / "a"), 2, env={**os.environ, "SLURMKIT_STEP_DELAY_S": "5"})
    assert isinstance(run.procs[1], ForkedProc)
    run.procs[1].send_signal(signal.SIGKILL)
    assert run.procs[1].wait(60) == -signal.SIGKILL
    run.kill()
    assert run.procs[0].returncode is not None
