"""A stop signal (time-limit warning, SIGTERM) while ranks start up: real processes, real signals.

The reference trainer gets the warning while it is still importing torch (held there by an
import hook, so the signal lands inside the import every time): it must keep it for its first
step boundary and leave with 95, not die of SIGUSR1's default action (-10, read as a crash).
A NodeAgent that got the warning starts no generation after it: ranks started then would get
the signal before any handler, and the allocation ends anyway.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from slurmkit.config import compose
from slurmkit.contract import EXIT_CHECKPOINTED_ON_SIGNAL
from slurmkit.launch.agent import NodeAgent
from slurmkit.launch.context import NodeContext
from slurmkit.ledger.ledger import Ledger
from slurmkit.failures.classes import FailureClass
from slurmkit.launch.localranks import free_port, write_config

# sitecustomize for the rank: `import torch` first writes IMPORTING and then waits for GO, so the
# test signals the rank while torch is being imported, on every run (no race with a fast import).
HOOK = """
import importlib.abc, os, sys, time

class _Hold(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            open(os.environ["HOLD_DIR"] + "/IMPORTING", "w").close()
            while not os.path.exists(os.environ["HOLD_DIR"] + "/GO"):
                time.sleep(0.01)
        return None

if os.environ.get("HOLD_DIR"):
    sys.meta_path.insert(0, _Hold())
"""


def _wait_for(path: Path, proc: subprocess.Popen[bytes], bound_s: float = 120) -> None:
    """Until ``path`` exists (the rank got there); fails early if the rank ended first."""
    end = time.monotonic() + bound_s
    while not path.exists():
        assert proc.poll() is None, f"rank ended with {proc.returncode} before {path.name}"
        assert time.monotonic() < end, f"no {path.name} after {bound_s} s"
        time.sleep(0.01)


def test_a_warning_while_the_trainer_imports_torch_is_kept_for_its_first_step(tmp_path: Path) -> None:
    hold = tmp_path / "hold"
    hold.mkdir()
    (hold / "sitecustomize.py").write_text(HOOK)
    cfg = write_config(str(tmp_path / "config.yaml"), {
        "model": {"dim": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 2, "ffn_dim": 64,
                  "vocab_size": 64, "max_seq_len": 16},
        "train": {"steps": 1000, "seq_len": 8, "micro_batch": 2}})
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SLURMKIT_")},
           "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "SLURMKIT_CONFIG": cfg,
           "SLURMKIT_RUN_DIR": str(tmp_path), "HOLD_DIR": str(hold),
           "PYTHONPATH": os.pathsep.join([str(hold), *(p for p in sys.path if p)])}
    proc = subprocess.Popen([sys.executable, "-m", "slurmkit.train"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    try:
        _wait_for(hold / "IMPORTING", proc)
        os.kill(proc.pid, signal.SIGUSR1)  # the time-limit warning, as the agent forwards it
        (hold / "GO").touch()
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = out.decode(errors="replace")
    assert proc.returncode == EXIT_CHECKPOINTED_ON_SIGNAL, text  # -10 on a handler installed too late
    assert "stopped at step 1" in text


def _agent(tmp_path: Path) -> NodeAgent:
    cfg = compose(["+exp=tiny", "health=off", "topology.enabled=false",
                   "job.command=[python,-c,\"print('started')\"]"])
    ctx = NodeContext(node_rank=0, num_nodes=1, node_name="n0", nodes=("n0",), job_id="4242",
                      restart_count=0, master_addr="127.0.0.1", executor="slurm")
    (tmp_path / "local").mkdir(exist_ok=True)
    (tmp_path / "run").mkdir(exist_ok=True)
    env = {"SLURMKIT_NODE_LOCAL_DIR": str(tmp_path / "local"), "PATH": "/usr/bin:/bin",
           "PYTHONPATH": ":".join(p for p in sys.path if p)}
    return NodeAgent(str(tmp_path / "run"), cfg, ctx, env,
                     Ledger(str(tmp_path / "run" / "ledger.jsonl"), source="agent:n0"))


def warn(node: NodeAgent) -> None:
    """A real SIGUSR1 to this process with the agent's handlers installed (the handler runs in
    this, the main, thread); waits until the agent holds it, then restores pytest's handlers."""
    before = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGTERM)}
    try:
        node.install_signal_handlers()
        os.kill(os.getpid(), signal.SIGUSR1)
        end = time.monotonic() + 60
        while node.signal_kind is None and time.monotonic() < end:
            time.sleep(0.001)
    finally:
        for s, h in before.items():
            signal.signal(s, h)


