"""Which node drags the job: relative step-time scores against the job's median (pure).

In synchronous training every rank's *step* takes as long as the slowest rank's: the fast ones
wait in the collectives. So a rank is scored by its own work only (data wait + compute, the
sections the reference trainer measures outside the collectives: slurmkit.train.sections), as
NVIDIA resiliency-ext's straggler detector does:

    score(rank) = median of every rank's own time in the window / this rank's own time

1.0 is typical; 0.5 means the rank needs twice the job's median. A node scores as its slowest
rank (one slow GPU slows the whole node's step). A node is *named* once its score stays below
``threshold`` for ``windows`` consecutive windows: one slow step moves no window's median, one
noisy window names nobody.

A window is what every node's agent reports at its beat interval (slurmkit.launch.steptimes):
per rank, the median own time over its last few step samples. Node 0 reads the newest report of
every node in one round trip and scores a *round* once every reporting node has a window newer
than the last round's, so every round compares windows of about the same steps.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

SECTIONS = ("data", "compute", "comm", "ckpt")  # seconds per step, as the trainer measures them


@dataclass(frozen=True)
class NodeWindow:
    """One node's newest window, as its agent reported it."""

    node: str
    generation: int
    seq: int  # the agent's window counter in this generation (1, 2, ...)
    step: int  # the newest step in the window
    ranks: Mapping[int, float]  # global rank -> median own time (data + compute), seconds
    sections: Mapping[str, float] = field(default_factory=dict)  # node medians per section, seconds


MAX_RANKS_PER_WINDOW = 1024  # a node's window with more ranks was not written by an agent


def window_to_json(w: NodeWindow) -> dict[str, Any]:
    return {"gen": w.generation, "seq": w.seq, "step": w.step,
            "ranks": {str(r): t for r, t in w.ranks.items()}, "sections": dict(w.sections)}


def _seconds(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{value!r} is not a number of seconds")
    return float(value)


def _count(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{value!r} is not a count")
    return value


def window_from_json(node: str, raw: object) -> NodeWindow:
    """A window read from the agents' store (sealed, yet checked: ValueError when malformed)."""
    if not isinstance(raw, dict) or not isinstance(raw.get("ranks"), dict) or not isinstance(raw.get("sections"), dict):
        raise ValueError("not a window (gen, seq, step, ranks, sections)")
    if len(raw["ranks"]) > MAX_RANKS_PER_WINDOW:
        raise ValueError(f"{len(raw['ranks'])} ranks in one node's window")
    ranks = {_count(int(r)): _seconds(t) for r, t in raw["ranks"].items()}
    sections = {name: _seconds(raw["sections"].get(name, 0.0)) for name in SECTIONS}
    return NodeWindow(node, _count(raw.get("gen")), _count(raw.get("seq")), _count(raw.get("step")), ranks, sections)


@dataclass(frozen=True)
class Named:
    """A node that stayed slow: what the ledger's ``straggler`` event records."""

    node: str
    score: float  # its slowest rank's score in the window that named it
    rank: int  # that rank
    own_s: float  # that rank's median own time
    job_median_s: float  # the median own time of every rank in that window
    windows: int  # consecutive slow windows (= the detector's ``windows``)
    step: int  # the newest step of the window that named it
    sections: Mapping[str, float]


@dataclass(frozen=True)
class Round:
    """One scored round: every rank's and node's score (for benchmarks and tests)."""

    job_median_s: float
    rank_scores: Mapping[int, float]
    node_scores: Mapping[str, float]


def score(job_median_s: float, own_s: float) -> float:
    """median / own, 1.0 when either is not positive (nothing measured is nothing slow)."""
    if own_s <= 0 or job_median_s <= 0:
        return 1.0
    return job_median_s / own_s


def score_round(windows: Mapping[str, NodeWindow]) -> Round | None:
    """Scores of one round of windows (node -> window); None with fewer than two ranks."""
    own = {r: t for w in windows.values() for r, t in w.ranks.items()}
    if len(own) < 2:
        return None
    median = statistics.median(own.values())
    ranks = {r: score(median, t) for r, t in own.items()}
    nodes = {n: min((ranks[r] for r in w.ranks), default=1.0) for n, w in windows.items()}
    return Round(median, ranks, nodes)


class StragglerDetector:
    """Feed it the newest window of every node (``observe``) as often as they are read; it
    scores a round when every node has moved on, and returns each node the moment it is named.
    One detector per generation: a restart starts every count again."""

    def __init__(self, *, threshold: float = 0.7, windows: int = 3) -> None:
        if not 0 < threshold < 1 or windows < 1:
            raise ValueError(f"threshold {threshold} (0-1), windows {windows} (>= 1)")
        self.threshold, self.windows = threshold, windows
        self.rounds = 0
        self._seen: dict[str, int] = {}  # node -> its seq in the last scored round
        self._slow: dict[str, int] = {}  # node -> slow windows in a row
        self.named: dict[str, Named] = {}
        self.last: Round | None = None

    def observe(self, newest: Mapping[str, NodeWindow]) -> list[Named]:
        """Nodes named by this call (each node at most once per detector)."""
        if not newest or any(w.seq <= self._seen.get(n, 0) for n, w in newest.items()):
            return []  # some node has not reported a new window yet: wait for the round
        for n, w in newest.items():
            self._seen[n] = w.seq
        scored = score_round(newest)
        if scored is None:
            return []
        self.rounds += 1
        self.last = scored
        out = []
        for node, s in scored.node_scores.items():
            self._slow[node] = self._slow.get(node, 0) + 1 if s < self.threshold else 0
            if self._slow[node] >= self.windows and node not in self.named:
                self.named[node] = self._name(newest[node], scored)
                out.append(self.named[node])
        return out

    def _name(self, w: NodeWindow, scored: Round) -> Named:
        worst = min(w.ranks, key=lambda r: scored.rank_scores[r])
        return Named(node=w.node, score=round(scored.rank_scores[worst], 4), rank=worst,
                     own_s=w.ranks[worst], job_median_s=scored.job_median_s, windows=self._slow[w.node],
                     step=w.step, sections=dict(w.sections))
