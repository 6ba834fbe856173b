"""Hostile clients of the stores (issue 34, item 10): the checkpoint coordinator refuses values
not signed with the run's secret, rank 0's store listens on MASTER_ADDR only, and what a
stranger puts in the agents' store is capped before the agents read it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from slurmkit.store.coord import Coordinator, ForgedValueError, coord_secret
from tests.unit.store.rank_threads import run_ranks, store_clients

SECRET = b"s" * 32


def _world(n: int, secret: bytes | None = SECRET) -> tuple[Any, list[Coordinator], Any]:
    """Coordinators of ``n`` ranks, and a stranger's client under the same key prefix (the
    worst case: a stranger who learned the prefix)."""
    server, clients = store_clients(n + 1, "t/", 20.0)
    coords = [Coordinator(c, r, n, secret=secret, label="t/") for r, c in enumerate(clients[:n])]
    return server, coords, clients[n]


def _forged_broadcast(stranger: Any, coords: list[Coordinator]) -> Any:
    # the next broadcast's key, squatted before the root writes: a stranger's step list
    stranger.set("1/b", json.dumps({"steps": [999]}))
    return coords[1].broadcast_json(None)


def _replayed_value(stranger: Any, coords: list[Coordinator]) -> Any:
    # a genuinely signed value, copied from the key it was signed for to another one
    run_ranks(2, lambda r: coords[r].broadcast_json({"verdict": "ok"} if r == 0 else None))
    stranger.set("2/b", bytes(stranger.get("1/b")))
    return coords[1].broadcast_json(None)


def _forged_gather_line(stranger: Any, coords: list[Coordinator]) -> Any:
    # a line claiming rank 1's record (its files) appended before the ranks gather
    stranger.append("1/a", json.dumps([1, {"files": ["/etc/passwd"]}]) + "\n")
    out = run_ranks(2, lambda r: coords[r].gather_json({"files": [f"rank{r}"]}))
    return out[0]


def _forged_verdict(stranger: Any, coords: list[Coordinator]) -> Any:
    # the agreement's result written under a stranger's hand before the root computes it
    stranger.set("1/r", json.dumps({"ok": True, "bad": []}))
    return coords[1].reduce_json(None, lambda xs: xs)


# (case, attack, expected: an exception's text, or the value the ranks must see)
CASES: list[tuple[str, Callable[[Any, list[Coordinator]], Any], str | object]] = [
    ("item10b-forged-step-list", _forged_broadcast, "not signed with this run's token"),
    ("item10b-replayed-under-another-key", _replayed_value, "not signed with this run's token"),
    ("item10b-forged-verdict", _forged_verdict, "not signed with this run's token"),
    ("item10b-forged-gather-line-dropped", _forged_gather_line,
     [{"files": ["rank0"]}, {"files": ["rank1"]}]),
]


@pytest.mark.parametrize("case,attack,expected", CASES, ids=[c[0] for c in CASES])
def test_coordinator_refuses_what_a_stranger_writes(case: str, attack: Callable[..., Any],
                                                    expected: Any) -> None:
    _, coords, stranger = _world(2)
    if isinstance(expected, str):
        with pytest.raises(ForgedValueError, match=expected):
            attack(stranger, coords)
    else:
        assert attack(stranger, coords) == expected


def test_coordinator_secret_comes_from_the_run_token_and_changes_per_generation(
        tmp_path: Path) -> None:
    env = {"SLURMKIT_RUN_DIR": str(tmp_path), "SLURMKIT_ATTEMPT": "7-0",
           "SLURMKIT_GENERATION": "0", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    first = coord_secret(env)
    assert first is not None and first == coord_secret(env)
    assert (tmp_path / "rdzv" / "token").stat().st_mode & 0o777 == 0o600
    assert coord_secret({**env, "SLURMKIT_GENERATION": "1"}) != first
    assert coord_secret({}) is None


_RANK0 = """
import socket, sys
from datetime import timedelta
from slurmkit.train import parallel
env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": sys.argv[1], "RANK": "0", "WORLD_SIZE": "1"}
store = parallel.rank_store(env, 0, 1, timedelta(seconds=20))
store.set("k", "v")
other = sys.argv[2]
try:
    socket.create_connection((other, int(sys.argv[1])), timeout=5).close()
    print("reachable")
