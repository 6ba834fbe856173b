"""Capture real stack dumps of gloo ranks in a hang (the stack classifier's real-world inputs).

Run from the repository root with the project's virtualenv (py-spy installed in it):
``.venv/bin/python tests/data/stacks/capture_stacks.py``. For each scenario two ranks form a
gloo group on localhost: rank 0 enters a collective (all_reduce, barrier, broadcast, or the
gradient all-reduce inside a DDP backward; in ``backward_hook`` it sleeps in a tensor hook of its
own inside backward, no collective) while rank 1 sleeps inside ``load_batch`` (a stand-in for a
data loader stuck on a file system). Once both are there, it writes each rank's stack as
``faulthandler`` prints it on SIGUSR2 (``<scenario>.rank<N>.faulthandler.txt``) and as
``py-spy dump`` prints it (``<scenario>.rank<N>.pyspy.txt``); for ``all_reduce`` also py-spy's
``--nonblocking`` dump of rank 1 while it is SIGSTOPped (``all_reduce.rank1.stopped.pyspy.txt``).
The worker runs from ``worker.py`` in a temporary directory (py-spy's header quotes the
command line).

``trainer.rank<N>.faulthandler.txt`` are the reference trainer's own dumps (``$SLURMKIT_STACK_FILE``)
from tests/unit/launch/test_hang_stacks.py under a real NodeAgent: rank 1 in a ``data_stall``
fault (SIGSTOPped, continued, dumped), rank 0 in the gradient all-reduce of its DDP comm hook.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SCENARIOS = ("all_reduce", "barrier", "broadcast", "ddp_backward", "backward_hook")

WORKER = r"""
import faulthandler, os, signal, sys, threading, time
stacks = open(os.environ["STACK_FILE"], "w")
faulthandler.register(signal.SIGUSR2, file=stacks, all_threads=True)
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

rank, scenario = int(os.environ["RANK"]), os.environ["SCENARIO"]
dist.init_process_group("gloo", rank=rank, world_size=2)

def load_batch():
    print("ready", flush=True)
    time.sleep(3600)

def metrics_thread():
    while True:
        time.sleep(1.0)

def step(model):
    x = torch.ones(4, 8)
    if scenario == "all_reduce":
        t = torch.ones(1 << 10)
        print("ready", flush=True)
        dist.all_reduce(t)
    elif scenario == "barrier":
        print("ready", flush=True)
        dist.barrier()
    elif scenario == "broadcast":
        t = torch.ones(16)
        print("ready", flush=True)
        dist.broadcast(t, src=1)
    elif scenario == "ddp_backward":
        loss = model(x).sum()
        print("ready", flush=True)
        loss.backward()
    else:  # Python code of its own inside backward (a hook stuck on I/O): not a collective
        w = torch.ones(8, requires_grad=True)
        w.register_hook(slow_hook)
        print("ready", flush=True)
        (w * 2).sum().backward()

def slow_hook(grad):
    time.sleep(3600)
    return grad

threading.Thread(target=metrics_thread, name="metrics", daemon=True).start()
model = DistributedDataParallel(torch.nn.Linear(8, 8)) if scenario == "ddp_backward" else None
if rank == 1:
    load_batch()
else:
    step(model)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_ready(procs: list[subprocess.Popen[str]]) -> None:
    for p in procs:
        assert p.stdout is not None
        line = p.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError(f"rank did not get ready: {line!r}")


def _pyspy(pid: int, *, nonblocking: bool = False) -> str:
    exe = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    flags = ["--nonblocking"] if nonblocking else []
    out = subprocess.run([exe, "dump", *flags, "--pid", str(pid)], capture_output=True, text=True,
                         timeout=60)
    return out.stdout + out.stderr


def _faulthandler(proc: subprocess.Popen[str], path: str) -> str:
    os.kill(proc.pid, signal.SIGUSR2)
    size, deadline = -1, time.monotonic() + 10
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = os.path.getsize(path)
        if now and now == size:
            break
        size = now
    with open(path) as f:
        return f.read()


def capture(scenario: str) -> None:
    port = _free_port()
    procs, files = [], []
    script = os.path.join(tempfile.mkdtemp(prefix="stacks-"), "worker.py")
    with open(script, "w") as f:
        f.write(WORKER)
    for rank in (0, 1):
        path = os.path.join(HERE, f".{scenario}.rank{rank}.tmp")
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "SCENARIO": scenario, "STACK_FILE": path}
        procs.append(subprocess.Popen([sys.executable, script], env=env, stdout=subprocess.PIPE,
                                      text=True))
        files.append(path)
    try:
        _wait_ready(procs)
        time.sleep(2.0)  # rank 0 is inside the collective by now
        for rank, (proc, path) in enumerate(zip(procs, files)):
            _write(f"{scenario}.rank{rank}.pyspy.txt", _pyspy(proc.pid))
            _write(f"{scenario}.rank{rank}.faulthandler.txt", _faulthandler(proc, path))
        if scenario == "all_reduce":
            os.kill(procs[1].pid, signal.SIGSTOP)
            # py-spy cannot suspend a process that is stopped already: without --nonblocking it
            # fails ("Failed to suspend process"), with it the stack is read as it lies.
            _write("all_reduce.rank1.stopped.pyspy.txt", _pyspy(procs[1].pid, nonblocking=True))
    finally:
        for proc, path in zip(procs, files):
            proc.kill()
            proc.wait()
            os.unlink(path)
        shutil.rmtree(os.path.dirname(script))


def _write(name: str, text: str) -> None:
    with open(os.path.join(HERE, name), "w") as f:
        f.write(text)


if __name__ == "__main__":
    for name in sys.argv[1:] or SCENARIOS:
        capture(name)
