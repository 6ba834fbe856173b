"""Pure parsers of Slurm CLI output: captured text in, frozen records out, no I/O.

Hostlists and time strings live in their own modules and are re-exported here, so callers
import every parser from one place.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from datetime import datetime
from types import MappingProxyType

from slurmkit.errors import ConfigError
from slurmkit.slurm.errors import SlurmParseError
from slurmkit.slurm.hostlist import compress_hostlist, expand_hostlist
from slurmkit.slurm.records import JobInfo, NodeInfo, PartitionInfo, SacctRow, SqueueRow
from slurmkit.slurm.timelimit import format_time_limit, parse_time_limit

__all__ = [
    "SACCT_FIELDS", "SQUEUE_FORMAT", "compress_hostlist", "expand_hostlist", "format_time_limit",
    "parse_time_limit", "parse_sacct", "parse_scontrol_config", "parse_scontrol_jobs",
    "parse_scontrol_job", "parse_scontrol_nodes", "parse_scontrol_partitions", "parse_squeue",
    "parse_key_values", "parse_duration_s",
]

#: The sacct columns the parser knows, in the order slurmkit asks for them.
SACCT_FIELDS: tuple[str, ...] = (
    "JobID", "JobName", "State", "ExitCode", "Start", "End", "Elapsed", "NodeList", "Reason",
)
#: The squeue format slurmkit asks for (``--noheader -o``).
SQUEUE_FORMAT = "%i|%j|%T|%M|%D|%R"

_NONE_VALUES = {"", "(null)", "None", "none", "N/A", "n/a", "Unknown", "None assigned", "(None)"}
# A key starts a word (start or after whitespace), begins upper-case and runs to "=".
# Values may contain spaces (Reason, Command, OS) and "=" (CfgTRES=cpu=2,...), but never a
# space followed by a capitalised word and "=" in Slurm's own output.
_KEY = re.compile(r"(?:^|(?<=\s))([A-Z][A-Za-z0-9_:/.\-]*)=")
_NODE_STATE_SUFFIX = {
    "*": "NOT_RESPONDING", "~": "POWERED_DOWN", "#": "POWERING_UP", "%": "POWERING_DOWN",
    "$": "MAINTENANCE", "@": "REBOOT_REQUESTED", "^": "REBOOT_ISSUED", "!": "POWER_DOWN",
    "-": "PLANNED",
}


def _opt(value: str | None) -> str | None:
    if value is None:
        return None
    value = value.strip()
    return None if value in _NONE_VALUES else value


def _int(value: str | None, what: str) -> int | None:
    v = _opt(value)
    if v is None:
        return None
    try:
        return int(v)
    except ValueError:
        raise SlurmParseError(what, v) from None


def _time(value: str | None) -> datetime | None:
    v = _opt(value)
    if v is None:
        return None
    try:
        return datetime.strptime(v, "%Y-%m-%dT%H:%M:%S")
    except ValueError:
        raise SlurmParseError("timestamp", v) from None


def _duration(value: str | None, what: str) -> int | None:
    v = _opt(value)
    if v is None or v == "INVALID":
        return None
    try:
        return parse_time_limit(v)
    except ConfigError:
        raise SlurmParseError(what, v) from None


def _exit_code(value: str | None) -> tuple[int | None, int | None]:
    v = _opt(value)
    if v is None:
        return None, None
    code, _, sig = v.partition(":")
    return _int(code, "exit code"), _int(sig or "0", "exit signal")


def parse_duration_s(value: str) -> int | None:
    """``"30 sec"``, ``"5 min"``, ``"UNLIMITED"`` (config values) -> seconds; None if no number."""
    m = re.match(r"^\s*(\d+)\s*(sec|secs|min|mins|hour|hours)?\s*$", value)
    if not m:
        return None
    scale = {"min": 60, "mins": 60, "hour": 3600, "hours": 3600}.get(m.group(2) or "sec", 1)
    return int(m.group(1)) * scale


# --- key=value records (scontrol show job/node/partition) -------------------------------------

def _records(text: str) -> list[str]:
    """Split scontrol output into one string per record, for ``-o`` and multi-line output.

    A record starts on a line that does not begin with whitespace; indented lines continue it.
    """
    records: list[list[str]] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        if line[0].isspace() and records:
            records[-1].append(line.strip())
        else:
            records.append([line.strip()])
    return [" ".join(parts) for parts in records]


def parse_key_values(record: str) -> dict[str, str]:
    """``Key=value Key2=value with spaces`` -> dict; the first occurrence of a key wins."""
    matches = list(_KEY.finditer(record))
    out: dict[str, str] = {}
    for i, m in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(record)
        out.setdefault(m.group(1), record[m.end():end].strip())
    return out


def _kv_records(text: str, first_key: str) -> list[dict[str, str]]:
    out = []
    for record in _records(text):
        kv = parse_key_values(record)
        if first_key not in kv:
            if record.startswith(("No ", "no ")):
                continue  # "No jobs in the system" and friends: an empty listing.
            raise SlurmParseError(f"a record starting with {first_key}=", record)
        out.append(kv)
    return out


def _job_from_kv(kv: dict[str, str]) -> JobInfo:
    exit_code, exit_signal = _exit_code(kv.get("ExitCode"))
    user = _opt(kv.get("UserId"))
    num_nodes = _opt(kv.get("NumNodes"))
    return JobInfo(
        job_id=kv["JobId"],
        name=kv.get("JobName", ""),
        user=user.split("(")[0] if user else None,
        state=kv.get("JobState", "UNKNOWN"),
        reason=_opt(kv.get("Reason")),
        restart_cnt=_int(kv.get("Restarts"), "Restarts") or 0,
        partition=_opt(kv.get("Partition")),
        node_list=_opt(kv.get("NodeList")),
        req_node_list=_opt(kv.get("ReqNodeList")),
        exc_node_list=_opt(kv.get("ExcNodeList")),
        batch_host=_opt(kv.get("BatchHost")),
        # Pending jobs print a range "2-2" (min-max): the minimum is what will be allocated.
        num_nodes=_int(num_nodes.split("-")[0], "NumNodes") if num_nodes else None,
        num_tasks=_int(kv.get("NumTasks"), "NumTasks"),
        requeue=kv.get("Requeue") == "1",
        batch_flag=kv.get("BatchFlag") == "1",
        time_limit_s=_duration(kv.get("TimeLimit"), "TimeLimit"),
        run_time_s=_duration(kv.get("RunTime"), "RunTime"),
        submit_time=_time(kv.get("SubmitTime")),
        eligible_time=_time(kv.get("EligibleTime")),
        start_time=_time(kv.get("StartTime")),
        end_time=_time(kv.get("EndTime")),
        exit_code=exit_code,
        exit_signal=exit_signal,
        work_dir=_opt(kv.get("WorkDir")),
        command=_opt(kv.get("Command")),
        std_out=_opt(kv.get("StdOut")),
        std_err=_opt(kv.get("StdErr")),
        raw=MappingProxyType(kv),
    )


def parse_scontrol_jobs(text: str) -> list[JobInfo]:
    """All jobs in ``scontrol show job [-o]`` output (one-line or multi-line form)."""
    return [_job_from_kv(kv) for kv in _kv_records(text, "JobId")]


def parse_scontrol_job(text: str) -> JobInfo:
    """Exactly one job from ``scontrol show job [-o] <id>``."""
    jobs = parse_scontrol_jobs(text)
    if len(jobs) != 1:
        raise SlurmParseError(f"exactly one job (found {len(jobs)})", text)
    return jobs[0]


def _node_state(text: str) -> tuple[str, tuple[str, ...]]:
    parts = [p for p in text.split("+") if p]
    if not parts:
        return "UNKNOWN", ()
    base, flags = parts[0], []
    while base and base[-1] in _NODE_STATE_SUFFIX:
        flags.append(_NODE_STATE_SUFFIX[base[-1]])
        base = base[:-1]
    for extra in parts[1:]:
        star = extra.endswith("*")
        flags.append(extra.rstrip("*"))
        if star:
            flags.append("NOT_RESPONDING")
    return base, tuple(dict.fromkeys(flags))


def parse_scontrol_nodes(text: str) -> list[NodeInfo]:
    """All nodes in ``scontrol show node [-o]`` output."""
    nodes = []
    for kv in _kv_records(text, "NodeName"):
        state, flags = _node_state(kv.get("State", ""))
        partitions = _opt(kv.get("Partitions"))
        nodes.append(NodeInfo(
            name=kv["NodeName"], state=state, flags=flags, reason=_opt(kv.get("Reason")),
            gres=_opt(kv.get("Gres")), cpu_tot=_int(kv.get("CPUTot"), "CPUTot"),
            cpu_alloc=_int(kv.get("CPUAlloc"), "CPUAlloc"),
            real_memory_mb=_int(kv.get("RealMemory"), "RealMemory"),
            alloc_mem_mb=_int(kv.get("AllocMem"), "AllocMem"),
            partitions=tuple(partitions.split(",")) if partitions else (),
            node_addr=_opt(kv.get("NodeAddr")), node_hostname=_opt(kv.get("NodeHostName")),
            raw=MappingProxyType(kv),
        ))
    return nodes


def parse_scontrol_partitions(text: str) -> list[PartitionInfo]:
    """All partitions in ``scontrol show partition [-o]`` output."""
    out = []
    for kv in _kv_records(text, "PartitionName"):
        out.append(PartitionInfo(
            name=kv["PartitionName"], nodes=_opt(kv.get("Nodes")),
            max_time_s=_duration(kv.get("MaxTime"), "MaxTime"),
            state=kv.get("State", "UNKNOWN"),
            total_cpus=_int(kv.get("TotalCPUs"), "TotalCPUs"),
            total_nodes=_int(kv.get("TotalNodes"), "TotalNodes"),
            default=kv.get("Default") == "YES", raw=MappingProxyType(kv),
        ))
    return out


def parse_scontrol_config(text: str) -> dict[str, str]:
    """``scontrol show config`` -> {"KillWait": "30 sec", ...}; the first section wins."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        m = re.match(r"^(\S+)\s+=\s?(.*)$", line)
        if m:
            out.setdefault(m.group(1), m.group(2).strip())
    if not out:
        raise SlurmParseError("configuration lines 'Key = value'", text)
    return out


