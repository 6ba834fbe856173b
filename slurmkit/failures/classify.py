"""Classify failures from evidence: log lines, exit codes, heartbeats, Slurm's node view.

Pure and table-driven. Each rank's evidence is reduced to one class; the root cause of a
failure is the earliest primary evidence in time (peers that fail because a rank died come
later, and their "peer closed the connection" lines are marked secondary). A hang is the
exception: every rank's last beat is the same step, so its root is the rank that the stacks
name (slurmkit.failures.stacks), and the earliest beat only when they name none.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, replace

from slurmkit.contract import CONFIG_ERROR_MARKER
from slurmkit.gpufaults import DEFAULT_BAD_XIDS, HW_RE, XID_RE
from slurmkit.failures.classes import CLASS_INFO, FailureClass
from slurmkit.failures.stacks import StackPlace, Verdict, evidence_root

F = FailureClass

# Line classes that a rank may print and survive: a trainer that catches an OutOfMemoryError and
# retries with a smaller batch, a logged traceback, a caught CUDA error in a retry loop, a message
# quoting a config error. Such a line counts only once the same rank's process failed after it on
# its own (see ``_confirmed``). The lines that end the process themselves (NCCL's watchdog
# tear-down, the OOM killer, Slurm's) need no such proof, and neither does a hardware fault: the
# node is bad whatever the process made of the error.
CONFIRM_BY_EXIT = frozenset({F.GPU_OOM, F.USER_ERROR, F.CONFIG_ERROR, F.CUDA_ERROR})
# A fatal error ends its process within seconds (the traceback, the interpreter's tear-down, an
# NCCL abort); an exit later than this after the line has another cause.
CONFIRM_WINDOW_S = 60.0
# How the agent stops the ranks of a generation that failed elsewhere (SIGTERM, then SIGKILL; as
# Popen return codes and as a shell's statuses): such an exit confirms nothing about the rank.
STOP_EXITS = frozenset({-15, -9, 128 + 15, 128 + 9})
# torch.distributed's sys.excepthook (installed with the process group) prints an uncaught
# exception with "[rank<N>]: " before each line: the process is ending, whatever its tear-down
# takes (a killed rank still counts). A caught and logged exception never gets this prefix.
_UNCAUGHT = re.compile(r"^(?:\d+: )?\[rank\d+\]: ")

# (pattern, class). Ordered: the first match wins, so specific patterns come first.
# Fragments are the stable parts of messages from ProcessGroupNCCL, NCCL, gloo, torch and Slurm.
# Recent torch prefixes an uncaught exception's lines with "[rank<N>]: " once a process group
# exists, and `srun --label` prefixes "<task>: ": a traceback is recognised behind either.
_PREFIX = r"^(?:\[rank\d+\]:|\d+:)?\s*"

LINE_PATTERNS: tuple[tuple[re.Pattern[str], FailureClass], ...] = tuple(
    (re.compile(p), c) for p, c in [
        # Hardware first: torch's NCCL and watchdog messages quote the CUDA or NIC error that
        # made them (a DistBackendError "... Last error: NET/IB : ... port error"), and the
        # hardware is the cause. CUDA's own strings (cudaGetErrorString) as torch quotes them.
        (r"uncorrectable ECC error|\bECC error\b.*\bDBE\b|double[- ]bit ECC error"
         r"|GPU has fallen off the bus|\bGPU is lost\b", F.GPU_FAULT),
        # A fatal event of the InfiniBand/RoCE device NCCL uses (ibv_event_type_str's names), and
        # NCCL's "unhandled system error" when its reason names that device.
        (r"NET/IB ?:.*Got async event ?: (?:local catastrophic error|port error"
         r"|local work queue catastrophic error)"
         r"|unhandled system error.*(?:NET/IB|\bmlx\d_\d+\b|\bibv_\w+)", F.GPU_FAULT),
        (r"CUDA error: (?:an illegal memory access was encountered|unspecified launch failure"
         r"|an illegal instruction was encountered|misaligned address)", F.CUDA_ERROR),
        (r"Watchdog caught collective operation timeout", F.NCCL_TIMEOUT),
        (r"WorkNCCL\(.*\) ran for \d+ milliseconds before timing out", F.NCCL_TIMEOUT),
        (r"watchdog got stuck for \d+ seconds|Heartbeat monitor timed out", F.WATCHDOG_STUCK),
        # Before the async patterns: a DistBackendError's message often quotes the NCCL reason
        # ("remote process exited ..."), but the raise itself is what tells the failure apart.
        (r"DistBackendError: NCCL error", F.NCCL_SYNC),
        (r"remote error detected from rank|remote process exited or there was a network error"
         r"|ncclRemoteError", F.NCCL_ERROR),
        (r"ncclSystemError|ncclUnhandledCudaError|ncclInternalError|NET/IB : Got completion from peer"
         r"|NCCL error:|NCCL error in:", F.NCCL_ERROR),
        # The tear-down lines follow both a timeout and an async error: the class that names the
        # cause (timeout, above) wins on the same rank by strength.
        (r"Some NCCL operations have failed or timed out|taking the entire process down"
         r"|Exception \(either an error or timeout\) detected by watchdog", F.NCCL_ERROR),
        (r"torch\.OutOfMemoryError|CUDA out of memory|torch\.cuda\.OutOfMemoryError", F.GPU_OOM),
        (r"oom_kill event|Some of the step tasks have been OOM Killed|Out of memory: Killed process"
         r"|srun: error: \S+: tasks? [\d,-]+: Out Of Memory", F.HOST_OOM),
        (r"DUE TO TIME LIMIT", F.TIME_LIMIT),
        (r"DUE TO PREEMPTION", F.PREEMPTION),
        (r"DUE TO NODE FAILURE|srun: error: Node failure on", F.NODE_LOSS),
        (r"slurmkit\.errors\.ConfigError|ConfigError: Detected:", F.CONFIG_ERROR),
        # The trainer's one stable line for a configuration it refused (slurmkit.contract), at
        # the start of the line only: a program that quotes it in a message of its own is not it.
        (_PREFIX + re.escape(CONFIG_ERROR_MARKER), F.CONFIG_ERROR),
        # gloo/TCPStore/c10d symptoms of a peer that went away
        (r"Connection closed by peer|Connection reset by peer|Broken pipe|"
         r"Timed out waiting \d+ms for recv operation|recvBytes|Socket Timeout|"
         r"The server socket has failed to listen|Connection refused", F.PEER_FAILURE),
        (_PREFIX + r"Traceback \(most recent call last\):", F.USER_ERROR),
    ]
)


_BAD_XIDS = frozenset(DEFAULT_BAD_XIDS)


def classify_line(line: str) -> FailureClass | None:
    # The kernel's own formats, the same patterns the pre-flight check reads the kernel log with
    # (a rank's output holds them when a wrapper copies dmesg in). An Xid of an application's own
    # bug (13, 31, 43: not on health's list) says nothing about the node: the lines that follow do.
    xid = XID_RE.search(line)
    if xid is not None:
        return F.GPU_FAULT if int(xid.group("xid")) in _BAD_XIDS else None
    if HW_RE.search(line):
        return F.GPU_FAULT
    for pattern, cls in LINE_PATTERNS:
        if pattern.search(line):
            return cls
    return None


def classify_exit(returncode: int) -> FailureClass | None:
    """Class of a rank's exit status (Popen returncode: negative = killed by that signal).

    A shell status 129..192 (a rank started through a shell wrapper) is read as that signal.
    An exit alone never says NCCL: PyTorch aborts after an NCCL failure (SIGABRT), but so does
    any process whose C++ threads are still running when a Python exception ends it
    ("terminate called without an active exception", captured in
    tests/data/failures/real_gloo_rank_raises.json). The NCCL class comes from the log line
    printed before the abort, which outranks the exit (see ``_STRENGTH``).
    """
    if returncode == 0:
        return None
    if returncode < 0 or 128 < returncode <= 128 + 64:
        return F.RANK_CRASH
    return F.USER_ERROR


DETAIL_LIMIT = 500


def printable_detail(text: str) -> str:
    """A rank's line as it may go into the ledger and the store: one line, control characters
    (terminal escapes, a stray carriage return) replaced, the first DETAIL_LIMIT characters."""
    return "".join(c if c.isprintable() else "?" for c in text[:DETAIL_LIMIT])


# A line that says why a process ended: an exception ("ValueError: boom", torch's "[rank0]:
# RuntimeError: ..."), the interpreter's or the shell's own complaint ("python: can't open file
# ...", "./run.sh: line 3: x: command not found"), a C++ abort ("terminate called ...").
_TELLING = re.compile(
    r"(?:^|[\s:\]])[A-Za-z_][\w.]*(?:Error|Exception|Interrupt)\b|\bSystemExit\b"
    r"|can't open file|No module named|command not found|No such file or directory|Permission denied"
    r"|\b[Ee]rror:|\bERROR\b|Segmentation fault|terminate called|\bwhat\(\):")


def telling_line(lines: Iterable[str]) -> str:
    """Of a rank's last output ``lines`` (oldest first), the one that says why it ended: the
    newest that reads like an error, else the newest that is not blank; "" when all are blank.
    What it gives is ready for the ledger (:func:`printable_detail`)."""
    kept = [line.strip() for line in lines if line.strip()]
    found = next((line for line in reversed(kept) if _TELLING.search(line)), kept[-1] if kept else "")
    return printable_detail(found)


@dataclass(frozen=True)
class Evidence:
    """One observation about one rank (or node, rank = -1)."""

    time: float  # epoch seconds when observed
    node: str
    rank: int
    kind: str  # "line" | "exit" | "heartbeat" | "agent" | "slurm"
    cls: FailureClass
    detail: str  # the log line, "returncode -9", "no step for 12.3 s", ...
    returncode: int | None = None  # kind "exit": the rank's Popen return code
    place: StackPlace | None = None  # kind "stack": where the rank's stack is (slurmkit.failures.stacks)
    # kind "exit": the rank's own last word (:func:`telling_line`: a crash's message), "" if none
    last_line: str = ""

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {"time": self.time, "node": self.node, "rank": self.rank, "kind": self.kind,
                                  "cls": self.cls.value, "detail": printable_detail(self.detail)}
        if self.returncode is not None:
            out["returncode"] = self.returncode
        if self.place is not None:
            out["place"] = self.place.value
        if self.last_line:
            out["last_line"] = printable_detail(self.last_line)
        return out

    @classmethod
    def from_json(cls, d: dict[str, object]) -> "Evidence":
        # JSON gives numbers back as numbers; str() first keeps mypy honest about `object`
        # (repr of a float round-trips exactly).
        code, place, last = d.get("returncode"), d.get("place"), d.get("last_line")
        return cls(float(str(d["time"])), str(d["node"]), int(str(d["rank"])), str(d["kind"]),
                   FailureClass(str(d["cls"])), str(d["detail"]),
                   int(str(code)) if code is not None else None,
                   StackPlace(str(place)) if place is not None else None,
                   printable_detail(str(last)) if last is not None else "")


@dataclass(frozen=True)
class Failure:
    cls: FailureClass
    rank: int
    node: str
    time: float
    evidence: str  # the line or observation that decided it
    ranks_affected: tuple[int, ...]
    stack: str = ""  # a hang: the root's stack excerpt as its node reported it ("" if none)
    in_collective: bool | None = None  # a hang: whether the root's stack is inside a collective
    line: str = ""  # the failing rank's own last word (Evidence.last_line), "" if none

    def where(self) -> str:
        """``user_error on rank 1 (node2): <evidence>``, with the rank's own last word when it
        says more (a traceback's header decides user_error; its ``ValueError: ...`` says why)."""
        said = f" -> {self.line}" if self.line and self.line != self.evidence else ""
        return f"{self.cls.value} on rank {self.rank} ({self.node}): {self.evidence}{said}"


# When one rank shows several kinds of evidence, the most telling wins (lower = stronger).
# A traceback outranks a signal exit: the exception is why the rank went down, the abort that
# may follow at interpreter exit is how.
_STRENGTH = {F.NODE_LOSS: 0, F.PREFLIGHT: 0, F.GPU_FAULT: 0, F.CUDA_ERROR: 1, F.GPU_OOM: 1, F.HOST_OOM: 1, F.CONFIG_ERROR: 1, F.NCCL_TIMEOUT: 2,
             F.WATCHDOG_STUCK: 2, F.NCCL_SYNC: 3, F.NCCL_ERROR: 3, F.HANG: 4, F.TIME_LIMIT: 4,
             F.PREEMPTION: 4, F.USER_ERROR: 5, F.RANK_CRASH: 6, F.STRAGGLER: 7, F.PEER_FAILURE: 9}


def _rank_class(items: list[Evidence]) -> tuple[FailureClass, Evidence]:
    """Reduce one rank's evidence to one class; the deciding evidence comes with it."""
    best = min(items, key=lambda e: (_STRENGTH[e.cls], e.time))
    # A crash on a signal after a peer-failure line is still only a symptom.
    if best.cls == F.RANK_CRASH and any(e.cls == F.PEER_FAILURE for e in items):
        return F.PEER_FAILURE, best
    # A traceback whose exception names a lost peer is a symptom too.
    if best.cls == F.USER_ERROR and any(e.cls == F.PEER_FAILURE for e in items):
        return F.PEER_FAILURE, min((e for e in items if e.cls == F.PEER_FAILURE), key=lambda e: e.time)
    return best.cls, best


def _confirmed(line: Evidence, items: list[Evidence]) -> bool:
    """A survivable line counts once its rank's process failed on its own: it exited within
    CONFIRM_WINDOW_S after the line (not stopped by the agent: a rank that handled an OOM and
    ran on until another rank failed is killed with the rest), or it hung (its last step came
    before the line). torch's uncaught-exception lines need no exit: see ``_UNCAUGHT``."""
    if _UNCAUGHT.match(line.detail):
        return True
    for e in items:
        if (e.kind == "exit" and line.time <= e.time <= line.time + CONFIRM_WINDOW_S
                and e.returncode not in STOP_EXITS):
            return True
        if e.kind == "heartbeat" and e.time <= line.time:
            return True
    return False


_NODE_FAULTS = (F.NODE_LOSS, F.PREFLIGHT, F.GPU_FAULT)


def root_cause(evidence: Iterable[Evidence]) -> Failure | None:
    """The failure that started it: the rank whose first primary evidence came first.

    A line of CONFIRM_BY_EXIT whose rank did not fail after it is dropped: it was handled."""
    by_rank: dict[tuple[str, int], list[Evidence]] = {}
    stacks: list[Evidence] = []  # where hung ranks are (slurmkit.failures.stacks): not a rank's failure
    for e in evidence:
        if e.kind == "stack":
            stacks.append(e)
        else:
            by_rank.setdefault((e.node, e.rank), []).append(e)
    for key, items in list(by_rank.items()):
        kept = [e for e in items
                if not (e.kind == "line" and e.cls in CONFIRM_BY_EXIT) or _confirmed(e, items)]
        if kept:
            by_rank[key] = kept
        else:
            del by_rank[key]
    if not by_rank:
        return None
    summaries = []
    for (node, rank), items in by_rank.items():
        cls, decisive = _rank_class(items)
        first = min(e.time for e in items if not CLASS_INFO[e.cls].secondary) \
            if any(not CLASS_INFO[e.cls].secondary for e in items) else min(e.time for e in items)
        # A lost node, one its own pre-flight found bad, or one whose hardware failed under a
        # rank explains whatever its peers saw.
        summaries.append((CLASS_INFO[cls].secondary, cls not in _NODE_FAULTS, first, rank, node,
                          cls, decisive))
    summaries.sort(key=lambda s: (s[0], s[1], s[2], s[3]))
    secondary, _, first, rank, node, cls, decisive = summaries[0]
    # the rank's last word rides on its exit, whichever evidence decided the class
    said = decisive.last_line or next((e.last_line for e in by_rank[(node, rank)] if e.last_line), "")
    failure = Failure(cls=cls, rank=rank, node=node, time=first, evidence=printable_detail(decisive.detail),
                      ranks_affected=tuple(sorted({s[3] for s in summaries if s[3] >= 0})),
                      line=printable_detail(said))
    return _hang_by_stacks(failure, stacks, by_rank) if cls == F.HANG and stacks else failure


def bad_nodes(evidence: Iterable[Evidence]) -> list[str]:
    """Every node the evidence proves bad at once (its pre-flight failed, its hardware faulted:
    classes.ClassInfo.bad_node), whichever failure is the root: several nodes failing their
    pre-flight in one generation all leave in one decision, not one per generation."""
    return sorted({e.node for e in evidence if e.node and e.kind != "stack" and CLASS_INFO[e.cls].bad_node})


def _hang_by_stacks(failure: Failure, stacks: list[Evidence],
                    by_rank: dict[tuple[str, int], list[Evidence]]) -> Failure:
    """A hang's root as the ranks' stacks name it (stopped, or outside a collective while a peer
    waits in one); the earliest beat (``failure``) only when they name none. Every rank's last
    beat is the same step in a hang, so the earliest beat alone is a random pick."""
    def seen(e: Evidence) -> float:
        items = by_rank.get((e.node, e.rank))
        return min(x.time for x in items) if items else e.time

    placed = {(e.node, e.rank): e for e in stacks if e.place is not None}
    root = evidence_root([Verdict(e.node, e.rank, e.place, seen(e)) for e in placed.values()
                          if e.place is not None])
    if root is None:
        own = placed.get((failure.node, failure.rank))
        if own is None:
            return failure
        return replace(failure, stack=printable_detail(own.detail),
                       in_collective=own.place == StackPlace.COLLECTIVE)
    ev = placed[(root.node, root.rank)]
    hangs = [e for e in by_rank.get((root.node, root.rank), []) if e.cls == F.HANG]
    said = f"{min(hangs, key=lambda e: e.time).detail}; " if hangs else ""
    affected = tuple(sorted({*failure.ranks_affected, root.rank} - {-1}))
    return Failure(cls=F.HANG, rank=root.rank, node=root.node, time=root.time,
                   evidence=printable_detail(f"{said}stack: {ev.detail}"), ranks_affected=affected,
                   stack=printable_detail(ev.detail), in_collective=False)
