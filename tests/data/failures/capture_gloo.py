"""Capture what real gloo ranks print when a peer dies (the classifier's real-world inputs).

Run from the repository root: ``python tests/data/failures/capture_gloo.py``. It starts two
ranks (torch.distributed, gloo, on localhost) that all-reduce in a loop, then either SIGKILLs
rank 1 mid-loop (``peer_killed``) or makes rank 1 raise (``rank_raises``). For each scenario it
writes ``real_gloo_<scenario>.json``: every output line and exit of both ranks, with the time
it was seen relative to the fault. The unit tests replay these through the classifier.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))

WORKER = r"""
import os, sys, time
import torch
import torch.distributed as dist
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", rank=rank, world_size=2)
t = torch.ones(1 << 20)
step = 0
while True:
    step += 1
    dist.all_reduce(t)
    if step == 5:
        print(f"rank {rank} steady", flush=True)
    if rank == 1 and step == 20 and os.environ["SCENARIO"] == "rank_raises":
        raise RuntimeError("boom: a user bug at step 20")
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _reader(rank: int, proc: subprocess.Popen[bytes], out: list[dict[str, object]],
            lock: threading.Lock) -> None:
    assert proc.stdout is not None
    for raw in iter(proc.stdout.readline, b""):
        with lock:
            out.append({"t": time.time(), "rank": rank, "kind": "line",
                        "detail": raw.decode("utf-8", "replace").rstrip("\n")})


def _waiter(rank: int, proc: subprocess.Popen[bytes], out: list[dict[str, object]],
            lock: threading.Lock) -> None:
    code = proc.wait()
    with lock:
        out.append({"t": time.time(), "rank": rank, "kind": "exit", "detail": f"returncode {code}",
                    "returncode": code})


def capture(scenario: str, timeout_s: float = 120.0) -> dict[str, object]:
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               WORLD_SIZE="2", SCENARIO=scenario, PYTHONUNBUFFERED="1")
    procs = [subprocess.Popen([sys.executable, "-c", WORKER], env=dict(env, RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL) for r in range(2)]
    events: list[dict[str, object]] = []
    lock = threading.Lock()
    readers = [threading.Thread(target=_reader, args=(r, p, events, lock), daemon=True)
               for r, p in enumerate(procs)]
    # One waiter per rank, so each exit carries the time it happened, not when we looked.
    waiters = [threading.Thread(target=_waiter, args=(r, p, events, lock), daemon=True)
               for r, p in enumerate(procs)]
    for t in readers + waiters:
        t.start()
    deadline = time.monotonic() + timeout_s
    while not any("steady" in str(e["detail"]) for e in list(events)):
        if time.monotonic() > deadline:
            raise RuntimeError(f"ranks never got steady: {events}")
        time.sleep(0.01)
    fault_t = time.time()
    if scenario == "peer_killed":
        procs[1].send_signal(signal.SIGKILL)
    for t in readers + waiters:
        t.join(timeout=timeout_s)
    timeline = sorted(events, key=lambda e: float(e["t"]))  # type: ignore[arg-type]
    for e in timeline:
        e["t"] = round(float(e["t"]) - fault_t, 6)  # type: ignore[arg-type]
    return {"scenario": scenario, "torch": __import__("torch").__version__,
            "fault": "SIGKILL rank 1" if scenario == "peer_killed" else "rank 1 raises RuntimeError",
            "events": timeline}


def main() -> int:
    for scenario in ("peer_killed", "rank_raises"):
        record = capture(scenario)
        path = os.path.join(HERE, f"real_gloo_{scenario}.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1)
            f.write("\n")
        print(f"wrote {path}: {len(record['events'])} events")  # type: ignore[arg-type]
    return 0


if __name__ == "__main__":
    sys.exit(main())
