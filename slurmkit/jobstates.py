"""Job states for the watching verbs, at most one slurmctld query per refresh for all jobs shown.

A watcher showing twenty runs must not cost slurmctld twenty calls a second. :class:`JobPoller`
asks ``squeue -t all -j id1,id2,...`` once per :meth:`JobPoller.poll` for the jobs not known to
be over (``-t all``: slurmctld's own word on jobs that ended within MinJobAge; sacct would show
a job cancelled while pending after a requeue as REQUEUED for good); a job slurmctld forgot
is asked of ``sacct`` (slurmdbd, not slurmctld); a terminal state is kept, never asked again. Jobs of the local executor (their id is the
pid of submitit's local controller) are looked up in the process table.

Both Slurm commands go through :class:`slurmkit.slurm.client.SlurmClient` and so through its
retrying runner; a controller that stays unreachable shows as state ``UNKNOWN``, not a crash.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from slurmkit.errors import ConfigError
from slurmkit.slurm.client import SlurmClient, slurm_client
from slurmkit.slurm.errors import SlurmError
from slurmkit.slurm.hostlist import expand_hostlist
from slurmkit.slurm.records import TERMINAL_STATES

log = logging.getLogger(__name__)

UNKNOWN, GONE = "UNKNOWN", "GONE"


@dataclass(frozen=True)
class JobRef:
    job_id: str  # Slurm job id, array task (``123_4``), or the local controller's pid
    executor: str  # "slurm" | "local"


@dataclass(frozen=True)
class JobState:
    state: str  # Slurm's state (PENDING, RUNNING, COMPLETED...), RUNNING/GONE locally, UNKNOWN
    where: str = ""  # the node list while running, the pending reason while pending

    @property
    def over(self) -> bool:
        return self.state in TERMINAL_STATES or self.state == GONE


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (the controller ended but its parent has not reaped it) is over too.
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return True


def _row_ids(job_id: str) -> list[str]:
    """squeue prints pending array tasks folded (``123_[1-3,5]``): the ids that row stands for."""
    if "_[" in job_id:
        try:
            return expand_hostlist(re.sub(r"%\d+", "", job_id))  # "%K": the array's throttle
        except ConfigError:
            return [job_id]
    return [job_id]


def make_client(env: Mapping[str, str]) -> SlurmClient | None:
    """The project's Slurm client when ``squeue`` is on PATH, else None (local runs only)."""
    if shutil.which("squeue", path=env.get("PATH")) is None:
        return None
    return slurm_client(env, interactive=True)


class JobPoller:
    """Current states of many jobs with one batched query; remembers jobs that are over.

    Args:
        client: the Slurm client, or None where there is no Slurm (local runs only).
        pid_alive: the process-table lookup for local jobs (tests pass their own).
    """

    def __init__(self, client: SlurmClient | None,
                 pid_alive: Callable[[int], bool] = _pid_alive) -> None:
        self.client = client
        self._pid_alive = pid_alive
        self._final: dict[JobRef, JobState] = {}
        self.queries = 0  # Slurm commands run so far (squeue and sacct)

    def poll(self, refs: Iterable[JobRef]) -> dict[JobRef, JobState]:
        wanted = list(dict.fromkeys(refs))
        out = {r: self._final[r] for r in wanted if r in self._final}
        for r in wanted:
            if r.executor == "local" and r not in out:
                alive = r.job_id.isdigit() and self._pid_alive(int(r.job_id))
                out[r] = JobState("RUNNING" if alive else GONE)
        slurm = [r for r in wanted if r.executor == "slurm" and r not in out]
        if slurm:
            out.update(self._poll_slurm(slurm))
        for r, s in out.items():
            if s.over:
                self._final[r] = s
        return out

    def _poll_slurm(self, refs: list[JobRef]) -> dict[JobRef, JobState]:
        if self.client is None:
            return {r: JobState(UNKNOWN) for r in refs}
        out: dict[JobRef, JobState] = {}
        ids = [r.job_id for r in refs]
        try:
            self.queries += 1
            rows = self.client.squeue(job_ids=ids, states="all")
        except SlurmError as exc:
            log.warning("squeue failed: %s", exc)
            return {r: JobState(UNKNOWN) for r in refs}
        by_id: dict[str, JobState] = {}
        for row in rows:
            where = row.node_list or ""
            if row.state == "PENDING":
                where = row.reason or where.strip("()")
            for jid in _row_ids(row.job_id):
                by_id[jid] = JobState(row.state, where)
        missing = []
        for r in refs:
            base = r.job_id.split("_")[0]
            state = by_id.get(r.job_id) or (by_id.get(base) if "_" not in r.job_id else None)
            if state is None:
                missing.append(r)
            else:
                out[r] = state
        if missing:
            out.update(self._from_accounting(missing))
        return out

    def _from_accounting(self, refs: list[JobRef]) -> dict[JobRef, JobState]:
        assert self.client is not None  # noqa: S101 - only called with a client
        try:
            self.queries += 1
            rows = [r for r in self.client.sacct(",".join(r.job_id for r in refs)) if not r.is_step]
        except SlurmError as exc:
            log.warning("sacct failed: %s", exc)
            return {r: JobState(UNKNOWN) for r in refs}
        last = {row.job_id: row for row in rows}  # requeued runs: the newest row comes last
        out = {}
        for r in refs:
            row = last.get(r.job_id)
            out[r] = JobState(row.state, row.node_list or "") if row else JobState(UNKNOWN)
        return out
