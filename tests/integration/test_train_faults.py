"""Injected faults in real rank processes: what a supervisor will see (exit codes, log lines,
heartbeats), and ``once`` faults that do not repeat after a restart."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest

from slurmkit.train.heartbeat import local_heartbeat_path, read_heartbeat
from slurmkit.launch.localranks import LocalRun, spawn_ranks, write_config

pytestmark = [pytest.mark.integration, pytest.mark.realtime]

TIMEOUT_S = 90


def config(tmp: str, **train: Any) -> str:
    return write_config(os.path.join(tmp, "config.yaml"), {
        "model": {"name": "test", "dim": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1,
                  "ffn_dim": 64, "vocab_size": 256, "max_seq_len": 32},
        "parallel": {"strategy": "ddp", "pg_timeout_s": 30},
        "train": {"steps": 6, "micro_batch": 1, "seq_len": 16, "warmup_steps": 1,
                  "ckpt_interval_steps": 2, **train},
        "store": {"nvme_uri": "$SLURMKIT_RUN_DIR/ckpt/nvme"},
    })


def start(tmp: str, fault: str, generation: int = 0) -> LocalRun:
    env = {**os.environ, "SLURMKIT_FAULT": fault}
    return spawn_ranks(config(tmp), os.path.join(tmp, "run"), 2, env=env,
                       generation=generation)


def wait_exit(run: LocalRun, rank: int) -> int:
    deadline = time.monotonic() + TIMEOUT_S
    while run.procs[rank].poll() is None:
        if time.monotonic() > deadline:
            run.kill()
            raise AssertionError(f"rank {rank} did not exit:\n{run.tail()}")
        time.sleep(0.05)
    return int(run.procs[rank].returncode)


def test_nccl_abort_prints_the_nccl_line_and_dies_on_sigabrt(tmp_path: Any) -> None:
    run = start(str(tmp_path), "nccl_abort:1:3")
    try:
        assert wait_exit(run, 1) == -signal.SIGABRT
        assert ("[rank1]:[E ProcessGroupNCCL.cpp:1234] [PG 0 Rank 1] NCCL error: remote process "
                "exited or there was a network error") in run.output(1)
        hb = read_heartbeat(local_heartbeat_path(os.path.join(str(tmp_path), "run"), 1))
        assert hb is not None and hb["step"] == 2
    finally:
        run.kill()


def test_raise_is_a_python_traceback_with_exit_1(tmp_path: Any) -> None:
    run = start(str(tmp_path), "raise:0:2")
    try:
        assert wait_exit(run, 0) == 1
        out = run.output(0)
        assert "Traceback" in out and "RuntimeError: injected fault: raise on rank 0 at step 2" in out
    finally:
        run.kill()


def test_hang_stops_heartbeats_but_keeps_the_process_alive(tmp_path: Any) -> None:
    run = start(str(tmp_path), "hang:0:3:once")
    marker = os.path.join(str(tmp_path), "run", "faults", "hang-rank0-step3.fired")
    hb0 = local_heartbeat_path(os.path.join(str(tmp_path), "run"), 0)  # node-local
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not os.path.exists(marker):
            assert time.monotonic() < deadline, run.tail()
            time.sleep(0.05)
        first = read_heartbeat(hb0)
        assert first is not None and first["step"] == 2
        # Observe for a while: the step never advances and the process stays alive.
        until = time.monotonic() + 1.5
        while time.monotonic() < until:
            beat = read_heartbeat(hb0)
            assert beat is not None and beat["step"] == 2 and beat["time"] == first["time"]
            assert run.procs[0].poll() is None
            time.sleep(0.1)
    finally:
        run.kill()


def test_exit_once_fires_only_in_the_first_generation(tmp_path: Any) -> None:
    tmp = str(tmp_path)
    first = start(tmp, "exit:1:3:once")
    try:
        assert wait_exit(first, 1) == 1
        assert "Traceback" not in first.output(1)
    finally:
        first.kill()
    second = start(tmp, "exit:1:3:once", generation=1)
    assert second.wait(TIMEOUT_S) == [0, 0], second.tail()
    hb = read_heartbeat(local_heartbeat_path(os.path.join(tmp, "run"), 1))
    assert hb is not None and hb["step"] == 6 and hb["generation"] == 1
    assert os.path.exists(os.path.join(tmp, "run", "final.json"))
