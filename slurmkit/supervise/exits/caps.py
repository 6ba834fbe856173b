"""The caps a requeue is checked against before it is made: supervisor.max_requeues over the
requeues failures caused (one marker file each under the run directory), and the partition a
requeue that excludes nodes must still fit in.

Node 0's decider checks its requeue decisions here, and the exits check theirs (a successor of
node 0, node 0's own agent failing): one object per agent, shared by both, which also carries
whether the requeue about to be made follows a failure (it then leaves its marker)."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any, Protocol

from slurmkit.runfiles import REQUEUE_MARKS
from slurmkit.slurm.client import SlurmClient
from slurmkit.slurm.errors import SlurmError
from slurmkit.slurm.hostlist import expand_hostlist
from slurmkit.supervise.exits.requeue import job_ref
from slurmkit.supervise.policy import requeue_refusal
from slurmkit.supervise.slurmview import DECISION_RETRY, DECISION_TIMEOUT_S

log = logging.getLogger(__name__)


class _Ledger(Protocol):
    def append(self, event: str, **fields: Any) -> Any: ...


class _Where(Protocol):
    """What the caps read of where the agent is (slurmkit.supervise.shared.Where)."""

    @property
    def attempt(self) -> str: ...
    @property
    def job_id(self) -> str: ...
    @property
    def nodes(self) -> tuple[str, ...]: ...


class RequeueCaps:
    """The requeue caps of one agent. ``where`` names this attempt's marker (so a successor
    deciding again adds none), the job, and how many nodes it needs."""

    def __init__(self, where: _Where, *, run_dir: str, max_requeues: int, env: Mapping[str, str],
                 slurm: SlurmClient | None) -> None:
        self.where, self.run_dir, self.max_requeues, self.env, self.slurm = where, run_dir, max_requeues, env, slurm
        #: The requeue about to be made follows a failure (set by whoever decided it).
        self.failure_pending = False

    def failure_requeues(self) -> int:
        """Earlier requeues of this run that a failure caused (this attempt's own not counted)."""
        try:
            names = os.listdir(os.path.join(self.run_dir, REQUEUE_MARKS))
        except OSError:
            return 0
        mine = f"failure.{self.where.attempt}"
        return sum(1 for n in names if n.startswith("failure.") and n != mine)

    def mark_if_failure(self) -> None:
        """A requeue is being made: a failure's leaves its marker (what max_requeues counts)."""
        if not self.failure_pending:
            return
        marks = os.path.join(self.run_dir, REQUEUE_MARKS)
        os.makedirs(marks, exist_ok=True)
        with open(os.path.join(marks, f"failure.{self.where.attempt}"), "a"):
            pass

    def refused(self, ledger: _Ledger, gen: int, exclude: tuple[str, ...], *, failure: bool) -> str | None:
        """Why this requeue must stop the run instead (Detected/Requirement/Fix), or None; a
        refusal is said in ``ledger``.

        A failure's requeue counts against supervisor.max_requeues; one that excludes nodes is
        checked against the partition, with one bounded query of the job (its partition and
        ExcNodeList) and of the partitions: decisions are rare. Slurm not answering checks
        nothing (the requeue goes ahead: a slow controller must not stop a run)."""
        max_requeues = self.max_requeues
        done = self.failure_requeues() if failure else 0
        partition: str | None = None
        members: list[str] | None = None
        excluded = list(exclude)
        if exclude and self.slurm is not None and done < max_requeues:
            try:
                client = self.slurm.bounded(DECISION_RETRY, DECISION_TIMEOUT_S)
                info = client.job(job_ref(self.where.job_id, self.env))
                excluded = sorted({*info.excluded_nodes, *exclude})
                partition = info.partition
                for p in client.partitions():
                    if p.name == partition and p.nodes and p.nodes.upper() != "ALL":
                        members = expand_hostlist(p.nodes)
            except SlurmError as exc:
                log.warning("could not check the requeue against the partition: %s", exc)
        why = requeue_refusal(failure_requeues=done if failure else None, max_requeues=max_requeues,
                              excluded=excluded, partition=partition, partition_nodes=members,
                              needed=len(self.where.nodes))
        if why is not None:
            ledger.append("requeue_refused", reason=why, generation=gen, failure_requeues=done,
                          max_requeues=max_requeues, excluded=excluded, partition=partition,
                          partition_nodes=len(members) if members is not None else None,
                          needed=len(self.where.nodes))
        return why
