"""Figures about one run, derived from its ledger (RUN_DIR/ledger.jsonl).

Pure functions over the list of event dicts ``read_ledger`` yields; no I/O here. Times are epoch
seconds in the ledger and seconds (durations) in the report.

How the figures are defined:

- wall time: first event (``submitted``) to the last one; queueing and requeue waits count.
- a *segment* is one stretch of training: from a ``train_started`` event (rank 0, after any
  restore; it carries the step it starts from) to the next ``train_started`` or the end. For
  another program, rank 0's agent writes it at the generation's first step line, with the
  step of the program's newest finished save (slurmkit.launch.programwatch). A ledger without
  any leaves productive time, goodput and steps lost unknown (None), never 0.
- steps lost by a failure: the step the run had reached at the fault (``fault_injected.step``
  when a test recorded it, else the highest step seen in the failing segment: a lower bound,
  as heartbeats reach the ledger only every supervisor.heartbeat_ledger_interval_s) minus the
  step the next segment started from (the restored checkpoint).
- productive time: per segment, the time from its start until it reached the last step that a
  later segment did not throw away (all of it for the last segment). goodput = productive / wall.
- detection latency (only when a ``fault_injected`` event says when the fault happened): fault
  to the supervisor's ``stopping`` transition (else to the ``failure`` event).
- time to restart / restore / resume: fault to the next ``ranks_started``, to the next
  ``ckpt_restored`` or ``train_started``, to the first ``heartbeat`` sample after training began
  again. The fault time is ``fault_injected``'s when known, else the failure's ``time_of_fault``.

Heartbeat samples taken between ``ranks_started`` and the ``train_started`` that follows are
dropped: ranks that have not started training yet cannot have stepped, and such samples come
from heartbeat files the previous allocation left behind.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from slurmkit.ledger.names import (CKPT_RESTORED, CKPT_SAVED, DECISION, END, EXCLUSION, FAILURE,
                                   FAULT_INJECTED, HEARTBEAT, RANKS_STARTED, REQUEUE, STATE, TRAIN_FINISHED,
                                   SUBMITTED, TRAIN_STARTED, TRAIN_STOPPED)
from slurmkit.untrusted import safe_line

Event = Mapping[str, Any]


@dataclass(frozen=True)
class FailureReport:
    time: float  # epoch seconds of the ledger's failure event (node 0 decided)
    cls: str
    rank: int
    node: str
    evidence: str
    action: str | None  # the decision that followed, if any
    fault_time: float  # fault_injected time, else the classifier's time_of_fault
    injected: bool  # fault_time comes from a fault_injected event
    detection_s: float | None
    restart_s: float | None  # fault -> ranks started again
    restore_s: float | None  # fault -> checkpoint restored / training started again
    resume_s: float | None  # fault -> first heartbeat sample after training started again
    fault_step: int | None
    restored_step: int | None
    steps_lost: int | None
    line: str = ""  # the failing rank's last word, as the ledger has it (untrusted: see failure_text)


@dataclass(frozen=True)
class RunReport:
    start: float  # epoch seconds of the first event
    wall_s: float
    status: str  # the last `end` event's status, "running" when there is none (or a resume came after it)
    failures_by_class: dict[str, int]
    restarts: int  # same nodes, next generation
    replacements: int  # a spare took a node's place
    requeues: int
    excluded_nodes: list[str]
    final_step: int | None
    # None (unknown, never 0) when the ledger shows no training at all (no ``train_started``: a
    # program whose steps nothing reads; slurmkit.launch.programwatch)
    productive_s: float | None
    goodput: float | None  # productive_s / wall_s (0 for an empty run)
    steps_lost: int | None
    failures: list[FailureReport] = field(default_factory=list)


@dataclass(frozen=True)
class Segment:
    start: float
    start_step: int
    points: list[tuple[float, int]]  # (time, step reached), time-ordered, from the start on

    @property
    def end_step(self) -> int:
        return max(s for _, s in self.points)

    def time_at(self, step: int) -> float:
        """When the segment reached ``step`` (linear between samples; its last time if never)."""
        for (t0, s0), (t1, s1) in zip(self.points, self.points[1:]):
            if s0 < step <= s1:
                return t0 + (t1 - t0) * (step - s0) / (s1 - s0)
        return self.start if step <= self.start_step else self.points[-1][0]


# ------------------------------------------------------------------ small accessors

def _t(e: Event) -> float:
    return float(e["t"])


def _of(events: Iterable[Event], *names: str) -> list[Event]:
    return [e for e in events if e.get("event") in names]


def _first_after(events: Sequence[Event], names: tuple[str, ...], after: float) -> Event | None:
    return next((e for e in events if e.get("event") in names and _t(e) >= after), None)


def _sample_step(e: Event) -> int | None:
    """The step a heartbeat sample shows: the slowest rank's (all ranks have done it). The
    ledger's reader checked that ``steps`` is an object; what it maps to is a rank's to say, so
    only integers count."""
    raw = e.get("steps")
    steps = [v for v in (raw.values() if isinstance(raw, dict) else ())
             if isinstance(v, int) and not isinstance(v, bool)]
    return min(steps) if steps else None


# ------------------------------------------------------------------ timeline

def fresh_heartbeats(events: Sequence[Event]) -> list[Event]:
    """Heartbeat samples, less those taken while ranks were starting (see the module doc)."""
    out, starting = [], False
    for e in events:
        kind = e.get("event")
        if kind == RANKS_STARTED:
            starting = True
        elif kind == TRAIN_STARTED:
            starting = False
        elif kind == HEARTBEAT and not starting and _sample_step(e) is not None:
            out.append(e)
    return out


def step_points(events: Sequence[Event]) -> list[tuple[float, int]]:
    """(time, step) pairs from everything that says a step was reached, time-ordered."""
    points = [(_t(e), int(e["step"])) for e in _of(events, TRAIN_STARTED, CKPT_SAVED,
                                                   TRAIN_STOPPED, TRAIN_FINISHED)
              if e.get("step") is not None]
    points += [(_t(e), int(_sample_step(e) or 0)) for e in fresh_heartbeats(events)]
    return sorted(points)


def segments(events: Sequence[Event]) -> list[Segment]:
    """One segment per ``train_started``, with the step points up to the next one."""
    starts = _of(events, TRAIN_STARTED)
    points = step_points(events)
    times = [t for t, _ in points]
    out = []
    for i, e in enumerate(starts):
        end = _t(starts[i + 1]) if i + 1 < len(starts) else float("inf")
        lo, hi = bisect_left(times, _t(e)), bisect_left(times, end)
        step = int(e.get("step") or 0)
        out.append(Segment(_t(e), step, points[lo:hi] or [(_t(e), step)]))
    return out


def kept_steps(segs: Sequence[Segment]) -> list[int]:
    """Per segment, the last step no later segment threw away."""
    return [min(s.end_step, segs[i + 1].start_step) if i + 1 < len(segs) else s.end_step
            for i, s in enumerate(segs)]


def productive_seconds(segs: Sequence[Segment]) -> float:
    return sum(max(0.0, s.time_at(k) - s.start) for s, k in zip(segs, kept_steps(segs)))


# ------------------------------------------------------------------ failures

def _segment_of(segs: Sequence[Segment], t: float) -> int | None:
    idx = [i for i, s in enumerate(segs) if s.start <= t]
    return idx[-1] if idx else None


def _injected_fault(events: Sequence[Event], before: float, after: float) -> Event | None:
    """The last fault_injected event in (after, before]: the fault behind a failure."""
    hits = [e for e in _of(events, FAULT_INJECTED) if after < _fault_t(e) <= before]
    return hits[-1] if hits else None


def _fault_t(e: Event) -> float:
    return float(e.get("time", e["t"]))


def _since(fault_t: float, e: Event | None) -> float | None:
    return None if e is None else _t(e) - fault_t


def _steps_lost(segs: Sequence[Segment], fail_t: float, previous_t: float,
                fault: Event | None) -> tuple[int | None, int | None, int | None]:
    """(fault step, restored step, steps lost) for a failure at ``fail_t``."""
    if not segs:  # no training seen at all: what was lost is unknown, not 0
        return (None if fault is None or fault.get("step") is None else int(fault["step"]), None, None)
    i = _segment_of(segs, fail_t)
    if i is None or previous_t >= segs[i].start:
        return (None, None, 0)  # failed again before training restarted: nothing new to lose
    reached = segs[i].end_step if fault is None or fault.get("step") is None else int(fault["step"])
    if i + 1 >= len(segs):
        return (reached, None, None)
    restored = segs[i + 1].start_step
    return (reached, restored, max(0, reached - restored))


#: The most of a failure's line kept and shown (the ledger's writer bounds it too, but the
#: ledger is untrusted: a hand-edited one may hold a megabyte on one line).
LINE_CHARS = 500
#: The most of a failure's text on a terminal (after escaping, which can lengthen it), and of
#: its evidence there (a long NCCL line must leave room for the rank's last word).
SHOWN_CHARS = 300
EVIDENCE_SHOWN_CHARS = 120


def _text(value: object) -> str:
    return value if isinstance(value, str) else ""


def failure_report(events: Sequence[Event], segs: Sequence[Segment], failure: Event,
                   previous_t: float) -> FailureReport:
    """Figures for one ``failure`` event (``previous_t``: the failure before it, or -inf)."""
    fail_t = _t(failure)
    fault = _injected_fault(events, fail_t, previous_t)
    fault_t = _fault_t(fault) if fault is not None else float(failure.get("time_of_fault", fail_t))
    detected = next((e for e in _of(events, STATE) if e.get("new") == "stopping"
                     and fault_t <= _t(e) <= fail_t), failure)
    decision = _first_after(events, (DECISION,), fail_t)
    restarted = _first_after(events, (TRAIN_STARTED,), fail_t)
    after_start = _t(restarted) if restarted is not None else float("inf")
    beat = next((e for e in fresh_heartbeats(events) if _t(e) >= after_start), None)
    fault_step, restored_step, lost = _steps_lost(segs, fail_t, previous_t, fault)
    return FailureReport(
        time=fail_t, cls=str(failure.get("cls")), rank=int(failure.get("rank", -1)),
        node=str(failure.get("node", "")), evidence=str(failure.get("evidence", "")),
        action=None if decision is None else str(decision.get("action")),
        fault_time=fault_t, injected=fault is not None,
        detection_s=_since(fault_t, detected) if fault is not None else None,
        restart_s=_since(fault_t, _first_after(events, (RANKS_STARTED,), fail_t)),
        restore_s=_since(fault_t, _first_after(events, (CKPT_RESTORED, TRAIN_STARTED), fail_t)),
        resume_s=_since(fault_t, beat), fault_step=fault_step, restored_step=restored_step,
        steps_lost=lost, line=_text(failure.get("line"))[:LINE_CHARS])


def percent(value: float | None) -> str:
    """A fraction as the reports print it, ``-`` when unknown."""
    return "-" if value is None else f"{value:.1%}"


def failure_text(f: FailureReport) -> str:
    """One failure on one terminal line: its class, where (``rank 3 on node2``, or the node
    alone), what decided it and the rank's last word (``python: can't open file ...``, a
    traceback's last line). Every character that is not printable escaped (ledger content is
    untrusted: an ANSI sequence must not drive the terminal), at most SHOWN_CHARS characters."""
    where = f"on {f.node}" if f.rank < 0 else f"rank {f.rank} on {f.node}"
    said = f": {f.line}" if f.line else ""
    evidence = f.evidence
    if len(evidence) > EVIDENCE_SHOWN_CHARS:
        evidence = evidence[:EVIDENCE_SHOWN_CHARS - 3] + "..."
    text = safe_line(f"{f.cls}, {where} ({evidence}){said}")
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS - 3] + "..."


def failure_reports(events: Sequence[Event], segs: Sequence[Segment]) -> list[FailureReport]:
    out, previous = [], float("-inf")
    for f in _of(events, FAILURE):
        out.append(failure_report(events, segs, f, previous))
        previous = _t(f)
    return out


# ------------------------------------------------------------------ the whole run

def _decisions(events: Sequence[Event]) -> Counter[str]:
    return Counter(str(e.get("action")) for e in _of(events, DECISION))


def _excluded(events: Sequence[Event]) -> list[str]:
    return sorted({str(n) for e in _of(events, EXCLUSION) for n in e.get("nodes") or []})


def summarize(raw: Iterable[Event]) -> RunReport:
    """Every figure of the report from the ledger's events (in any order)."""
    events = sorted(raw, key=_t)
    if not events:
        return RunReport(0.0, 0.0, "empty", {}, 0, 0, 0, [], None, 0.0, 0.0, 0)
    start, wall = _t(events[0]), _t(events[-1]) - _t(events[0])
    segs = segments(events)
    failures = failure_reports(events, segs)
    ends = _of(events, END)
    resubmitted = [e for e in _of(events, SUBMITTED) if e.get("resumes") is not None]
    # a run resumed after its end (slurmkit resume) runs again until its next end
    running_again = bool(ends and resubmitted and _t(resubmitted[-1]) > _t(ends[-1]))
    productive = productive_seconds(segs) if segs else None
    decisions = _decisions(events)
    return RunReport(
        start=start, wall_s=wall,
        status=str(ends[-1].get("status")) if ends and not running_again else "running",
        failures_by_class=dict(Counter(f.cls for f in failures)),
        restarts=decisions["restart"], replacements=decisions["replace_node"],
        requeues=len(_of(events, REQUEUE)), excluded_nodes=_excluded(events),
        final_step=max((s for _, s in step_points(events)), default=None),
        productive_s=productive,
        goodput=None if productive is None else productive / wall if wall > 0 else 0.0,
        steps_lost=sum(f.steps_lost or 0 for f in failures) if segs else None, failures=failures)
