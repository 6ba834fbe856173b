"""Rank processes: a warning reaches the rank itself, a stop reaches everything it started."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from slurmkit.launch.ranks import spawn_rank, stop_ranks

# The rank traps SIGUSR1 (as the trainer does) and starts a child that does not (as a DataLoader
# worker does not); it prints the child's pid, then each SIGUSR1 it gets.
RANK = r"""
import os, signal, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
signal.signal(signal.SIGUSR1, lambda *_: print("rank: SIGUSR1", flush=True))
print(f"child {child.pid}", flush=True)
while True:
    time.sleep(0.05)
"""


def _wait_for(path: Path, text: str, timeout_s: float = 60) -> str:
    deadline = time.monotonic() + timeout_s
    while text not in (content := path.read_text() if path.exists() else ""):
        assert time.monotonic() < deadline, f"{text!r} never appeared in {path}: {content!r}"
        time.sleep(0.02)
    return content


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_a_warning_reaches_the_rank_but_not_its_children_and_a_stop_reaches_both(tmp_path: Path) -> None:
    log = tmp_path / "rank0.log"
    rank = spawn_rank([sys.executable, "-c", RANK], dict(os.environ), rank=0, local_rank=0, log_path=str(log))
    try:
        child = int(_wait_for(log, "child ").split("child ", 1)[1].split()[0])
        rank.notify(signal.SIGUSR1)
        _wait_for(log, "rank: SIGUSR1")
        assert rank.poll() is None and _alive(child), "the warning killed the rank or its child"
    finally:
        stop_ranks([rank], grace_s=0.0, sleep=time.sleep, clock=time.monotonic)
    deadline = time.monotonic() + 60
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not _alive(child), "stopping the rank left its child running"
