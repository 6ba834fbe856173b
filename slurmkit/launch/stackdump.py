"""The Python stacks of a hung generation's ranks, taken by their node's agent before it kills them.

Only on the failure path (a hang: the ranks are about to be killed anyway), only on this node,
only of this node's ranks, all ranks at once (one thread each) within ``STACK_TIMEOUT_S``.

How a rank's stack is taken:

- The reference trainer (``python -m slurmkit.train``) registers ``faulthandler`` for
  :data:`slurmkit.train.signals.STACK_SIGNAL` (SIGUSR2) before it imports torch, writing to its
  node-local ``$SLURMKIT_STACK_FILE``. faulthandler's handler is C code: it prints every thread's
  Python stack even while the main thread is blocked inside a C++ collective. SIGUSR2 goes only
  to a process that runs the trainer *and* whose /proc status says it catches SIGUSR2 (a rank
  still starting has no handler yet; SIGUSR2's default action would kill it). A stopped rank is
  continued first (its state T was recorded before), else the handler could not run.
- Any other program (``job.command``) never gets a signal from here: its own handler, or none
  (the default action of every spare signal is to terminate), is unknown. ``py-spy dump`` reads
  its stack from outside when py-spy is installed (on PATH or next to the agent's interpreter);
  ``--nonblocking`` for a stopped process, which py-spy cannot suspend again. Without py-spy the
  record says so.
- On a GPU, NCCL's flight recorder is dumped too: each rank's ProcessGroupNCCL reads a FIFO
  (``TORCH_FR_DEBUG_INFO_PIPE_FILE<rank>.pipe``, and the pre-2.7 name
  ``TORCH_NCCL_DEBUG_INFO_PIPE_FILE``, set by the agent in the node-local directory) and writes
  its trace to ``TORCH_FR_DUMP_TEMP_FILE<rank>`` when anything is written to it. Not shown
  working yet: on an H200 with torch 2.11 only the old names were set and no dump was made;
  ``tools/bench/gpu_check.py`` counts the dumps of a real NCCL hang (CPU: gloo has none).

The full stacks (at most ``STACK_LINES`` lines per rank) go into this node's ``hang_stacks``
ledger event and its log; node 0 gets only a verdict per node (slurmkit.supervise.stacks).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from slurmkit.supervise.classes import FailureClass
from slurmkit.supervise.classify import Evidence
from slurmkit.supervise.stacks import StackPlace, bounded_lines, node_verdicts, read_stack
from slurmkit.train.signals import STACK_SIGNAL

log = logging.getLogger(__name__)

STACK_TIMEOUT_S = 5.0  # the whole capture on one node (all ranks in parallel)
OUTPUT_BYTES = 64 * 1024  # of one rank's dump read back
FAULTHANDLER_WAIT_S = 2.0  # its dump takes milliseconds; past this, py-spy (if any) is tried
NCCL_DUMP_WAIT_S = 5.0  # for the flight recorder's files after its pipes were written (GPU)
TRAINER_MODULE = "slurmkit.train"


@dataclass(frozen=True)
class RankTarget:
    rank: int
    pid: int
    stack_file: str  # the trainer's $SLURMKIT_STACK_FILE
    nccl_pipe: str  # ProcessGroupNCCL's dump FIFO ("" if none)


@dataclass(frozen=True)
class RankStack:
    rank: int
    pid: int
    stopped: bool  # state T when looked at, before anything was sent
    source: str  # "faulthandler" | "py-spy" | "none"
    text: str  # the dump as the tool wrote it, or why there is none


def runs_reference_trainer(command: Sequence[str]) -> bool:
    """``... -m slurmkit.train ...``: the one program known to handle STACK_SIGNAL."""
    args = list(command)
    return any(a == "-m" and b == TRAINER_MODULE for a, b in zip(args, args[1:], strict=False))


def catches(pid: int, sig: int) -> bool:
    """Whether the process has a handler installed for ``sig`` (SigCgt in /proc/<pid>/status)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (int(sig) - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def find_pyspy(env: Mapping[str, str]) -> str | None:
    """py-spy on the ranks' PATH, else next to this interpreter (a virtualenv's bin/)."""
    found = shutil.which("py-spy", path=env.get("PATH", os.defpath))
    if found:
        return found
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return beside if os.access(beside, os.X_OK) else None


def _faulthandler(t: RankTarget, stopped: bool, deadline: float) -> str:
    try:
        before = os.path.getsize(t.stack_file)
    except OSError:
        before = 0
    if stopped:
        os.kill(t.pid, signal.SIGCONT)
    os.kill(t.pid, STACK_SIGNAL)
    size = -1
    # The handler writes the whole dump at once, in a few ms: done when it stops growing.
    while time.monotonic() < deadline:
        time.sleep(0.05)
        try:
            now = os.path.getsize(t.stack_file)
        except OSError:
            now = before
        if now > before and now == size:
            break
        size = now
    with open(t.stack_file, "rb") as f:
        f.seek(before)
        return f.read(OUTPUT_BYTES).decode("utf-8", "replace")


def _pyspy(exe: str, t: RankTarget, stopped: bool, deadline: float) -> str:
    argv = [exe, "dump", "--pid", str(t.pid), *(["--nonblocking"] if stopped else [])]
    try:
        res = subprocess.run(argv, capture_output=True, timeout=max(0.1, deadline - time.monotonic()),
                             stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return f"py-spy dump gave no stack within {STACK_TIMEOUT_S:g} s"
    except OSError as exc:
        return f"py-spy could not run: {exc}"
    return (res.stdout[:OUTPUT_BYTES] + res.stderr[:4096]).decode("utf-8", "replace")


def _one(t: RankTarget, *, trainer: bool, pyspy: str | None, stopped: bool, deadline: float) -> RankStack:
    try:
        continued = False
        if trainer and catches(t.pid, STACK_SIGNAL):
            text = _faulthandler(t, stopped, min(deadline, time.monotonic() + FAULTHANDLER_WAIT_S))
            if text.strip() or pyspy is None:
                return RankStack(t.rank, t.pid, stopped, "faulthandler",
                                 text or "no stack: the faulthandler dump stayed empty")
            continued = stopped  # an empty dump (a file replaced under it): py-spy's turn
        if pyspy is not None:
            return RankStack(t.rank, t.pid, stopped, "py-spy", _pyspy(pyspy, t, stopped and not continued, deadline))
        why = "no stack: py-spy is not installed (pip install py-spy)"
    except OSError as exc:  # the rank exited meanwhile, a file that could not be read
        why = f"no stack: {exc}"
    return RankStack(t.rank, t.pid, stopped, "none", why)


def trigger_nccl_dumps(targets: Sequence[RankTarget]) -> list[RankTarget]:
    """Write to each rank's flight-recorder FIFO that has a reader (a ProcessGroupNCCL)."""
    done = []
    for t in targets:
        try:
            if not t.nccl_pipe or not stat.S_ISFIFO(os.stat(t.nccl_pipe).st_mode):
                continue  # no FIFO (a CPU rank, torch without the recorder): never write a file
            fd = os.open(t.nccl_pipe, os.O_WRONLY | os.O_NONBLOCK)  # ENXIO: nobody reads it
        except OSError:
            continue
        try:
            os.write(fd, b"1")
            done.append(t)
        except OSError:
            pass
        finally:
            os.close(fd)
    return done


def capture(targets: Sequence[RankTarget], *, trainer: bool, pyspy: str | None,
            proc_state: Callable[[int], str], timeout_s: float = STACK_TIMEOUT_S) -> list[RankStack]:
    """Every target's stack, in parallel, within ``timeout_s``. Each rank's state is read first."""
    stopped = {t.rank: proc_state(t.pid) == "T" for t in targets}
    deadline = time.monotonic() + timeout_s
    out: dict[int, RankStack] = {}

    def work(t: RankTarget) -> None:
        out[t.rank] = _one(t, trainer=trainer, pyspy=pyspy, stopped=stopped[t.rank], deadline=deadline)

    threads = [threading.Thread(target=work, args=(t,), name=f"stack-rank{t.rank}", daemon=True)
               for t in targets]
    for th in threads:
        th.start()
    for th in threads:
        th.join(max(0.0, deadline - time.monotonic()) + 1.0)
    return [out.get(t.rank) or RankStack(t.rank, t.pid, stopped[t.rank], "none",
                                         f"no stack within {timeout_s:g} s") for t in targets]


def wait_nccl_dumps(triggered: Sequence[RankTarget], temp_stem: str, timeout_s: float = NCCL_DUMP_WAIT_S) -> None:
    """Until each triggered rank's flight-recorder file exists, at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    paths = [f"{temp_stem}{t.rank}" for t in triggered]
    while paths and time.monotonic() < deadline:
        paths = [p for p in paths if not os.path.exists(p)]
        time.sleep(0.1)


def report(stacks: Sequence[RankStack], *, node: str, generation: int,
           append: Callable[..., object]) -> list[Evidence]:
    """This node's ``hang_stacks`` ledger event and log lines (the full, bounded stacks), and
    the verdicts it posts to node 0 (slurmkit.supervise.stacks.node_verdicts)."""
    readings = [(s.rank, read_stack(s.text, stopped=s.stopped, pid=s.pid)) for s in stacks]
    records = []
    for s, (_, r) in zip(stacks, readings, strict=True):
        lines = bounded_lines(s.text, pid=s.pid)
        records.append({"rank": s.rank, "pid": s.pid, "place": r.place.value, "source": s.source,
                        "where": r.where, "wait": r.wait, "lines": lines})
        log.warning("hang: rank %d (pid %d) %s [%s]%s\n%s", s.rank, s.pid, r.place.value, s.source,
                    f" waiting in {r.wait}" if r.wait else "", "\n".join(lines))
    append("hang_stacks", generation=generation, node=node, ranks=records)
    now = time.time()
    evidence = []
    for rank, r in node_verdicts(readings):
        what = {StackPlace.STOPPED: "process stopped (state T)", StackPlace.OUTSIDE: "not inside a collective",
                StackPlace.COLLECTIVE: f"inside a collective ({r.wait})"}[r.place]
        evidence.append(Evidence(now, node, rank, "stack", FailureClass.HANG, f"{what}: {r.where}", place=r.place))
    return evidence
