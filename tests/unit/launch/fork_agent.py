"""The agent's side of the fork server in a process of its own (it becomes a child subreaper,
which the test process must not): ``python fork_agent.py WORK [started|early]`` (a server
started as a process of its own, or forked from this one). Prints one JSON line of what it
saw, then, with a rank still blocked (its config is a FIFO nobody writes), waits on stdin."""

from __future__ import annotations

import json
import os
import socket
import sys
import time

from slurmkit.launch import forkserver


def stat(pid: int) -> tuple[str, int]:
    """(comm, ppid) of a live process."""
    with open(f"/proc/{pid}/stat") as f:
        text = f.read()
    comm = text[text.index("(") + 1:text.rindex(")")]
    return comm, int(text[text.rindex(")") + 2:].split()[1])


def main(work: str, how: str) -> None:
    base = json.loads(os.environ["FORK_AGENT_BASE"])
    if how == "early":  # forked from this process, with its environment (the agent's own)
        os.environ.update(base)
        base = dict(os.environ)
        server = forkserver.ForkServer.fork_early(cwd=work, parent=os.getpid())
    else:
        server = forkserver.ForkServer.start(base, cwd=work, parent=os.getpid())
    seen: dict[str, object] = {"agent": os.getpid(), "server": server.pid, "why_not": server.why_not(180.0),
                               "server_stat": stat(server.pid)}
    ranks = []
    for rank in (3, 4):  # two ranks of one server, each the trainer refusing its config
        env = {**base, "RANK": str(rank), "SLURMKIT_CONFIG": os.path.join(work, "config.yaml"),
               "CUDA_VISIBLE_DEVICES": str(rank)}
        proc = server.fork(env, [], plan_json=None, verify="warn", timeout_s=60)
        code = proc.wait(timeout=120)
        ranks.append({"pid": proc.pid, "code": code, "out": proc.stdout.read().decode(errors="replace")})
    seen["ranks"] = ranks
    try:
        server.fork({**base, "OMP_NUM_THREADS": "9", "MALLOC_ARENA_MAX": "2"}, [], plan_json=None,
                    verify="warn", timeout_s=60)
    except forkserver.ForkServerError as exc:
        seen["mismatch"] = str(exc)
    # A request that is not one is answered with an error; the server goes on serving.
    r, w = os.pipe()
    socket.send_fds(server.sock, [b'{"v": 1, "set": {"A=B": "1"}, "unset": [], "args": []}'], [w])
    os.close(w)
    os.close(r)
    seen["garbage"] = json.loads(server.sock.recv(4096))
    # A rank that stays: its config is a FIFO, so the trainer blocks opening it.
    blocked = server.fork({**base, "RANK": "5", "SLURMKIT_CONFIG": os.path.join(work, "fifo")}, [],
                          plan_json=None, verify="warn", timeout_s=60)
    seen["blocked"] = blocked.pid
    deadline = time.monotonic() + 60  # it names itself once it is the agent's and tied to it
    while stat(blocked.pid)[0] != "skrank5" and time.monotonic() < deadline:
        time.sleep(0.01)
    seen["blocked_stat"] = stat(blocked.pid)
    seen["timeout"] = "none"
    try:
        blocked.wait(timeout=0.2)
    except Exception as exc:  # noqa: BLE001 - the type is what is checked
        seen["timeout"] = type(exc).__name__
    print(json.dumps(seen), flush=True)
    if sys.stdin.readline().strip() == "kill":
        os.kill(blocked.pid, 9)
        print(json.dumps({"killed_code": blocked.wait(timeout=60)}), flush=True)
        server.stop()
        print(json.dumps({"server_code": server.proc.returncode}), flush=True)
    else:
        sys.stdin.readline()  # the test SIGKILLs this process


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "started")
