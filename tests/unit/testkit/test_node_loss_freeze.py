"""kill-node's freeze: a process forked between a listing and the kill is found and stopped too
(real processes, real signals)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from testkit import node_loss


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_a_child_the_first_listing_missed_is_stopped_before_anything_is_killed() -> None:
    parent = subprocess.Popen([sys.executable, "-c", "import os, time\nif os.fork() == 0:\n    time.sleep(60)\n"
                               "else:\n    print(flush=True)\n    time.sleep(60)\n"], stdout=subprocess.PIPE)
    try:
        assert parent.stdout is not None and parent.stdout.readline() == b"\n"  # the child exists now
        with open(f"/proc/{parent.pid}/task/{parent.pid}/children") as f:
            (child,) = [int(x) for x in f.read().split()]
        calls = []

        def find() -> list[node_loss.NodeProcess]:  # the first listing is stale: the parent alone
            calls.append(1)
            pids = [parent.pid] if len(calls) == 1 else [parent.pid, child]
            return [p for p in (node_loss.read_process(pid) for pid in pids) if p is not None]
        procs = node_loss.freeze(find)
        assert sorted(p.pid for p in procs) == sorted([parent.pid, child]) and len(calls) == 3, calls
        deadline = time.monotonic() + 30
        while {_state(parent.pid), _state(child)} != {"T"} and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _state(parent.pid) == _state(child) == "T"
        assert sorted(node_loss.kill(procs)) == sorted([parent.pid, child])
        assert parent.wait(timeout=30) == -signal.SIGKILL
    finally:
        for pid in (parent.pid,):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        parent.wait(timeout=30)
