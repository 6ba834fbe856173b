"""Ranks die with their agent (slurmkit.launch.tether): real processes, a real SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from slurmkit.launch import tether

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
ENV = {**os.environ, "PYTHONPATH": REPO}

# A stand-in agent: starts a rank through the tether (a program with no reason to end: sleep),
# prints the rank's pid once the rank runs the program, then waits to be killed.
AGENT = r"""
import os, subprocess, sys, time
from slurmkit.launch import tether
child = subprocess.Popen(tether.command(os.getpid(), ["sleep", "600"]), start_new_session=True)
while True:  # the tether execs in place: same pid, the program's command line
    with open(f"/proc/{child.pid}/cmdline", "rb") as f:
        if f.read().startswith(b"sleep"):
            break
    time.sleep(0.01)
print(child.pid, flush=True)
time.sleep(600)
"""


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie of init's is gone too
    except OSError:
        return True


def wait_until(what: str, cond, deadline_s: float = 60.0) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_rank_started_through_the_tether_dies_when_its_agent_is_sigkilled() -> None:
    agent = subprocess.Popen([sys.executable, "-c", AGENT], env=ENV, stdout=subprocess.PIPE, text=True)
    try:
        assert agent.stdout is not None
        rank = int(agent.stdout.readline())
        assert os.getpgid(rank) == rank  # its own session, as the agent starts ranks
        assert not gone(rank)
        os.kill(agent.pid, signal.SIGKILL)
        agent.wait()
        wait_until(f"rank {rank} to die with its agent", lambda: gone(rank))
    finally:
        agent.kill()
        agent.wait()


def test_the_tether_refuses_to_start_for_an_agent_that_is_not_its_parent() -> None:
    res = subprocess.run(tether.command(1, ["sleep", "600"]), env=ENV, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == tether.EXIT_ORPHANED
    assert "agent 1 is gone" in res.stderr


def test_the_tether_runs_the_program_in_place_and_says_what_it_cannot_run() -> None:
    rank = subprocess.Popen(tether.command(os.getpid(), [sys.executable, "-c", "import os; print(os.getpid())"]),
                            env=ENV, stdout=subprocess.PIPE, text=True)
    out, _ = rank.communicate(timeout=60)
    assert rank.returncode == 0 and int(out) == rank.pid  # exec'd in place: no process added
    res = subprocess.run(tether.command(os.getpid(), ["/nonexistent/program"]), env=ENV, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 127 and "cannot run '/nonexistent/program'" in res.stderr
    res = subprocess.run([sys.executable, "-m", tether.MODULE, "x", "--", "true"], env=ENV, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 2 and "usage:" in res.stderr
