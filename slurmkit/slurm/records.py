"""Typed records parsed from Slurm output. Frozen: they describe what Slurm said at one moment.

Times are naive ``datetime`` in the controller's local time (Slurm prints no zone); durations
are whole seconds; memory is in megabytes, as Slurm reports it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from types import MappingProxyType

from slurmkit.slurm.hostlist import expand_hostlist

#: Job states after which a job never runs again (unless requeued by someone).
TERMINAL_STATES = frozenset({
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
    "BOOT_FAIL", "DEADLINE", "REVOKED", "SPECIAL_EXIT",
})
#: Job states of a job still in the queue or running.
ACTIVE_STATES = frozenset({
    "PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "REQUEUE_FED",
    "REQUEUE_HOLD", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED", "RESV_DEL_HOLD",
})

def _empty() -> Mapping[str, str]:
    return MappingProxyType({})


def _raw_field() -> Mapping[str, str]:
    # Every key Slurm printed, read-only; left out of ==, hash and repr (parsed fields suffice).
    return field(default_factory=_empty, compare=False, hash=False, repr=False)


@dataclass(frozen=True)
class SacctRow:
    """One line of ``sacct --parsable2``: the job itself or one of its steps.

    ``job_id`` is the full id as printed (``123``, ``123.batch``, ``123+0``, ``123_4.0``);
    ``base_job_id`` drops the step; ``step`` is ``batch``/``extern``/``0``... or None for the
    job line. ``state`` is the bare state (``CANCELLED by 0`` -> ``CANCELLED``, ``by_uid`` 0).
    ``exit_code``/``exit_signal`` come from ``ExitCode`` ``code:signal``. ``failed_node``: the
    node Slurm blames for a NODE_FAIL (``FailedNode``, Slurm 23.02+; None where not asked or
    not known).
    """

    job_id: str
    base_job_id: str
    step: str | None
    het_offset: int | None
    name: str
    state: str
    by_uid: int | None
    exit_code: int | None
    exit_signal: int | None
    start: datetime | None
    end: datetime | None
    elapsed_s: int | None
    node_list: str | None
    restarts: int | None
    reason: str | None
    raw: Mapping[str, str] = _raw_field()
    failed_node: str | None = None

    @property
    def nodes(self) -> list[str]:
        """Expanded node names."""
        return expand_hostlist(self.node_list or "")

    @property
    def is_step(self) -> bool:
        return self.step is not None


@dataclass(frozen=True)
class JobInfo:
    """``scontrol show job`` of one job. ``None`` where Slurm prints (null)/None/Unknown."""

    job_id: str
    name: str
    user: str | None
    state: str
    reason: str | None
    restart_cnt: int
    partition: str | None
    node_list: str | None
    req_node_list: str | None
    exc_node_list: str | None
    batch_host: str | None
    num_nodes: int | None
    num_tasks: int | None
    requeue: bool
    batch_flag: bool
    time_limit_s: int | None
    run_time_s: int | None
    submit_time: datetime | None
    eligible_time: datetime | None
    start_time: datetime | None
    end_time: datetime | None
    exit_code: int | None
    exit_signal: int | None
    work_dir: str | None
    command: str | None
    std_out: str | None
    std_err: str | None
    raw: Mapping[str, str] = _raw_field()

    @property
    def nodes(self) -> list[str]:
        return expand_hostlist(self.node_list or "")

    @property
    def excluded_nodes(self) -> list[str]:
        return expand_hostlist(self.exc_node_list or "")

    @property
    def held(self) -> bool:
        """True when the job waits for an explicit ``scontrol release`` (user or admin hold)."""
        reason = self.reason or ""
        return self.state == "PENDING" and (
            reason.startswith("JobHeld") or reason == "job_requeued_in_held_state")


@dataclass(frozen=True)
class NodeInfo:
    """``scontrol show node`` of one node.

    ``state`` is the base state (IDLE, MIXED, ALLOCATED, DOWN, ...); ``flags`` the rest
    (DRAIN, NOT_RESPONDING, COMPLETING, ...). ``DOWN*``'s star becomes NOT_RESPONDING.
    """

    name: str
    state: str
    flags: tuple[str, ...]
    reason: str | None
    gres: str | None
    cpu_tot: int | None
    cpu_alloc: int | None
    real_memory_mb: int | None
    alloc_mem_mb: int | None
    partitions: tuple[str, ...]
    node_addr: str | None
    node_hostname: str | None
    raw: Mapping[str, str] = _raw_field()

    @property
    def gpus(self) -> int:
        """Number of GPUs in ``gres`` (``gpu:4``, ``gpu:a100:8(S:0-1)``...), 0 if none."""
        total = 0
        for item in (self.gres or "").split(","):
            parts = item.split("(")[0].split(":")
            if parts[0] == "gpu" and len(parts) > 1 and parts[-1].isdigit():
                total += int(parts[-1])
        return total

    @property
    def usable(self) -> bool:
        """True when the scheduler may start new work here."""
        bad_flags = {"DRAIN", "DRAINED", "DRAINING", "NOT_RESPONDING", "FAIL", "MAINTENANCE",
                     "REBOOT_REQUESTED", "POWERED_DOWN", "POWERING_DOWN"}
        return self.state in {"IDLE", "MIXED", "ALLOCATED"} and not bad_flags & set(self.flags)


@dataclass(frozen=True)
class PartitionInfo:
    """``scontrol show partition`` of one partition; ``max_time_s`` None means UNLIMITED."""

    name: str
    nodes: str | None
    max_time_s: int | None
    state: str
    total_cpus: int | None
    total_nodes: int | None
    default: bool
    raw: Mapping[str, str] = _raw_field()

    @property
    def node_names(self) -> list[str]:
        return expand_hostlist(self.nodes or "")


@dataclass(frozen=True)
class SqueueRow:
    """One ``squeue -o "%i|%j|%T|%M|%D|%R"`` line. ``reason`` for pending jobs, else nodes."""

    job_id: str
    name: str
    state: str
    time_used_s: int | None
    num_nodes: int | None
    node_list: str | None
    reason: str | None
