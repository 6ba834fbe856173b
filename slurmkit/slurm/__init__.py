"""Talking to Slurm: one command runner, pure parsers of its output, and a client.

Every Slurm command goes through a :class:`CommandRunner` (:class:`SubprocessRunner` for real;
tests use :class:`testkit.fakeslurm.FakeSlurm`); :class:`SlurmClient` adds retries of
transient controller errors and typed results.
"""

from slurmkit.slurm.client import SlurmClient
from slurmkit.slurm.errors import (
    SlurmCommandError,
    SlurmCommandTimeout,
    SlurmError,
    SlurmJobStateError,
    SlurmNotInstalled,
    SlurmParseError,
    SlurmWaitTimeout,
)
from slurmkit.slurm.parsers import (
    SACCT_FIELDS,
    SQUEUE_FORMAT,
    compress_hostlist,
    expand_hostlist,
    format_time_limit,
    parse_duration_s,
    parse_sacct,
    parse_scontrol_config,
    parse_scontrol_job,
    parse_scontrol_jobs,
    parse_scontrol_nodes,
    parse_scontrol_partitions,
    parse_squeue,
    parse_time_limit,
)
from slurmkit.slurm.records import (
    ACTIVE_STATES,
    TERMINAL_STATES,
    JobInfo,
    NodeInfo,
    PartitionInfo,
    SacctRow,
    SqueueRow,
)
from slurmkit.slurm.retry import (
    ERROR_PATTERNS,
    Disposition,
    RetryingRunner,
    RetryPolicy,
    classify,
)
from slurmkit.slurm.runner import CommandResult, CommandRunner, SubprocessRunner

__all__ = [
    "ACTIVE_STATES", "ERROR_PATTERNS", "SACCT_FIELDS", "SQUEUE_FORMAT", "TERMINAL_STATES",
    "CommandResult", "CommandRunner", "Disposition", "JobInfo", "NodeInfo",
    "PartitionInfo", "RetryPolicy", "RetryingRunner", "SacctRow", "SlurmClient",
    "SlurmCommandError", "SlurmCommandTimeout", "SlurmError", "SlurmJobStateError",
    "SlurmNotInstalled", "SlurmParseError", "SlurmWaitTimeout", "SqueueRow", "SubprocessRunner",
    "classify", "compress_hostlist", "expand_hostlist", "format_time_limit", "parse_duration_s",
    "parse_sacct", "parse_scontrol_config", "parse_scontrol_job", "parse_scontrol_jobs",
    "parse_scontrol_nodes", "parse_scontrol_partitions", "parse_squeue", "parse_time_limit",
]
