"""Where a hung rank is, from its Python stack: inside a collective, or somewhere else.

A hang leaves every rank's last heartbeat at the same step, so the beats cannot say which rank
started it. The stacks can: the peers of a stuck rank wait inside a collective (an all-reduce,
a barrier, DDP's gradient all-reduce inside ``backward``), while the rank that holds them up is
elsewhere (a data loader stuck on a file system, a deadlock of its own) or stopped (state T).

Pure functions over text captured by the node agent (slurmkit.launch.stackdump): Python's
``faulthandler`` (the reference trainer dumps on SIGUSR2) and ``py-spy dump``. The tables of real
captured text these are tested with are in tests/data/stacks/.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

STACK_LINES = 40  # lines of one rank's stack kept in the node's ledger event
LINE_CHARS = 200  # characters of one such line
EXCERPT_FRAMES = 3  # innermost frames of the main thread in the verdict sent to node 0
EXCERPT_CHARS = 300
# A longer line of a dump is no frame (paths and names are far shorter). The dump is the rank's
# text: a line of 64 KiB of " (" made the frame pattern backtrack for seconds per rank.
FRAME_LINE_CHARS = 2000


class StackPlace(str, Enum):
    STOPPED = "stopped"  # the process is stopped (state T): it holds its peers up
    OUTSIDE = "outside"  # its stack is not inside a collective
    COLLECTIVE = "collective"  # inside a collective: waiting for a peer
    UNKNOWN = "unknown"  # no stack could be taken


@dataclass(frozen=True)
class Frame:
    function: str
    file: str
    line: int

    def short(self) -> str:
        return f"{self.function} ({os.path.basename(self.file)}:{self.line})"


@dataclass(frozen=True)
class ThreadStack:
    ident: str  # "0x7f..." (faulthandler) or a thread id (py-spy)
    name: str  # py-spy's thread name; "" where the dump has none
    current: bool  # faulthandler's "Current thread" (the one that ran the handler)
    frames: tuple[Frame, ...]  # innermost first, as both tools print them

    @property
    def bootstrapped(self) -> bool:
        """Started by ``threading`` (its outermost frame is Thread._bootstrap): not the main thread."""
        return bool(self.frames) and self.frames[-1].function.endswith("_bootstrap") \
            and os.path.basename(self.frames[-1].file) == "threading.py"


_FH_HEADER = re.compile(r"^(Current thread|Thread) (0x[0-9a-fA-F]+) \(most recent call first\):$")
_FH_SINGLE = re.compile(r"^Stack \(most recent call first\):$")
_FH_FRAME = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d+) in (?P<func>.+)$')
_SPY_PROCESS = re.compile(r"^Process (\d+): ")
_SPY_HEADER = re.compile(r'^Thread (0x[0-9a-fA-F]+|\d+) \((?:idle|active|gil)[^)]*\)(?:: "(?P<name>.*)")?$')
_SPY_FRAME = re.compile(r"^\s{4}(?P<func>\S.*?) \((?P<file>.*):(?P<line>\d+)\)$")


def parse_stack(text: str) -> list[ThreadStack]:
    """The threads of a faulthandler or py-spy dump, in the order printed (empty if none)."""
    threads: list[ThreadStack] = []
    head: tuple[str, str, bool] | None = None
    frames: list[Frame] = []

    def close() -> None:
        if head is not None:
            threads.append(ThreadStack(head[0], head[1], head[2], tuple(frames)))

    for line in text.splitlines():
        if len(line) > FRAME_LINE_CHARS:
            continue
        fh, single, spy = _FH_HEADER.match(line), _FH_SINGLE.match(line), _SPY_HEADER.match(line)
        if fh or single or spy:
            close()
            frames = []
            if fh:
                head = (fh.group(2), "", fh.group(1) == "Current thread")
            elif spy:
                head = (spy.group(1), spy.group("name") or "", False)
            else:
                head = ("", "", True)
            continue
        m = _FH_FRAME.match(line) or _SPY_FRAME.match(line)
        if head is not None and m:
            frames.append(Frame(m.group("func"), m.group("file"), int(m.group("line"))))
    close()
    return threads


def main_thread(threads: Sequence[ThreadStack], pid: int | None = None) -> ThreadStack | None:
    """The thread that runs the program's ``__main__`` (where training steps are taken).

    py-spy names it "MainThread", and on Linux its id is the process id; faulthandler names no
    thread, but every other Python thread was started by ``threading`` (Thread._bootstrap is its
    outermost frame). None when the dump does not tell."""
    for t in threads:
        if t.name == "MainThread" or (pid is not None and t.ident == str(pid)):
            return t
    candidates = [t for t in threads if t.frames and not t.bootstrapped]
    if len(candidates) == 1:
        return candidates[0]
    current = [t for t in candidates if t.current]
    return current[0] if len(current) == 1 else None


# Functions of torch.distributed that wait for peers (c10d's collectives and point-to-point
# calls, a Work's wait, FSDP's unshard and its gathers), and native frames of the backends as
# `py-spy dump --native` shows them.
_COLLECTIVE_FUNC = re.compile(
    r"(?:^|[._])(?:all_reduce|all_gather\w*|reduce_scatter\w*|broadcast\w*|barrier|monitored_barrier"
    r"|all_to_all\w*|reduce|gather\w*|scatter\w*|send|recv|isend|irecv|batch_isend_irecv|wait\w*"
    r"|unshard\w*|_store_based_barrier)$")
_NATIVE_COLLECTIVE = re.compile(r"ProcessGroup(?:Gloo|NCCL)|\bgloo::|\bnccl\w*|\bc10d::\w*Work\w*::wait")
_DISTRIBUTED_FILE = re.compile(r"(?:^|/)torch/(?:distributed/|nn/parallel/distributed\.py)")
# DDP all-reduces gradients from autograd's engine (C++) while backward runs: a rank waiting for
# that all-reduce shows only the backward call in Python, as its innermost frame. With Python
# frames above it (a hook, a custom Function) the rank runs code of its own inside backward.
_BACKWARD = re.compile(r"(?:^|/)torch/autograd/(?:graph|__init__)\.py$")


# A rank blocked syncing with its GPU waits for the NCCL work queued before the sync: DDP and
# FSDP launch their all-reduces without waiting, so on a GPU the peer of a stuck rank blocks in
# the next device sync, which Python shows as the line that syncs. The reference trainer syncs
# in a function of its own for this; torch.cuda's synchronize calls are frames of their own.
_DEVICE_WAITS = (("slurmkit/train/trainer.py", "wait_for_device"), ("torch/cuda/__init__.py", "synchronize"),
                 ("torch/cuda/streams.py", "synchronize"))


def collective_frame(frames: Sequence[Frame]) -> Frame | None:
    """The innermost frame that waits inside a collective (or a backward pass with no Python
    above it, where DDP's gradient all-reduce waits, or a sync with the GPU, where NCCL's
    queued all-reduces are waited for), None if the stack is not inside one."""
    if frames and _BACKWARD.search(frames[0].file) and frames[0].function in ("_engine_run_backward", "backward"):
        return frames[0]
    if frames and any(frames[0].file.endswith(path) and frames[0].function == func for path, func in _DEVICE_WAITS):
        return frames[0]
    for f in frames:
        if _NATIVE_COLLECTIVE.search(f.function):
            return f
        if _DISTRIBUTED_FILE.search(f.file) and _COLLECTIVE_FUNC.search(f.function):
            return f
    return None


@dataclass(frozen=True)
class StackReading:
    place: StackPlace
    where: str  # the main thread's innermost frames, "f (file.py:12) < g (file.py:40)"
    wait: str  # the collective frame when inside one, else ""


def read_stack(text: str, *, stopped: bool, pid: int | None = None) -> StackReading:
    """Where the rank is. A stopped process holds its peers up wherever its stack is."""
    threads = parse_stack(text)
    main = main_thread(threads, pid)
    looked = [main] if main is not None else threads
    wait = next((f for t in looked if (f := collective_frame(t.frames)) is not None), None)
    frames = main.frames if main is not None else (threads[0].frames if threads else ())
    where = " < ".join(f.short() for f in frames[:EXCERPT_FRAMES])[:EXCERPT_CHARS]
    if stopped:
        place = StackPlace.STOPPED
    elif not threads:
        place = StackPlace.UNKNOWN
    else:
        place = StackPlace.COLLECTIVE if wait is not None else StackPlace.OUTSIDE
    return StackReading(place, where, wait.short() if wait is not None else "")


def bounded_lines(text: str, *, pid: int | None = None, limit: int = STACK_LINES) -> list[str]:
    """At most ``limit`` lines of a dump for the ledger, the main thread's first: a parsed dump
    is written back in one compact form whatever the tool; text that does not parse (a tool's
    error message) is kept as its first lines."""
    threads = parse_stack(text)
    if not threads:
        return [line[:LINE_CHARS] for line in text.splitlines() if line.strip()][:limit]
    main = main_thread(threads, pid)
    ordered = ([main] if main is not None else []) + [t for t in threads if t is not main]
    out: list[str] = []
    for t in ordered:
        label = "main thread" if t is main else f"thread {t.ident}" + (f' "{t.name}"' if t.name else "")
        out.append(f"{label}:")
        out += [f"  {f.function} ({f.file}:{f.line})"[:LINE_CHARS] for f in t.frames]
    return out[:limit]


# ------------------------------------------------------------------ the root of a hang
@dataclass(frozen=True)
class Verdict:
    """One rank's place as a node reports it to node 0 (never its whole stack)."""

    node: str
    rank: int
    place: StackPlace
    time: float  # epoch seconds: the rank's first evidence (ties go to the earliest)