except OSError:
    print("refused")
"""


def _other_address() -> str | None:
    """An address of this host that is not loopback (None when there is none)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: only the route is looked up
            addr = str(s.getsockname()[0])
        except OSError:
            return None
    return None if addr.startswith("127.") else addr


def test_rank0_store_listens_on_master_addr_only() -> None:
    """item 10a: torch's env:// server listens on every interface; rank_store binds
    MASTER_ADDR (here loopback), so the node's other address refuses the connection."""
    other = _other_address()
    if other is None:
        pytest.skip("this host has no address besides loopback")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = subprocess.run([sys.executable, "-c", _RANK0, str(port), other], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "refused"


_FLOOD = """
import json, os
from datetime import timedelta
import torch.distributed as dist
from slurmkit.launch import rendezvous

def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) << 10 for l in f if l.startswith("VmRSS"))

sock = rendezvous.listen_socket("127.0.0.1")
port = sock.getsockname()[1]
pid = rendezvous.serve_capped(sock, None, 32 << 20)
agent = dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=20), use_libuv=True)
agent.set("mine", "1")
before = rss()
stranger = dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=20), use_libuv=True)
stored = 0
for i in range(32):  # 128 MiB offered, 4 MiB a value
    try:
        stranger.set(f"junk{i}", b"x" * (4 << 20))
        stranger.get(f"junk{i}")
        stored += 4
    except Exception:
        break
print(json.dumps({"stored_mib": stored, "agent_grew_mib": (rss() - before) >> 20,
                  "server_alive": os.waitpid(pid, os.WNOHANG) == (0, 0),
                  "agent_reads": bytes(agent.get("mine")).decode()}))
"""


def test_a_stranger_cannot_grow_node0s_agent_through_its_store() -> None:
    """item 10c: the agents' store is served by a child process capped at STORE_CAP_BYTES (32
    MiB here): a stranger's 128 MiB flood stops at the cap, the agent's process does not grow,
    the server survives and the agent still reads its own value. (Before: the server lived in
    the agent, which grew by every byte offered.)"""
    out = subprocess.run([sys.executable, "-c", _FLOOD], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["stored_mib"] <= 32 and res["agent_grew_mib"] < 16
    assert res["server_alive"] and res["agent_reads"] == "1"


_SERVE_AND_WAIT = r"""
import os, signal, sys
from slurmkit.launch import rendezvous
pid = rendezvous.serve_capped(rendezvous.listen_socket("127.0.0.1"), None, 32 << 20)
with open(f"/proc/{pid}/comm") as f:
    print(pid, f.read().strip(), flush=True)
if sys.argv[1] == "wait":
    signal.pause()  # until the store's server ends and takes this process with it
"""


def _serve(mode: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", _SERVE_AND_WAIT, mode], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})


def test_node0s_agent_ends_with_its_store_server_and_only_then() -> None:
    """The store's server and node 0's agent live and die together. Killed alone (the OOM killer,
    a chaos tool that took it for the agent), the server takes the agent with it: an agent left
    beside a dead store requeued the run while the other nodes, which saw node 0 lost, requeued
    it too (two successor jobs, seen in the chaos campaign's seed 213). And an agent that ends
    normally ends with its own exit code, its server after it."""
    from slurmkit.launch.rendezvous import STORE_COMM

    proc = _serve("wait")
    assert proc.stdout is not None
    server, comm = proc.stdout.readline().split()
    assert comm == STORE_COMM  # the tools that look for the agent can tell its server apart
    os.kill(int(server), signal.SIGKILL)
    proc.wait(timeout=120)
    assert proc.returncode == -signal.SIGKILL
    assert "node 0's agent ends with it" in proc.stderr.read()

    proc = _serve("exit")
    assert proc.stdout is not None
    server = proc.stdout.readline().split()[0]
    proc.wait(timeout=120)
    assert proc.returncode == 0, proc.stderr.read()[-2000:]
    deadline = time.monotonic() + 120
    while _running(server) and time.monotonic() < deadline:
        time.sleep(0.05)  # the server sees the agent's pipe close, then exits
    assert not _running(server)


def _running(pid: str) -> bool:
    """Alive and not a zombie (whoever reaps orphans here may be slow to)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
