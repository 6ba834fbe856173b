"""The supervisor's eyes on real processes: two gloo ranks started the way the node agent starts
them (spawn_rank tees lines and reports exits to a RankMonitor), then a real fault."""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from collections.abc import Callable

import pytest

from slurmkit.launch.ranks import RankProcess, spawn_rank, stop_ranks
from slurmkit.failures.classes import FailureClass
from slurmkit.failures.classify import root_cause
from slurmkit.launch.monitor import RankMonitor

pytestmark = [pytest.mark.integration, pytest.mark.realtime]

WORKER = r"""
import os, time
import torch
import torch.distributed as dist
from slurmkit.train.heartbeat import Heartbeat
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", rank=rank, world_size=2)
hb = Heartbeat.from_env(os.environ, rank)
t = torch.ones(1 << 16)
step = 0
while True:
    step += 1
    dist.all_reduce(t)
    hb.beat(step)
    time.sleep(0.02)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(cond: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.02)


def start(tmp_path, monitor: RankMonitor) -> list[RankProcess]:
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), SLURMKIT_GENERATION="0", PYTHONUNBUFFERED="1",
                   SLURMKIT_HEARTBEAT_FILE=str(tmp_path / f"rank{rank}.json"))
        p = spawn_rank([sys.executable, "-c", WORKER], env, rank=rank, local_rank=rank,
                       log_path=str(tmp_path / f"rank{rank}.log"), sink=monitor.on_line,
                       on_exit=monitor.on_exit)
        monitor.add_rank(rank, p.pid, env["SLURMKIT_HEARTBEAT_FILE"])
        procs.append(p)
    return procs


def steady(monitor: RankMonitor) -> Callable[[], bool]:
    def check() -> bool:
        beats = monitor.poll()
        return len(beats) == 2 and all(int(str(b["step"])) >= 5 for b in beats.values())
    return check


def test_sigkilled_rank_is_the_root_cause(tmp_path) -> None:
    monitor = RankMonitor("localhost", 0, heartbeat_timeout_s=60.0, startup_timeout_s=120.0)
    procs = start(tmp_path, monitor)
    try:
        wait_for(steady(monitor))
        procs[1].proc.send_signal(signal.SIGKILL)
        wait_for(lambda: monitor.triggered is not None and procs[0].poll() is not None)
        procs[0].reader.join(timeout=10)
    finally:
        stop_ranks(procs, grace_s=3.0, sleep=time.sleep, clock=time.monotonic)
    failure = root_cause(monitor.evidence)
    assert failure is not None
    assert (failure.rank, failure.cls, failure.evidence) == (1, FailureClass.RANK_CRASH, "returncode -9")
    survivor = {e.cls for e in monitor.evidence if e.rank == 0}
    assert FailureClass.PEER_FAILURE in survivor  # gloo told rank 0 that its peer went away


def test_stopped_rank_is_the_root_of_a_hang(tmp_path) -> None:
    monitor = RankMonitor("localhost", 0, heartbeat_timeout_s=1.0, startup_timeout_s=120.0)
    procs = start(tmp_path, monitor)
    try:
        wait_for(steady(monitor))
        os.kill(procs[1].pid, signal.SIGSTOP)  # rank 0 then blocks in all_reduce behind it

        def both_reported() -> bool:
            monitor.poll()
            return {e.rank for e in monitor.evidence if e.cls == FailureClass.HANG} == {0, 1}
        wait_for(both_reported, timeout_s=30.0)
    finally:
        stop_ranks(procs, grace_s=3.0, sleep=time.sleep, clock=time.monotonic)
    failure = root_cause(monitor.evidence)  # with the exits our own stop_ranks caused
    assert failure is not None and (failure.rank, failure.cls) == (1, FailureClass.HANG)
    assert "state T" in failure.evidence