def node_verdicts(readings: Sequence[tuple[int, StackReading]]) -> list[tuple[int, StackReading]]:
    """What one node posts: its most suspect rank (stopped before outside a collective, then the
    lowest rank) and one rank inside a collective, if any: at most two per node whatever its rank
    count, so node 0 reads O(N) short records at 2,048 nodes, never N x ranks stacks."""
    order = {StackPlace.STOPPED: 0, StackPlace.OUTSIDE: 1}
    suspects = sorted((r for r in readings if r[1].place in order), key=lambda r: (order[r[1].place], r[0]))
    waiting = [r for r in readings if r[1].place == StackPlace.COLLECTIVE]
    return suspects[:1] + sorted(waiting)[:1]


def evidence_root(verdicts: Sequence[Verdict]) -> Verdict | None:
    """The rank the stacks name as the hang's root, None when they say nothing.

    A stopped rank holds everyone up (it can enter no collective). Otherwise a rank outside any
    collective is the root only while some peer waits inside one: when no rank is inside one,
    all are stuck elsewhere (a shared file system, say) and the stacks do not tell them apart."""
    def first(vs: list[Verdict]) -> Verdict:
        return min(vs, key=lambda v: (v.time, v.rank, v.node))

    stopped = [v for v in verdicts if v.place == StackPlace.STOPPED]
    if stopped:
        return first(stopped)
    outside = [v for v in verdicts if v.place == StackPlace.OUTSIDE]
    if outside and any(v.place == StackPlace.COLLECTIVE for v in verdicts):
        return first(outside)
    return None
