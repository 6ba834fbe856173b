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
  ``tools/bench/gpu_check.py`` counts the dumps of a real NCCL hang (gloo has no such FIFO).
- The reference trainer serves a FIFO of its own for any backend (slurmkit.train.flightrec) and
  writes the recorder's trace as JSON. Each rank's summary (the last collective it issued, the
  last that completed) goes into the ledger with its stack, and corrects the stack's reading: a
  rank outside any collective call with a collective issued and not completed waits for its
  peers (the GPU case, where it blocks in a device wait).

The full stacks (at most ``STACK_LINES`` lines per rank) go into this node's ``hang_stacks``
ledger event and its log; node 0 gets only a verdict per node (slurmkit.failures.stacks).
"""

from __future__ import annotations

import contextlib
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
from dataclasses import dataclass, replace

from slurmkit.failures.classes import FailureClass
from slurmkit.failures.classify import Evidence
from slurmkit.failures.stacks import StackPlace, StackReading, bounded_lines, node_verdicts, read_stack
from slurmkit.train.signals import STACK_SIGNAL
from slurmkit.untrusted import open_regular, parse_json, read_regular

log = logging.getLogger(__name__)

STACK_TIMEOUT_S = 5.0  # the whole capture on one node (all ranks in parallel)
OUTPUT_BYTES = 64 * 1024  # of one rank's dump read back
FAULTHANDLER_WAIT_S = 2.0  # its dump takes milliseconds; past this, py-spy (if any) is tried
NCCL_DUMP_WAIT_S = 5.0  # for the flight recorder's files after its pipes were written (GPU)
TRACE_WAIT_S = 5.0  # for the trainer's own flight-recorder traces (any backend)
TRACE_BYTES = 32 * 1024 * 1024  # of one trace read back: 2,000 entries with their frames fit
TRACE_DEPTH = 16  # torch's trace nests 5 deep (entries, an entry, its frames, a frame)


@dataclass(frozen=True)
class RankTarget:
    rank: int
    pid: int
    stack_file: str  # the trainer's $SLURMKIT_STACK_FILE
    nccl_pipe: str  # ProcessGroupNCCL's dump FIFO ("" if none)
    trace_pipe: str = ""  # the reference trainer's flight-recorder FIFO (slurmkit.train.flightrec)
    trace_file: str = ""  # where it writes the trace, as JSON


@dataclass(frozen=True)
class RankStack:
    rank: int
    pid: int
    stopped: bool  # state T when looked at, before anything was sent
    source: str  # "faulthandler" | "py-spy" | "none"
    text: str  # the dump as the tool wrote it, or why there is none


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
    fd = open_regular(t.stack_file)  # the rank's file: never a FIFO's endless wait, never a link
    try:
        return os.pread(fd, OUTPUT_BYTES, before).decode("utf-8", "replace")
    finally:
        os.close(fd)


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
    except (OSError, ValueError) as exc:  # the rank exited meanwhile, a file that is not a file
        why = f"no stack: {exc}"
    return RankStack(t.rank, t.pid, stopped, "none", why)


def _poke(fifo: str) -> bool:
    """Write one byte to ``fifo`` if it is a FIFO that somebody reads; never create a file."""
    try:
        if not fifo or not stat.S_ISFIFO(os.stat(fifo).st_mode):
            return False  # no FIFO (a CPU rank, torch without the recorder)
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)  # ENXIO: nobody reads it
    except OSError:
        return False
    try:
        os.write(fd, b"1")
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def trigger_nccl_dumps(targets: Sequence[RankTarget]) -> list[RankTarget]:
    """Write to each rank's flight-recorder FIFO that has a reader (a ProcessGroupNCCL)."""
    return [t for t in targets if _poke(t.nccl_pipe)]


def trigger_trace_dumps(targets: Sequence[RankTarget]) -> list[RankTarget]:
    """Ask each rank that serves its own flight-recorder FIFO (the reference trainer, any
    backend) for its trace. Before the stacks are taken: a stopped rank answers once continued."""
    asked = []
    for t in targets:
        if not t.trace_file:
            continue
        with contextlib.suppress(OSError):
            os.unlink(t.trace_file)  # only a trace written after this request counts
        if _poke(t.trace_pipe):
            asked.append(t)
    return asked


@dataclass(frozen=True)
class TraceSummary:
    """What a rank's flight recorder says about its default process group."""

    enqueued: int  # sequence number of the last collective it issued
    completed: int  # ... and of the last one that completed
    op: str  # the last recorded collective, "gloo:all_reduce"
    state: str  # its state as recorded ("scheduled", "started", "completed")
    entries: int  # entries in the ring buffer

    @property
    def pending(self) -> bool:
        """A collective issued and not completed: the rank waits for its peers."""
        return self.enqueued > self.completed

    def record(self) -> dict[str, object]:
        return {"enqueued": self.enqueued, "completed": self.completed, "op": self.op,
                "state": self.state, "entries": self.entries}