# --- delimited rows (sacct, squeue) ------------------------------------------------------------

def _split_job_id(job_id: str) -> tuple[str, str | None, int | None]:
    main, dot, step = job_id.partition(".")
    base, plus, het = main.partition("+")
    if not base or not base.split("_")[0].isdigit():
        raise SlurmParseError("a job id", job_id)
    het_offset = _int(het, "het offset") if plus else None
    return base, (step if dot else None), het_offset


def _sacct_row(values: dict[str, str]) -> SacctRow:
    job_id = values["JobID"]
    base, step, het = _split_job_id(job_id)
    state_text = values.get("State", "")
    state, _, by = state_text.partition(" by ")
    exit_code, exit_signal = _exit_code(values.get("ExitCode"))
    return SacctRow(
        job_id=job_id, base_job_id=base, step=step, het_offset=het,
        name=values.get("JobName", ""), state=state.strip() or "UNKNOWN",
        by_uid=_int(by, "uid") if by else None, exit_code=exit_code, exit_signal=exit_signal,
        start=_time(values.get("Start")), end=_time(values.get("End")),
        elapsed_s=_duration(values.get("Elapsed"), "Elapsed"),
        node_list=_opt(values.get("NodeList")),
        restarts=_int(values.get("Restarts"), "Restarts"),
        reason=_opt(values.get("Reason")), raw=MappingProxyType(values),
        failed_node=_opt(values.get("FailedNode")),
    )


