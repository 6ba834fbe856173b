"""One node's recent step times, summarised into the small window its agent sends to node 0.

The ranks beat their step-time sections (seconds of data wait, compute, communication and
checkpoint blocking: slurmkit.train.trainer) into their node-local heartbeat files; the agent
reads each rank's newest beat every poll (slurmkit.launch.monitor) and hands the beats here.
Every ``window_samples`` new step samples of every rank make one window: per rank the median
of its own work (data + compute), and per section the node's median. That window (a few dozen
bytes per rank: O(1) per agent, whatever the job's size) is what the supervisor posts at its
beat interval and node 0 scores (slurmkit.supervise.stragglers).

A beat is written by any program the job runs ($SLURMKIT_HEARTBEAT_FILE): its sections are
untrusted. A beat without sections (a program that does not measure them, a trainer from before
them) is no sample; a malformed one is ignored, never the agent's crash.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping

from slurmkit.supervise.stragglers import SECTIONS, NodeWindow

MAX_SECTION_S = 86400.0  # a step longer than a day is not a measurement


def parse_sections(beat: Mapping[str, object]) -> dict[str, float] | None:
    """The beat's sections (seconds, each finite and in [0, a day]), or None when it has none
    or any known one is malformed. Unknown section names are ignored (a newer writer)."""
    raw = beat.get("sections")
    if not isinstance(raw, dict):
        return None
    out: dict[str, float] = {}
    for name in SECTIONS:
        value = raw.get(name, 0.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return None
        v = float(value)
        if not math.isfinite(v) or not 0.0 <= v <= MAX_SECTION_S:
            return None
        out[name] = v
    return out


def own_time(sections: Mapping[str, float]) -> float:
    """The part of a step a rank does not spend waiting for its peers: data wait + compute."""
    return sections["data"] + sections["compute"]


class StepTimes:
    """The samples of this node's ranks in one generation; ``take`` makes the window."""

    def __init__(self, node: str, generation: int, *, window_samples: int) -> None:
        self.node, self.generation, self.window_samples = node, generation, window_samples
        self.seq = 0
        self._last_step: dict[int, int] = {}
        self._samples: dict[int, list[dict[str, float]]] = {}

    def observe(self, beats: Mapping[int, Mapping[str, object]]) -> None:
        """The ranks' newest beats (rank -> beat, as RankMonitor.poll returns them): a beat of a
        step not seen before is one sample. Cost: a dict lookup per rank when nothing moved."""
        for rank, beat in beats.items():
            step = beat.get("step")
            if not isinstance(step, int) or isinstance(step, bool) or step == self._last_step.get(rank):
                continue
            self._last_step[rank] = step
            sections = parse_sections(beat)
            if sections is not None:
                self._samples.setdefault(rank, []).append(sections)

    def take(self) -> NodeWindow | None:
        """The next window once every rank that measures has ``window_samples`` new samples
        (their samples are then dropped: windows do not overlap), else None."""
        if not self._samples or any(len(s) < self.window_samples for s in self._samples.values()):
            return None
        ranks = {r: statistics.median(own_time(x) for x in s) for r, s in self._samples.items()}
        every = [x for s in self._samples.values() for x in s]
        sections = {name: round(statistics.median(x[name] for x in every), 6) for name in SECTIONS}
        self.seq += 1
        self._samples = {}
        return NodeWindow(self.node, self.generation, self.seq, max(self._last_step.values()),
                          {r: round(t, 6) for r, t in ranks.items()}, sections)