def _seq(value: object) -> int:
    """A sequence number as the recorder writes it (an int, or its decimal string), within int64:
    what goes into the ledger must read back under slurmkit.untrusted's limits."""
    if isinstance(value, str) and value.lstrip("-").isdigit() and len(value) <= 20:
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not -2**63 <= value < 2**63:
        raise ValueError(f"a sequence number, found {value!r:.40}")
    return value


def parse_trace(data: bytes) -> TraceSummary:
    """The summary of one trace as ``torch._C._distributed_c10d._dump_fr_trace_json`` writes it.
    The file is the rank's, on this node, and read as untrusted: JSON only, every field checked;
    ValueError says what is wrong."""
    doc = parse_json(data, max_bytes=TRACE_BYTES, max_depth=TRACE_DEPTH)  # UntrustedDataError says why
    if not isinstance(doc, dict) or not isinstance(doc.get("pg_status"), dict):
        raise ValueError("no pg_status object")
    status, entries = doc["pg_status"], doc.get("entries", [])
    if not isinstance(entries, list):
        raise ValueError("entries is not a list")
    pg = "0" if "0" in status else min(status, key=str, default=None)
    if pg is None or not isinstance(status[pg], dict):
        raise ValueError("pg_status names no process group")
    try:
        enqueued = _seq(status[pg].get("last_enqueued_collective", -1))
        completed = _seq(status[pg].get("last_completed_collective", -1))
    except ValueError as exc:
        raise ValueError(f"process group {pg}: {exc}") from None
    last = entries[-1] if entries and isinstance(entries[-1], dict) else {}
    op, state = last.get("profiling_name", ""), last.get("state", "")
    return TraceSummary(enqueued, completed, str(op)[:80], str(state)[:20], len(entries))


def read_traces(asked: Sequence[RankTarget], timeout_s: float = TRACE_WAIT_S) -> dict[int, TraceSummary | str]:
    """Each asked rank's trace summary, or why there is none, waiting at most ``timeout_s`` for
    all of them together."""
    deadline = time.monotonic() + timeout_s
    waiting = list(asked)
    while waiting and time.monotonic() < deadline:
        waiting = [t for t in waiting if not os.path.exists(t.trace_file)]
        if waiting:
            time.sleep(0.05)
    out: dict[int, TraceSummary | str] = {}
    for t in asked:
        try:
            out[t.rank] = parse_trace(read_regular(t.trace_file, TRACE_BYTES))
        except FileNotFoundError:
            out[t.rank] = f"no trace within {timeout_s:g} s"
        except (OSError, ValueError) as exc:
            out[t.rank] = f"trace {t.trace_file} unreadable: {exc}"
    return out


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


def wait_nccl_dumps(triggered: Sequence[RankTarget], stems: Sequence[str],
                    timeout_s: float = NCCL_DUMP_WAIT_S) -> list[str]:
    """Until each triggered rank's flight-recorder file exists under one of ``stems`` (the
    program's own candidates, or the agent's), at most ``timeout_s``; the files written."""
    deadline = time.monotonic() + timeout_s
    waiting = {t.rank: [f"{stem}{t.rank}" for stem in stems] for t in triggered}
    written: list[str] = []
    while True:
        for rank, paths in list(waiting.items()):
            found = [p for p in paths if os.path.exists(p)]
            if found:
                written.append(found[0])
                del waiting[rank]
        if not waiting or time.monotonic() >= deadline:
            return written
        time.sleep(0.1)


def with_trace(reading: StackReading, trace: TraceSummary | str | None) -> StackReading:
    """The stack's reading corrected by the flight recorder: a rank whose stack is outside any
    collective but which issued one that has not completed waits for its peers (on a GPU the
    collective is queued on the device and the rank blocks in a device wait, not in a
    collective call)."""
    if isinstance(trace, TraceSummary) and trace.pending and reading.place == StackPlace.OUTSIDE:
        return replace(reading, place=StackPlace.COLLECTIVE,
                       wait=f"{trace.op or 'a collective'} #{trace.enqueued} not completed (flight recorder)")
    return reading


def report(stacks: Sequence[RankStack], *, node: str, generation: int,
           append: Callable[..., object], traces: Mapping[int, TraceSummary | str] | None = None) -> list[Evidence]:
    """This node's ``hang_stacks`` ledger event and log lines (the full, bounded stacks, and
    each rank's flight-recorder summary where it gave one), and the verdicts it posts to node 0
    (slurmkit.failures.stacks.node_verdicts)."""
    traces = traces or {}
    readings = [(s.rank, with_trace(read_stack(s.text, stopped=s.stopped, pid=s.pid), traces.get(s.rank)))
                for s in stacks]
    records = []
    for s, (_, r) in zip(stacks, readings, strict=True):
        lines = bounded_lines(s.text, pid=s.pid)
        record: dict[str, object] = {"rank": s.rank, "pid": s.pid, "place": r.place.value, "source": s.source,
                                     "where": r.where, "wait": r.wait, "lines": lines}
        trace = traces.get(s.rank)
        if trace is not None:
            record["trace"] = trace.record() if isinstance(trace, TraceSummary) else {"error": trace[:200]}
        records.append(record)
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
