"""Where a run's wall time went: productive, detection, restart, restore, lost, queue, ...

Built on the same segments and failure figures as ``python -m slurmkit.supervise``
(slurmkit/ledger/summary.py), so the productive part here is that report's productive time.
Every instant between the first and the last ledger event gets exactly one label; where
intervals overlap the earlier label in ``LABELS`` wins, so the parts add up to the wall time:

- productive: a segment's start until it reached the last step no later segment threw away;
- lost: from there until the fault (or the segment's last step): steps computed again later;
- queue: ``submitted`` -> first ``allocation_start``, and each ``requeue`` -> the next one;
- detection: the fault -> the supervisor noticed (``stopping``, else the ``failure`` event);
- restart: noticed -> ranks started again (a new generation, a spare, or a new allocation);
- restore: ranks started -> ``train_started`` (process start, rendezvous, checkpoint load);
- startup: ``allocation_start`` -> the first ``train_started`` when no failure is involved;
- other: the rest (final checkpoint and hash, teardown, stop-on-signal before a requeue).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass

from slurmkit.ledger.names import ALLOCATION_START, RANKS_STARTED, REQUEUE, SUBMITTED, TRAIN_STARTED
from slurmkit.ledger.summary import (
    Event, FailureReport, Segment, failure_reports, kept_steps, segments,
)

LABELS = ("productive", "lost", "queue", "detection", "restart", "restore", "startup", "other")


@dataclass(frozen=True)
class Span:
    label: str
    start: float
    end: float


def _t(e: Event) -> float:
    return float(e["t"])


class _Times:
    """Sorted times per event name: "the next X at or after t" by bisection, not by a scan of
    a ledger that holds every node's heartbeats."""

    def __init__(self, events: Sequence[Event]) -> None:
        self.by_name: dict[str, list[float]] = {}
        for e in events:
            self.by_name.setdefault(str(e.get("event")), []).append(_t(e))
        for times in self.by_name.values():
            times.sort()

    def next(self, name: str, after: float) -> float | None:
        times = self.by_name.get(name, [])
        i = bisect_left(times, after)
        return times[i] if i < len(times) else None


def _segment_spans(segs: Sequence[Segment], failures: Sequence[FailureReport]) -> list[Span]:
    out = []
    for i, (seg, kept) in enumerate(zip(segs, kept_steps(segs))):
        kept_t = seg.time_at(kept)
        out.append(Span("productive", seg.start, kept_t))
        if i + 1 < len(segs):
            end = segs[i + 1].start
            faults = [f.fault_time for f in failures if seg.start <= f.fault_time < end]
            stop = min(faults) if faults else seg.points[-1][0]
            out.append(Span("lost", kept_t, max(kept_t, stop)))
    return out


def _failure_spans(times: _Times, failures: Sequence[FailureReport]) -> list[Span]:
    out = []
    for f in failures:
        noticed = f.fault_time + f.detection_s if f.detection_s is not None else f.time
        out.append(Span("detection", f.fault_time, noticed))
        ranks = times.next(RANKS_STARTED, f.time)
        if ranks is None:
            continue
        out.append(Span("restart", noticed, ranks))
        started = times.next(TRAIN_STARTED, ranks)
        if started is not None:
            out.append(Span("restore", ranks, started))
    return out


def _queue_and_startup(times: _Times, last: float) -> list[Span]:
    out = []
    for kind in (SUBMITTED, REQUEUE):
        for t in times.by_name.get(kind, []):
            alloc = times.next(ALLOCATION_START, t)
            if alloc is not None:
                out.append(Span("queue", t, alloc))
            elif kind == REQUEUE:  # requeued and never started again (yet)
                out.append(Span("queue", t, last))
    for t in times.by_name.get(ALLOCATION_START, []):
        started = times.next(TRAIN_STARTED, t)
        if started is not None:
            out.append(Span("startup", t, started))
    return out


def spans(raw: Sequence[Event]) -> list[Span]:
    """Labelled intervals, possibly overlapping (``partition`` resolves them)."""
    events = sorted(raw, key=_t)
    segs = segments(events)
    failures = failure_reports(events, segs)
    times = _Times(events)
    found = [*_segment_spans(segs, failures), *_failure_spans(times, failures),
             *_queue_and_startup(times, _t(events[-1]) if events else 0.0)]
    return [s for s in found if s.end > s.start]


def partition(found: Sequence[Span], start: float, end: float) -> list[Span]:
    """Non-overlapping spans covering [start, end]; the earlier label in LABELS wins."""
    rank = {label: i for i, label in enumerate(LABELS)}
    cuts = sorted({start, end, *(t for s in found for t in (s.start, s.end) if start < t < end)})
    out: list[Span] = []
    for a, b in zip(cuts, cuts[1:]):
        covering = [s.label for s in found if s.start <= a and s.end >= b]
        label = min(covering, key=rank.__getitem__) if covering else "other"
        if out and out[-1].label == label and out[-1].end == a:
            out[-1] = Span(label, out[-1].start, b)
        else:
            out.append(Span(label, a, b))
    return out


def breakdown(raw: Sequence[Event]) -> dict[str, float]:
    """Seconds per label (all of LABELS, zeros included); they add up to the wall time."""
    events = sorted(raw, key=_t)
    totals = dict.fromkeys(LABELS, 0.0)
    if not events:
        return totals
    for s in partition(spans(events), _t(events[0]), _t(events[-1])):
        totals[s.label] += s.end - s.start
    return totals
