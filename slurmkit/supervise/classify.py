"""Classify failures from evidence: log lines, exit codes, heartbeats, Slurm's node view.

Pure and table-driven. Each rank's evidence is reduced to one class; the root cause of a
failure is the earliest primary evidence in time (peers that fail because a rank died come
later, and their "peer closed the connection" lines are marked secondary).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from slurmkit.supervise.classes import CLASS_INFO, FailureClass

F = FailureClass

# (pattern, class). Ordered: the first match wins, so specific patterns come first.
# Fragments are the stable parts of messages from ProcessGroupNCCL, NCCL, gloo, torch and Slurm.
# Recent torch prefixes an uncaught exception's lines with "[rank<N>]: " once a process group
# exists, and `srun --label` prefixes "<task>: ": a traceback is recognised behind either.
_PREFIX = r"^(?:\[rank\d+\]:|\d+:)?\s*"

LINE_PATTERNS: tuple[tuple[re.Pattern[str], FailureClass], ...] = tuple(
    (re.compile(p), c) for p, c in [
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
        # gloo/TCPStore/c10d symptoms of a peer that went away
        (r"Connection closed by peer|Connection reset by peer|Broken pipe|"
         r"Timed out waiting \d+ms for recv operation|recvBytes|Socket Timeout|"
         r"The server socket has failed to listen|Connection refused", F.PEER_FAILURE),
        (_PREFIX + r"Traceback \(most recent call last\):", F.USER_ERROR),
    ]
)


def classify_line(line: str) -> FailureClass | None:
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


@dataclass(frozen=True)
class Evidence:
    """One observation about one rank (or node, rank = -1)."""

    time: float  # epoch seconds when observed
    node: str
    rank: int
    kind: str  # "line" | "exit" | "heartbeat" | "agent" | "slurm"
    cls: FailureClass
    detail: str  # the log line, "returncode -9", "no step for 12.3 s", ...

    def to_json(self) -> dict[str, object]:
        return {"time": self.time, "node": self.node, "rank": self.rank, "kind": self.kind,
                "cls": self.cls.value, "detail": self.detail[:500]}

    @classmethod
    def from_json(cls, d: dict[str, object]) -> "Evidence":
        # JSON gives numbers back as numbers; str() first keeps mypy honest about `object`
        # (repr of a float round-trips exactly).
        return cls(float(str(d["time"])), str(d["node"]), int(str(d["rank"])), str(d["kind"]),
                   FailureClass(str(d["cls"])), str(d["detail"]))


@dataclass(frozen=True)
class Failure:
    cls: FailureClass
    rank: int
    node: str
    time: float
    evidence: str  # the line or observation that decided it
    ranks_affected: tuple[int, ...]


# When one rank shows several kinds of evidence, the most telling wins (lower = stronger).
# A traceback outranks a signal exit: the exception is why the rank went down, the abort that
# may follow at interpreter exit is how.
_STRENGTH = {F.NODE_LOSS: 0, F.PREFLIGHT: 0, F.GPU_OOM: 1, F.HOST_OOM: 1, F.CONFIG_ERROR: 1, F.NCCL_TIMEOUT: 2,
             F.WATCHDOG_STUCK: 2, F.NCCL_SYNC: 3, F.NCCL_ERROR: 3, F.HANG: 4, F.TIME_LIMIT: 4,
             F.PREEMPTION: 4, F.USER_ERROR: 5, F.RANK_CRASH: 6, F.PEER_FAILURE: 9}


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


def root_cause(evidence: Iterable[Evidence]) -> Failure | None:
    """The failure that started it: the rank whose first primary evidence came first."""
    by_rank: dict[tuple[str, int], list[Evidence]] = {}
    for e in evidence:
        by_rank.setdefault((e.node, e.rank), []).append(e)
    if not by_rank:
        return None
    summaries = []
    for (node, rank), items in by_rank.items():
        cls, decisive = _rank_class(items)
        first = min(e.time for e in items if not CLASS_INFO[e.cls].secondary) \
            if any(not CLASS_INFO[e.cls].secondary for e in items) else min(e.time for e in items)
        # A lost node, or one its own pre-flight found bad, explains whatever its peers saw.
        summaries.append((CLASS_INFO[cls].secondary, cls not in (F.NODE_LOSS, F.PREFLIGHT), first, rank, node,
                          cls, decisive))
    summaries.sort(key=lambda s: (s[0], s[1], s[2], s[3]))
    secondary, _, first, rank, node, cls, decisive = summaries[0]
    return Failure(cls=cls, rank=rank, node=node, time=first, evidence=decisive.detail,
                   ranks_affected=tuple(sorted({s[3] for s in summaries if s[3] >= 0})))
