"""The fork server (slurmkit.launch.forkserver) with real processes: one server imports the
trainer once and forks ranks that are the agent's children (their exit status read by the
agent), named ``skrank<RANK>``, with their own output; a request it must not obey is refused;
a rank forked from it dies with its agent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from slurmkit.contract import CONFIG_ERROR_MARKER, EXIT_CONFIG_ERROR
from slurmkit.launch import forkserver

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
AGENT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fork_agent.py")
BASE = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": REPO, "RANK": "0", "WORLD_SIZE": "8",
        "SLURMKIT_GENERATION": "1", "OMP_NUM_THREADS": "1"}


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_until(what: str, cond, deadline_s: float = 60.0) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def start_agent(tmp_path, how: str = "started") -> tuple[subprocess.Popen[str], dict]:
    (tmp_path / "config.yaml").write_text("- not a mapping\n")  # the trainer refuses it, naming it
    os.mkfifo(tmp_path / "fifo")
    agent = subprocess.Popen([sys.executable, AGENT, str(tmp_path), how], cwd=REPO, text=True,
                             env={**os.environ, "FORK_AGENT_BASE": json.dumps(BASE), "PYTHONPATH": REPO},
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert agent.stdout is not None
    line = agent.stdout.readline()
    assert line, agent.communicate(timeout=60)
    return agent, json.loads(line)


@pytest.mark.parametrize("how", ["started", "early"])
def test_ranks_forked_from_one_server_are_the_agents_children(tmp_path, how: str) -> None:
    agent, seen = start_agent(tmp_path, how)
    try:
        assert seen["why_not"] is None, seen
        # started or forked, the server names itself and is the agent's child
        assert seen["server_stat"] == ["skforkserver", seen["agent"]], seen
        (r3, r4) = seen["ranks"]
        assert r3["pid"] != r4["pid"] and seen["server"] not in (r3["pid"], r4["pid"])
        for r in (r3, r4):  # the exit status the trainer gave, read by the agent's waitpid
            assert r["code"] == EXIT_CONFIG_ERROR, r
            assert f"{CONFIG_ERROR_MARKER}Detected: {tmp_path / 'config.yaml'} is not a mapping" in r["out"], r
        # read at start-up: never forked; from a server forked from the agent (which loaded
        # OpenMP with its own environment) the rank applies OMP_NUM_THREADS itself
        assert "MALLOC_ARENA_MAX" in seen["mismatch"], seen
        assert ("OMP_NUM_THREADS" in seen["mismatch"]) == (how == "started"), seen
        assert "error" in seen["garbage"] and "pid" not in seen["garbage"], seen
        # the blocked rank: named after its rank, a child of the agent (not of the server)
        assert seen["blocked_stat"] == ["skrank5", seen["agent"]], seen
        assert seen["timeout"] == "TimeoutExpired", seen
        assert agent.stdin is not None
        agent.stdin.write("kill\n")
        agent.stdin.flush()
        assert agent.stdout is not None
        assert json.loads(agent.stdout.readline()) == {"killed_code": -9}
        # stop() closes the socket first: the server leaves by itself (0) or is killed (-9)
        assert json.loads(agent.stdout.readline())["server_code"] in (0, -9)
        assert agent.wait(timeout=60) == 0
    finally:
        agent.kill()
        agent.wait()


@pytest.mark.parametrize("how", ["started", "early"])
def test_a_forked_rank_and_the_server_die_with_their_agent(tmp_path, how: str) -> None:
    agent, seen = start_agent(tmp_path, how)
    try:
        rank, server = seen["blocked"], seen["server"]
        assert alive(rank) and alive(server)
        agent.kill()  # SIGKILL: nothing of the agent runs any more
        agent.wait(timeout=60)
        wait_until("the forked rank and the server to end", lambda: not alive(rank) and not alive(server))
    finally:
        agent.kill()
        agent.wait()


def test_the_server_does_not_fork_beside_a_python_thread() -> None:
    stop = threading.Event()
    t = threading.Thread(target=stop.wait, name="busy-thread", daemon=True)
    t.start()
    try:
        why = str(forkserver.why_not_fork())
        # the first three it sees are named (threads an earlier test left behind may come first)
        others = [x.name for x in threading.enumerate() if x is not threading.main_thread()]
        assert why.startswith("Python threads run besides the main one") and "busy-thread" in others, why
        assert all(name in why for name in others[:3]), (why, others)
    finally:
        stop.set()
        t.join()


def test_only_identity_and_devices_may_differ() -> None:
    started = {**BASE, "MASTER_PORT": "0"}
    assert forkserver.mismatch(started, {**started, "RANK": "7", "LOCAL_RANK": "3", "CUDA_VISIBLE_DEVICES": "3",
                                         "UCX_NET_DEVICES": "mlx5_3:1", "NCCL_IB_HCA": "=mlx5_3",
                                         "SLURMKIT_HEARTBEAT_FILE": "/dev/shm/x"}) == []
    assert forkserver.mismatch(started, {**started, "OMP_NUM_THREADS": "4"}) == ["OMP_NUM_THREADS"]
    assert forkserver.mismatch(started, {**started, "LD_PRELOAD": "/x.so"}) == ["LD_PRELOAD"]


@pytest.mark.parametrize("argv", [[], ["x", "3"], ["12"]])
def test_the_server_refuses_a_bad_command_line(argv) -> None:
    res = subprocess.run([sys.executable, "-m", forkserver.MODULE, *argv], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 2 and "usage:" in res.stderr


@pytest.mark.parametrize("late, loaded", [(("torch._dynamo", "s3fs"), True), (("torch._dynamo",), False)])
def test_the_server_imports_s3fs_ahead_only_when_asked(tmp_path, late, loaded) -> None:
    """The agent leaves s3fs out of the late imports for a run without an object tier. Seen from
    outside: s3fs's own C extensions (aiohttp's multidict) mapped into the server or not."""
    server = forkserver.ForkServer.start(BASE, cwd=str(tmp_path), parent=os.getpid(), subreaper=False,
                                         late_imports=late)
    try:
        assert server.why_not(180.0) is None  # ready: every late import done
        with open(f"/proc/{server.pid}/maps") as f:
            maps = f.read()
        assert ("multidict" in maps) == loaded, [ln for ln in maps.splitlines() if "site-packages" in ln][-5:]
    finally:
        server.stop()
