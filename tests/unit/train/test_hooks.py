"""Heartbeat file, fault specs, stop flag, learning-rate schedule and RNG capture."""

from __future__ import annotations

import json
import os
import random
import signal
from typing import Any

import numpy as np
import pytest
import torch

from slurmkit.errors import ConfigError
from slurmkit.train import rng
from slurmkit.train.faults import Fault, FaultInjector, nccl_error_line, parse_faults
from slurmkit.train.heartbeat import Heartbeat, heartbeat_path, local_heartbeat_path, read_heartbeat
from slurmkit.train.schedule import lr_at
from slurmkit.train.signals import StopRequest


def test_heartbeat_record_and_atomic_replace(tmp_path: Any) -> None:
    path = os.path.join(str(tmp_path), "hb", "rank3.json")
    hb = Heartbeat(path, rank=3, generation=2, clock=lambda: 1234.5, pid=42)
    hb.beat(7)
    assert read_heartbeat(path) == {"rank": 3, "step": 7, "time": 1234.5, "pid": 42,
                                    "generation": 2}
    hb.beat(8)
    assert json.loads(open(path).read())["step"] == 8
    assert os.listdir(os.path.dirname(path)) == ["rank3.json"]  # no temp file left


def test_heartbeat_path_from_env() -> None:
    assert heartbeat_path({"SLURMKIT_HEARTBEAT_FILE": "/x/hb.json"}, 1) == "/x/hb.json"
    # Under a run directory the beat stays on the node, never on the shared file system.
    local = heartbeat_path({"SLURMKIT_RUN_DIR": "/r"}, 1)
    assert local == local_heartbeat_path("/r", 1, {"SLURMKIT_RUN_DIR": "/r"})
    assert local is not None and not local.startswith("/r/") and local.endswith("/heartbeat/rank1.json")
    assert heartbeat_path({}, 1) is None
    assert Heartbeat.from_env({}, 0) is None


def test_parse_faults() -> None:
    assert parse_faults("") == []
    assert parse_faults("raise:0:5; hang:1:9:once") == [
        Fault("raise", 0, 5), Fault("hang", 1, 9, once=True)]
    for bad in ("boom:0:1", "raise:0", "raise:a:1", "exit:0:1:twice"):
        with pytest.raises(ConfigError, match="kind:rank:step"):
            parse_faults(bad)


def test_faults_fire_on_their_rank_and_step_once_only_once(tmp_path: Any) -> None:
    markers = os.path.join(str(tmp_path), "faults")
    faults = parse_faults("raise:1:3:once;raise:0:3")
    other = FaultInjector(faults, rank=2, marker_dir=markers)
    other.before_step(3)  # not its fault
    mine = FaultInjector(faults, rank=1, marker_dir=markers)
    mine.before_step(2)
    with pytest.raises(RuntimeError, match="rank 1 at step 3"):
        mine.before_step(3)
    FaultInjector(faults, rank=1, marker_dir=markers).before_step(3)  # after a restart
    assert os.listdir(markers) == ["raise-rank1-step3.fired"]
    repeat = FaultInjector(faults, rank=0, marker_dir=markers)
    for _ in range(2):
        with pytest.raises(RuntimeError):
            repeat.before_step(3)


def test_nccl_line_matches_the_pattern_supervisors_read() -> None:
    line = nccl_error_line(1)
    assert line.startswith("[rank1]:[E ProcessGroupNCCL.cpp:")
    assert "NCCL error: remote process exited or there was a network error" in line


def test_stop_request_from_a_real_signal() -> None:
    stop = StopRequest().install()
    try:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.requested and stop.signum == signal.SIGUSR1
        os.kill(os.getpid(), signal.SIGTERM)  # the first signal is kept
        assert stop.signum == signal.SIGUSR1
    finally:
        stop.uninstall()
    assert signal.getsignal(signal.SIGTERM) is not stop._handle


def test_lr_warmup_then_cosine() -> None:
    kw = {"lr": 1.0, "warmup_steps": 10, "total_steps": 110, "min_lr_ratio": 0.1}
    assert lr_at(1, **kw) == pytest.approx(0.1)
    assert lr_at(10, **kw) == pytest.approx(1.0)
    assert lr_at(60, **kw) == pytest.approx(0.55)
    assert lr_at(110, **kw) == pytest.approx(0.1)
    values = [lr_at(s, **kw) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_rng_capture_restore_round_trip() -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    random.gauss(0, 1)  # leaves a cached gaussian in python's state
    state = rng.capture()
    assert all(isinstance(t, torch.Tensor) for t in state.values())
    first = (random.random(), random.gauss(0, 1), np.random.rand(), np.random.randn(),
             torch.rand(3).tolist())
    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)
    rng.restore(state)
    assert (random.random(), random.gauss(0, 1), np.random.rand(), np.random.randn(),
            torch.rand(3).tolist()) == first