def test_an_agent_that_got_the_warning_starts_no_new_generation(tmp_path: Path) -> None:
    node = _agent(tmp_path)
    warn(node)
    assert node.signal_kind == "time_limit"
    node.start(gen=1, slot=0, port=free_port(), master_addr="127.0.0.1")
    assert node.procs == []  # nothing signalled while starting up, nothing to crash
    ev = node.poll(1)
    assert ev is not None and ev.cls == FailureClass.TIME_LIMIT and ev.rank == -1
    assert "before generation 1" in ev.detail
    node.ledger.close()


def test_an_agent_without_a_warning_starts_its_ranks(tmp_path: Path) -> None:
    # The same agent as above, no signal: its ranks start (the test above is not vacuous).
    node = _agent(tmp_path)
    node.start(gen=0, slot=0, port=free_port(), master_addr="127.0.0.1")
    assert len(node.procs) == node.ranks_per_node >= 1
    assert all(p.proc.wait() == 0 for p in node.procs)
    node.join_output()
    assert node.poll(0) is None
    node.ledger.close()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_ranks_that_ignore_the_warning_are_stopped_in_time_for_the_requeue(tmp_path: Path) -> None:
    # A program that ignores SIGUSR1 would train into the time limit: Slurm ends the job TIMEOUT
    # and never requeues it. Once the budget after the warning is spent, the agent ends the
    # generation itself (time_limit: node 0 requeues, uncounted).
    cfg = compose(["+exp=tiny", "health=off", "topology.enabled=false", "job.signal_lead_s=120",
                   "job.command=[python,-c,\"import signal,time; signal.signal(signal.SIGUSR1, signal.SIG_IGN); "
                   "print('ignoring', flush=True); time.sleep(600)\"]"])
    ctx = NodeContext(node_rank=0, num_nodes=1, node_name="n0", nodes=("n0",), job_id="4242",
                      restart_count=0, master_addr="127.0.0.1", executor="slurm")
    (tmp_path / "local").mkdir()
    (tmp_path / "run").mkdir()
    env = {"SLURMKIT_NODE_LOCAL_DIR": str(tmp_path / "local"), "PATH": "/usr/bin:/bin",
           "PYTHONPATH": ":".join(p for p in sys.path if p)}
    clock = Clock()
    node = NodeAgent(str(tmp_path / "run"), cfg, ctx, env,
                     Ledger(str(tmp_path / "run" / "ledger.jsonl"), source="agent:n0"), clock=clock)
    node.start(gen=0, slot=0, port=free_port(), master_addr="127.0.0.1")
    try:
        for p in node.procs:
            end = time.monotonic() + 120
            while "ignoring" not in Path(p.log_path).read_text():
                assert p.poll() is None and time.monotonic() < end
                time.sleep(0.01)
        warn(node)  # forwarded to each rank, which ignores it
        clock.now += 89  # within the budget (90 s of a 120 s lead): the ranks may still save
        assert node.poll(0) is None
        clock.now += 2
        ev = node.poll(0)
        assert ev is not None and ev.cls == FailureClass.TIME_LIMIT and "after the time-limit warning" in ev.detail
        assert all(p.poll() is None for p in node.procs)  # alive: they did ignore the warning
    finally:
        node.stop()
        node.ledger.close()
