"""The invariants a campaign run must keep, as pure functions over what was observed.

Input is a :class:`RunFacts`: the ledger's events, Slurm's final state, ``final.json``, the
reference digest of the same run without faults, and what the driver did (the faults it
injected, the nodes it killed, the processes it found left). Each check returns a
:class:`Check` with a detail a person can act on; nothing here touches the cluster, so every
check is unit-tested on hand-made ledgers, including ones that must fail.

- ``completes``: Slurm says COMPLETED, the ledger ends ``completed`` and ``final.json`` holds
  the last step (no implemented menu item asks for a stop with 93, so a 93 is a failure);
- ``bit_exact``: the final parameters' sha256 equals the uninterrupted run's;
- ``lost_steps``: per fault, the step reached when it hit (for a fault in a restart: the newest
  checkpoint written before it) minus the step training resumed from afterwards is at most one
  checkpoint interval; a fault after which training never resumed fails;
- ``tiers_hold_final``: the newest save is durable on every tier its ``promote_to`` named, and
  the shared tier's directory holds it (the object tier, when configured, is named there too);
- ``healthy_excluded``: every node excluded (spare replacement or requeue) was killed by the
  campaign, had its NVMe tier filled by it, or failed twice with a node-suspect class (the policy's documented repeat rule);
- ``exclusions_honoured``: an excluded node runs nothing of the job afterwards (a requeue's
  next allocation leaves it out; a node a spare replaced starts no more ranks);
- ``no_leftover_processes``: no process of the job is alive on any node once it ended;
- ``ledger_consistent``: every failure has a decision, every decision its outcome (restart and
  replacement: the next generation's ranks start; requeue: a requeue and a new allocation;
  stop: an ``end``), every time-limit checkpoint a requeue; every injected fault was noticed
  and every failure is explained by an injected fault;
- ``tier_faults``: a full NVMe tier: the save that met it failed there for lack of space
  (``ckpt_failed`` tier nvme, reason disk_full) and was committed on another tier, or the
  node was moved; an S3 outage: a promotion to the object tier failed during it and the
  object tier holds a step at least as new afterwards (``ckpt_durable``);
- ``external``: reported, never failed: node losses another job caused on the shared machine
  (Slurm saw the node DOWN, the campaign did not kill it); they are not counted as unexplained
  failures or healthy exclusions;
- ``goodput``: reported, never failed (productive time / wall time, slurmkit.ledger.summary).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from slurmkit.failures.classes import CLASS_INFO, FailureClass
from slurmkit.ledger.names import (ALLOCATION_START, CHECKPOINTED_ON_SIGNAL, CKPT_DURABLE, CKPT_FAILED,
                                   CKPT_SAVED, DECISION, END, EXCLUSION, FAILURE, HEARTBEAT, RANKS_STARTED,
                                   REQUEUE, TRAIN_STARTED)
from slurmkit.supervise.exits.previous import BY_SLURM
from testkit.chaos.menu import BY_NAME

Event = Mapping[str, Any]
# what the run's ledger shows when it noticed a fault (default: a failure)
NOTICE_KINDS = {"time_limit_warning": (CHECKPOINTED_ON_SIGNAL, FAILURE),
                "nvme_full": (CKPT_FAILED,), "s3_down_during_promotion": (CKPT_FAILED,)}


@dataclass(frozen=True)
class Injected:
    """One fault the driver injected: when (epoch s), at which step (None: while restarting)."""

    kind: str
    moment: str
    t: float
    step: int | None
    nodes: tuple[str, ...] = ()
    ranks: tuple[int, ...] = ()
    phase: str = ""  # what the run was doing when it hit: "training" or "restarting"


@dataclass(frozen=True)
class RunFacts:
    events: Sequence[Event]
    interval: int
    steps: int
    reference_sha: str
    job_state: str
    final: Mapping[str, Any] | None
    injected: Sequence[Injected]
    killed_nodes: frozenset[str] = frozenset()
    leftover: Sequence[str] = ()
    # Nodes Slurm saw go DOWN during the run that the campaign did not kill: another job's test
    # on the shared machine. Their losses are reported as interference, never as a product bug.
    external_down: frozenset[str] = frozenset()
    shared_steps: tuple[int, ...] | None = None  # step directories in RUN_DIR/ckpt/shared (None: not read)
    filled_nodes: frozenset[str] = frozenset()  # nodes whose NVMe tier the campaign filled


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    value: Any = None  # the figure behind it (lost steps, excluded nodes, goodput)


@dataclass
class Verdict:
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def get(self, name: str) -> Check:
        return next(c for c in self.checks if c.name == name)


def _t(e: Event) -> float:
    return float(e["t"])


def _of(events: Sequence[Event], *names: str) -> list[Event]:
    return [e for e in events if e.get("event") in names]


def ordered(events: Sequence[Event]) -> list[Event]:
    """Time-ordered, heartbeats left out (the writers share this machine's clock)."""
    return sorted((e for e in events if e.get("event") != HEARTBEAT), key=_t)


# ------------------------------------------------------------------ the checks

def completes(f: RunFacts) -> Check:
    ends = _of(f.events, END)
    last = ends[-1] if ends else {}
    step = (f.final or {}).get("step")
    ok = f.job_state == "COMPLETED" and last.get("status") == "completed" and step == f.steps
    return Check("completes", ok, f"slurm {f.job_state}, ledger end {last.get('status', 'none')} "
                 f"(exit {last.get('exit_code', '-')}{', ' + str(last.get('reason')) if last.get('reason') else ''}), "
                 f"final step {step} of {f.steps}")


def bit_exact(f: RunFacts) -> Check:
    got = (f.final or {}).get("param_sha256")
    ok = got is not None and got == f.reference_sha
    return Check("bit_exact", ok, f"param_sha256 {str(got)[:16]} vs reference {f.reference_sha[:16]}")


def _saved_before(events: Sequence[Event], t: float) -> int | None:
    steps = [int(e["step"]) for e in _of(events, CKPT_SAVED, CKPT_DURABLE, CHECKPOINTED_ON_SIGNAL)
             if _t(e) <= t and e.get("step") is not None]
    return max(steps, default=None)


def _restarts(kind: str) -> bool:
    m = BY_NAME.get(kind)
    return m is None or m.restarts


def lost_per_fault(f: RunFacts) -> list[tuple[Injected, int | None, int | None]]:
    """(fault, step at risk, step resumed from) per injected fault. A fault that stops no rank
    (a full disk, an S3 outage) and was followed by no failure before the next fault (or the
    end) lost nothing: training went on from the step it hit."""
    ev = ordered(f.events)
    starts = _of(ev, TRAIN_STARTED)
    later = sorted(x.t for x in f.injected)
    out = []
    for fault in f.injected:
        at_risk = fault.step if fault.step is not None else _saved_before(f.events, fault.t)
        if not _restarts(fault.kind):
            until = next((t for t in later if t > fault.t), float("inf"))
            if not any(e.get("event") == FAILURE and fault.t < _t(e) < until for e in ev):
                out.append((fault, at_risk, at_risk))
                continue
        after = next((e for e in starts if _t(e) > fault.t), None)
        out.append((fault, at_risk, None if after is None else int(after["step"])))
    return out


def lost_steps(f: RunFacts) -> Check:
    worst, bad = 0, []
    for fault, at_risk, resumed in lost_per_fault(f):
        if resumed is None:
            bad.append(f"{fault.kind} at t={fault.t:.1f}: training never resumed")
            continue
        lost = max(0, (at_risk or 0) - resumed)
        worst = max(worst, lost)
        if lost > f.interval:
            bad.append(f"{fault.kind} at step {at_risk}: resumed from {resumed}, {lost} steps lost "
                       f"> interval {f.interval}")
    return Check("lost_steps", not bad, "; ".join(bad) or f"max {worst} step(s) lost per fault "
                 f"(interval {f.interval})", worst)


def _excluded(events: Sequence[Event]) -> set[str]:
    out = {str(n) for e in _of(events, EXCLUSION) for n in e.get("nodes") or []}
    return out | {str(n) for e in _of(events, REQUEUE) for n in e.get("exclude") or []}


def _repeat_rule(f: RunFacts) -> set[str]:
    """Nodes with two node-suspect failures in one allocation: the policy excludes them by
    design. A ``node_loss`` of a node that was never lost (not killed by the campaign, not
    DOWN in Slurm: e.g. only its agent died) does not count: that is the misjudgement this
    check exists to catch."""
    lost = f.killed_nodes | f.external_down
    out: set[str] = set()
    counts: Counter[str] = Counter()
    for e in ordered(f.events):
        if e.get("event") == ALLOCATION_START:
            counts = Counter()
        if e.get("event") != FAILURE or not e.get("node"):
            continue
        try:
            suspect = CLASS_INFO[FailureClass(str(e.get("cls")))].suspect_node
        except ValueError:
            suspect = False
        node = str(e["node"])
        if suspect and not (e.get("cls") == "node_loss" and node not in lost):
            counts[node] += 1
            if counts[node] >= 2:
                out.add(node)
    return out


def healthy_excluded(f: RunFacts) -> Check:
    excluded = _excluded(f.events)
    rule = _repeat_rule(f) - f.killed_nodes
    healthy = sorted(excluded - f.killed_nodes - rule - f.external_down - f.filled_nodes)
    detail = (f"excluded {sorted(excluded) or 'none'}; killed {sorted(f.killed_nodes) or 'none'}"
              + (f"; NVMe filled {sorted(f.filled_nodes)}" if f.filled_nodes else "")
              + (f"; by the repeat rule {sorted(rule & excluded)}" if rule & excluded else "")
              + (f"; lost outside the campaign {sorted(f.external_down)}" if f.external_down else ""))
    if healthy:
        detail = f"healthy node(s) {healthy} excluded; " + detail
    return Check("healthy_excluded", not healthy, detail, len(healthy))


def tiers_hold_final(f: RunFacts) -> Check:
    """The newest save was made durable on every tier its ``promote_to`` promised, and the
    shared tier's directory holds it."""
    saves = [e for e in _of(f.events, CKPT_SAVED) if e.get("step") is not None]
    if not saves:
        return Check("tiers_hold_final", False, "no checkpoint was saved")
    last = max(saves, key=lambda e: (int(e["step"]), _t(e)))
    step = int(last["step"])
    promised = [str(t) for t in last.get("promote_to") or []]
    durable = {str(e.get("tier")) for e in _of(f.events, CKPT_DURABLE) if e.get("step") == step}
    problems = [f"step {step} never durable on {t}" for t in promised if t not in durable]
    if f.shared_steps is not None and "lustre" in promised and step not in f.shared_steps:
        problems.append(f"step {step} is not in the shared tier's directory (holds {list(f.shared_steps)[-3:]})")
    return Check("tiers_hold_final", not problems, "; ".join(problems) or
                 f"step {step} durable on {', '.join(promised) or 'its own tier only'}", step)


def exclusions_honoured(f: RunFacts) -> Check:
    """A node the supervisor excluded runs none of the job's ranks afterwards: a requeue's
    next allocation leaves it out, a replaced node starts no more ranks in its allocation."""
    ev = ordered(f.events)
    problems = []
    for i, e in enumerate(ev):
        if e.get("event") == REQUEUE and e.get("exclude"):
            bad = set(map(str, e["exclude"]))
            nxt = next((x for x in ev[i + 1:] if x.get("event") == ALLOCATION_START), None)
            used = bad & set(map(str, (nxt or {}).get("nodes") or []))
            if used:
                problems.append(f"requeued without {sorted(bad)} at t={_t(e):.1f}, but the next allocation "
                                f"has {sorted(used)}")
        elif e.get("event") == EXCLUSION and e.get("how") == "spare":
            bad = set(map(str, e.get("nodes") or []))
            for x in ev[i + 1:]:
                if x.get("event") == ALLOCATION_START:
                    break
                if x.get("event") == RANKS_STARTED and str(x.get("node")) in bad:
                    problems.append(f"{x.get('node')} was replaced by a spare but started ranks of "
                                    f"generation {x.get('generation')}")
                    break
    return Check("exclusions_honoured", not problems, "; ".join(problems) or "every excluded node stayed out",
                 len(problems))


def no_leftover_processes(f: RunFacts) -> Check:
    return Check("no_leftover_processes", not f.leftover,
                 "none" if not f.leftover else "left: " + "; ".join(f.leftover), len(f.leftover))


def _outcome_problem(d: Event, later: Sequence[Event]) -> str | None:
    action, gen = d.get("action"), d.get("generation")
    if action in ("restart", "replace_node"):
        if not any(e.get("event") == RANKS_STARTED and gen is not None and e.get("generation") == gen + 1
                   for e in later):
            return f"decision {action} (generation {gen}) but no ranks of generation {gen + 1 if gen is not None else '?'} started"
        return None
    if action == "requeue" and str(d.get("reason", "")).startswith(BY_SLURM):
        # Slurm requeued the job itself (a NODE_FAIL, a preemption): recorded by the next
        # allocation's agent right before its start (slurmkit.supervise.exits.previous).
        if not any(e.get("event") == ALLOCATION_START for e in later):
            return f"decision requeue {d.get('reason')} but no new allocation started"
        return None
    if action == "requeue":
        rq = next((i for i, e in enumerate(later) if e.get("event") == REQUEUE), None)
        if rq is None:
            return f"decision requeue (generation {gen}) but no requeue event"
        if not any(e.get("event") == ALLOCATION_START for e in later[rq:]):
            return f"decision requeue (generation {gen}) requeued, but no new allocation started"
        return None
    if action == "stop":
        if not any(e.get("event") == END and e.get("status") == "stopped" for e in later):
            return f"decision stop (generation {gen}) but no end 'stopped'"
        return None
    return f"decision with unknown action {action!r}"


def ledger_consistent(f: RunFacts) -> Check:
    ev = ordered(f.events)
    problems: list[str] = []
    for i, e in enumerate(ev):
        kind = e.get("event")
        if kind == FAILURE:
            nxt = next((x for x in ev[i + 1:] if x.get("event") in (DECISION, FAILURE)), None)
            if nxt is None or nxt.get("event") != DECISION:
                problems.append(f"failure {e.get('cls')} (generation {e.get('generation')}) has no decision")
        elif kind == DECISION:
            p = _outcome_problem(e, ev[i + 1:])
            if p:
                problems.append(p)
        elif kind == CHECKPOINTED_ON_SIGNAL and e.get("signal") == "time_limit":
            rq = next((j for j, x in enumerate(ev[i + 1:]) if x.get("event") == REQUEUE), None)
            if rq is None or not any(x.get("event") == ALLOCATION_START for x in ev[i + 1 + rq:]):
                problems.append(f"time-limit checkpoint at step {e.get('step')} without a requeue "
                                "and a new allocation")
    problems += _noticed(f, ev) + _explained(f, ev)
    return Check("ledger_consistent", not problems, "; ".join(problems) or
                 f"{len(_of(ev, FAILURE))} failure(s), {len(_of(ev, DECISION))} decision(s), "
                 "each with its outcome")


def _noticed(f: RunFacts, ev: Sequence[Event]) -> list[str]:
    out = []
    for fault in f.injected:
        names = NOTICE_KINDS.get(fault.kind, (FAILURE,))
        if not any(e.get("event") in names and _t(e) >= fault.t for e in ev):
            out.append(f"{fault.kind} injected at t={fault.t:.1f} was never noticed (no {' or '.join(names)})")
    return out


def _explained(f: RunFacts, ev: Sequence[Event]) -> list[str]:
    """Each failure consumes one injected fault before it (two_at_once may cause two)."""
    credits = sorted((fault.t, 2 if fault.kind == "two_at_once" else 1) for fault in f.injected)
    pending: list[list[float]] = []
    out = []
    for e in _of(ev, FAILURE):
        if e.get("cls") == "node_loss" and str(e.get("node")) in f.external_down:
            continue  # interference: see external()
        while credits and credits[0][0] <= _t(e):
            t, n = credits.pop(0)
            pending.append([t, n])
        live = [p for p in pending if p[1] > 0]
        if not live:
            out.append(f"failure {e.get('cls')} on {e.get('node')} (rank {e.get('rank')}) at "
                       f"t={_t(e):.1f} follows no injected fault")
            continue
        live[0][1] -= 1
    return out


def _event_time(e: Event) -> float:
    """When a store event happened: the rank's own time (its ``time``), else the ledger's."""
    return float(e.get("time", e["t"]))


def _full_disk_problem(f: RunFacts, fault: Injected) -> str | None:
    node = fault.nodes[0] if fault.nodes else "?"
    after = [e for e in f.events if _event_time(e) >= fault.t]
    failed = sorted(int(e["step"]) for e in after if e.get("event") == CKPT_FAILED
                    and e.get("tier") == "nvme" and e.get("step") is not None)
    if not failed:
        return f"nvme_full on {node} at t={fault.t:.1f}: no save failed on the NVMe tier after it (the fill missed)"
    step = failed[0]
    full = [e for e in after if e.get("event") == CKPT_FAILED and e.get("tier") == "nvme"
            and e.get("step") == step and e.get("reason") == "disk_full"]
    elsewhere = [e for e in after if e.get("event") == CKPT_SAVED and e.get("step") == step
                 and e.get("tier") != "nvme"]
    moved = [e for e in _of(f.events, DECISION) if _t(e) >= fault.t and node in (e.get("exclude") or [])]
    problems = []
    if not full:
        problems.append(f"the NVMe failure of step {step} does not say disk_full")
    if not elsewhere and not moved:
        problems.append(f"step {step} was committed on no other tier and {node} was not moved")
    return f"nvme_full on {node}: " + "; ".join(problems) if problems else None


def _outage_problem(f: RunFacts, fault: Injected) -> str | None:
    """A promotion to S3 failed during the outage, and the object tier caught up afterwards:
    a step at least as new as the one that failed (a failure the promoter reports without its
    step, an unexpected error of its round, stands for the newest save made before it)."""
    after = sorted((e for e in f.events if _event_time(e) >= fault.t), key=_event_time)
    failed = next((e for e in after if e.get("event") == CKPT_FAILED and e.get("tier") == "object"), None)
    if failed is None:
        return f"S3 outage at t={fault.t:.1f}: no promotion to the object tier failed during it"
    step = failed.get("step")
    if step is None:
        step = max((int(e["step"]) for e in f.events if e.get("event") == CKPT_SAVED
                    and e.get("step") is not None and _event_time(e) <= _event_time(failed)), default=0)
    if not any(e.get("event") == CKPT_DURABLE and e.get("tier") == "object"
               and int(e.get("step") or -1) >= int(step) for e in after):
        return f"S3 outage at t={fault.t:.1f}: no step >= {step} (the one it failed) became durable on S3 afterwards"
    return None


def tier_faults(f: RunFacts) -> Check:
    """A full NVMe tier must cost no save (it goes to another tier, or the node is moved); an
    S3 outage must delay the object tier, not leave it behind for good."""
    problems, seen = [], 0
    for fault in f.injected:
        check = {"nvme_full": _full_disk_problem, "s3_down_during_promotion": _outage_problem}.get(fault.kind)
        if check is None:
            continue
        seen += 1
        p = check(f, fault)
        if p:
            problems.append(p)
    return Check("tier_faults", not problems, "; ".join(problems) or
                 (f"{seen} tier fault(s), each survived without losing a save" if seen else "none injected"),
                 len(problems))


def external(f: RunFacts) -> Check:
    """Reported, never failed: node losses the campaign did not cause (they still count in
    every other check: a run must survive them like any other)."""
    lost = [e for e in _of(f.events, FAILURE) if e.get("cls") == "node_loss"
            and str(e.get("node")) in f.external_down]
    return Check("external", True, f"{len(lost)} node loss(es) not caused by the campaign"
                 + (f" ({sorted(f.external_down)} went DOWN)" if f.external_down else ""), len(lost))


def goodput(f: RunFacts) -> Check:
    from slurmkit.ledger.summary import summarize

    g = summarize(list(f.events)).goodput
    return Check("goodput", True, f"{g:.3f}", g)


CHECKS = (completes, bit_exact, lost_steps, tiers_hold_final, healthy_excluded, exclusions_honoured, no_leftover_processes,
          ledger_consistent, tier_faults, external, goodput)


def verdict(f: RunFacts) -> Verdict:
    return Verdict([check(f) for check in CHECKS])
