"""Is this SIGTERM Slurm's preemption of a job it means to requeue?

Slurm preempts a job (a higher PriorityTier partition or QOS needs its nodes) by sending its
steps SIGTERM at PreemptTime and, GraceTime seconds later, ending it: with PreemptMode=REQUEUE
the job is then requeued. A job that checkpoints and exits inside GraceTime, as slurmkit's
ranks do on SIGTERM, ends by itself before that: seen on the local cluster (Slurm 22.05,
preempt/partition_prio, GraceTime=60), the job ended COMPLETED and was never requeued, so the
run stopped for good. ``scancel`` and a node shutdown send the same SIGTERM and must not come
back. So node 0, after every rank saved and left on a SIGTERM, asks Slurm once:

* ``scontrol show job``: a PreemptTime (and Requeue=1) says preemption;
* the job's partition's PreemptMode, else the cluster's: REQUEUE says Slurm would have
  requeued it. CANCEL, SUSPEND or OFF: the site's choice stands, slurmkit does not requeue.

Then it requeues the job itself at once (the nodes go to the preemptor without waiting out
GraceTime), exactly as after the time-limit warning. One bounded query per preemption.
"""

from __future__ import annotations

import logging

from slurmkit.slurm.client import SlurmClient
from slurmkit.slurm.errors import SlurmError
from slurmkit.supervise.slurmview import DECISION_RETRY, DECISION_TIMEOUT_S

log = logging.getLogger(__name__)

_UNSET = frozenset({"", "none", "unknown", "(null)", "n/a"})


def preempt_mode(client: SlurmClient, partition: str | None) -> str:
    """The PreemptMode that applies to a job of ``partition`` (its own, else the cluster's)."""
    if partition:
        for p in client.partitions():
            if p.name == partition and p.raw.get("PreemptMode", "").strip().lower() not in _UNSET:
                return p.raw["PreemptMode"].strip().upper()
    return client.config().get("PreemptMode", "OFF").strip().upper()


def requeue_after_preemption(client: SlurmClient, job_id: str) -> str | None:
    """The requeue's reason when the SIGTERM was a preemption Slurm would requeue; else None
    (scancel, an admin, a node shutdown, PreemptMode CANCEL/SUSPEND, or Slurm unreachable)."""
    slurm = client.bounded(DECISION_RETRY, DECISION_TIMEOUT_S)
    try:
        info = slurm.job(job_id)
        when = info.raw.get("PreemptTime", "").strip()
        if when.lower() in _UNSET or not info.requeue:
            return None
        mode = preempt_mode(slurm, info.partition)
    except SlurmError as exc:
        log.warning("asking Slurm whether job %s was preempted: %s", job_id, exc)
        return None
    if "REQUEUE" not in mode.split(","):
        log.info("job %s was preempted with PreemptMode=%s: Slurm's way, not requeued", job_id, mode)
        return None
    return (f"preempted at {when} (PreemptMode={mode}): final checkpoint saved; requeued now "
            "(a job that ends inside GraceTime is not requeued by Slurm)")
