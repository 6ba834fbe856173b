"""What ended the previous allocation of a requeued job, told at the start of this one.

slurmkit records its own decisions as it makes them. A loss that Slurm handled by itself (a
NODE_FAIL requeue while no agent could act, a preemption with PreemptMode=REQUEUE, an admin's
``scontrol requeue``) leaves nothing in the ledger: the run's report said "failures: none" and
the hours between the two allocations went unexplained. So node 0, once per allocation of a
requeued job (``SLURM_RESTART_COUNT`` > 0), or of a successor job (``SLURMKIT_PREDECESSOR_ATTEMPT``,
supervise/exits/successor.py: then the predecessor's last attempt is the previous one), asks:

* the previous attempt's done marker (``rdzv/<job>-<n-1>.done``, supervise/exits/succession.py): its
  decision maker left one when slurmkit ended the attempt itself;
* ``scontrol show job``: when this attempt was queued (SubmitTime is the requeue), eligible and
  started: ``queued_s`` and ``held_s``;
* ``sacct --duplicates``: Slurm's state and nodes of the previous run (best effort: accounting
  lags, and a job shrunk with --no-kill has merged rows);
* for a NODE_FAIL, which of those nodes Slurm calls dead now (one ``scontrol show node``), and,
  where sacct has the field (Slurm 23.02+, the site probe's ``failed_node_field``), the node
  Slurm blamed (``FailedNode``): the one to name even when it is back by now.

Cost: one file stat and three Slurm queries per allocation, on node 0 only, whatever the job
size. A Slurm-handled loss becomes a ``failure`` (class node_loss or preemption, the fault's
time from accounting) and a ``decision`` (requeue, "by Slurm") before the ``allocation_start``
that answers it, so the report counts it like any other.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from datetime import datetime
from typing import Protocol

from slurmkit.slurm.client import SlurmClient
from slurmkit.slurm.errors import SlurmError
from slurmkit.failures.classes import FailureClass
from slurmkit.supervise.liveness import slurm_says_dead
from slurmkit.supervise.slurmview import DECISION_RETRY, DECISION_TIMEOUT_S
from slurmkit.supervise.exits.succession import read_done

log = logging.getLogger(__name__)

#: Slurm's state of the previous run -> the failure it was, when Slurm handled it alone.
SLURM_LOSSES = {"NODE_FAIL": FailureClass.NODE_LOSS, "PREEMPTED": FailureClass.PREEMPTION}
_ATTEMPT = re.compile(r"[0-9]+-[0-9]+")
_ACTIVE = frozenset({"RUNNING", "PENDING", "RESIZING", "SUSPENDED", "COMPLETING"})


@dataclass(frozen=True)
class Previous:
    attempt: str  # "<job id>-<n-1>"
    handled_by: str  # "slurmkit": its decision maker left the done marker; else "slurm"
    outcome: str  # the marker's outcome, else Slurm's state of that run, else "unknown"
    nodes: list[str] = field(default_factory=list)  # the previous run's nodes (sacct)
    dead: list[str] = field(default_factory=list)  # of those, the ones Slurm calls dead now
    ended: float | None = None  # when the previous run ended (sacct), epoch seconds
    queued_s: float | None = None  # this attempt: start - submit (Slurm resets it on requeue)
    held_s: float | None = None  # eligible - submit (the requeue hold)
    failed_node: str | None = None  # the node Slurm blamed for a NODE_FAIL (sacct FailedNode)

    @property
    def slurm_loss(self) -> FailureClass | None:
        """The failure Slurm handled alone, or None (slurmkit's own end, or no failure)."""
        return SLURM_LOSSES.get(self.outcome) if self.handled_by == "slurm" else None

    def fields(self) -> dict[str, object]:
        """The ``previous_attempt`` ledger event's fields."""
        out: dict[str, object] = {"attempt": self.attempt, "handled_by": self.handled_by,
                                  "outcome": self.outcome, "nodes": self.nodes}
        for key in ("ended", "queued_s", "held_s"):
            value = getattr(self, key)
            if value is not None:
                out[key] = round(value, 3)
        if self.failed_node:
            out["failed_node"] = self.failed_node
        return out

    @property
    def blamed(self) -> list[str]:
        """The nodes a Slurm-handled loss is put on: the one Slurm blamed, else those it calls
        dead now."""
        return [self.failed_node] if self.failed_node else list(self.dead)


def _seconds(a: datetime | None, b: datetime | None) -> float | None:
    return None if a is None or b is None else max(0.0, (b - a).total_seconds())


def _previous_run(client: SlurmClient, job_id: str) -> tuple[str, list[str], float | None, str | None]:
    """(state, nodes, end, failed node) of the newest finished run of ``job_id`` in accounting;
    the failed node only where it is one of that run's nodes (a value from sacct, checked)."""
    rows = [r for r in client.sacct(job_id, duplicates=True)
            if r.step is None and r.state not in _ACTIVE and r.end is not None]
    if not rows:
        return "unknown", [], None, None
    last = max(rows, key=lambda r: r.end or datetime.min)
    failed = last.failed_node if last.failed_node in last.nodes else None
    return last.state, last.nodes, last.end.timestamp() if last.end else None, failed


def previous_attempt(run_dir: str, job_id: str, restart_count: int,
                     client: SlurmClient | None, predecessor: str = "") -> Previous | None:
    """What ended attempt ``restart_count - 1``, or, in a successor job's first allocation, the
    predecessor's last attempt ``predecessor`` (``<job>-<n>``, from its environment); None for
    a run's first allocation. Never raises on a Slurm error: what could not be asked stays
    unknown."""
    if not job_id:
        return None
    if restart_count >= 1:
        attempt, earlier = f"{job_id}-{restart_count - 1}", job_id
    elif _ATTEMPT.fullmatch(predecessor) and not predecessor.startswith(f"{job_id}-"):
        attempt, earlier = predecessor, predecessor.split("-", 1)[0]
    else:
        return None
    done = read_done(run_dir, attempt)
    prev = Previous(attempt, "slurmkit" if done is not None else "slurm",
                    done.outcome if done is not None else "unknown")
    if client is None:
        return prev
    queued = held = None
    client = client.bounded(DECISION_RETRY, DECISION_TIMEOUT_S)  # never a long wait at the start
    try:
        info = client.job(job_id)
        queued = _seconds(info.submit_time, info.start_time)
        held = _seconds(info.submit_time, info.eligible_time)
    except SlurmError as exc:
        log.warning("scontrol show job %s at the allocation's start: %s", job_id, exc)
    state: str = "unknown"
    nodes: list[str] = []
    ended: float | None = None
    failed: str | None = None
    try:
        state, nodes, ended, failed = _previous_run(client, earlier)
    except SlurmError as exc:
        log.warning("sacct of job %s's previous run: %s", earlier, exc)
    dead: list[str] = []
    if done is None and state == "NODE_FAIL" and nodes:
        try:
            dead = sorted(n.name for n in client.nodes(nodes)
                          if slurm_says_dead("+".join([n.state, *n.flags])))
        except SlurmError as exc:
            log.warning("scontrol show node %s: %s", ",".join(nodes), exc)
    outcome = prev.outcome if done is not None else state
    return Previous(attempt, prev.handled_by, outcome, nodes, dead, ended, queued, held,
                    failed if state == "NODE_FAIL" else None)


#: How a requeue decision Slurm made itself (recorded at the next allocation's start) begins:
#: its outcome is that allocation, there is no requeue event of an agent before it.
BY_SLURM = "by Slurm"


class _Ledger(Protocol):
    def append(self, event: str, **fields: object) -> None: ...


def record_previous(ledger: _Ledger, prev: Previous | None, now: float) -> None:
    """Write what ended the previous attempt; a loss Slurm handled alone as a failure and its
    decision (a requeue, by Slurm), so that the report and the chaos invariants see it."""
    if prev is None:
        return
    ledger.append("previous_attempt", **prev.fields())
    cls = prev.slurm_loss
    if cls is None:
        return
    blamed = prev.blamed
    where = f" on {','.join(blamed)}" if blamed else ""
    source = " (sacct FailedNode)" if prev.failed_node else ""
    evidence = (f"Slurm ended attempt {prev.attempt} {prev.outcome}{where}{source} and requeued the job "
                "itself (no agent recorded it)")
    ledger.append("failure", cls=cls.value, node=",".join(blamed), evidence=evidence,
                  time_of_fault=prev.ended if prev.ended is not None else now)
    ledger.append("decision", action="requeue", reason=f"{BY_SLURM} ({prev.outcome})",
                  exclude=list(prev.dead))