def parse_sacct(text: str, fields: Iterable[str] = SACCT_FIELDS) -> list[SacctRow]:
    """Rows of ``sacct --parsable2 --noheader -o <fields>``; ``fields`` must include JobID.

    Fields not requested are None in the rows. A job name containing "|" is kept whole as
    long as JobName is the only free-text column.
    """
    names = list(fields)
    if "JobID" not in names:
        raise ValueError("sacct fields must include JobID")
    rows = []
    for line in text.splitlines():
        if not line.strip():
            continue
        parts = line.split("|")
        if len(parts) > len(names) and "JobName" in names:
            i = names.index("JobName")
            extra = len(parts) - len(names)
            parts[i:i + extra + 1] = ["|".join(parts[i:i + extra + 1])]
        if len(parts) != len(names):
            raise SlurmParseError(f"{len(names)} '|'-separated sacct fields", line)
        rows.append(_sacct_row(dict(zip(names, parts))))
    return rows


def parse_squeue(text: str) -> list[SqueueRow]:
    """Rows of ``squeue --noheader -o "%i|%j|%T|%M|%D|%R"``."""
    rows = []
    for line in text.splitlines():
        if not line.strip():
            continue
        parts = line.split("|")
        if len(parts) < 6:
            raise SlurmParseError("6 '|'-separated squeue fields", line)
        job_id, name = parts[0], "|".join(parts[1:-4])
        state, used, num_nodes, where = parts[-4:]
        where = where.strip()
        is_reason = where.startswith("(") and where.endswith(")")
        rows.append(SqueueRow(
            job_id=job_id.strip(), name=name, state=state.strip(),
            time_used_s=_duration(used, "squeue time"), num_nodes=_int(num_nodes, "nodes"),
            node_list=None if is_reason else _opt(where),
            reason=_opt(where[1:-1]) if is_reason else None,
        ))
    return rows
