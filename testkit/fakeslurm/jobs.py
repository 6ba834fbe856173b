"""The in-memory job and node tables behind :class:`testkit.fakeslurm.FakeSlurm`.

Renders them in the exact text formats of Slurm 22.05 so the real parsers read them; the
formats were copied from captures in tests/data/slurm.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from datetime import datetime

from slurmkit.slurm.hostlist import compress_hostlist
from slurmkit.slurm.timelimit import format_time_limit

#: Seconds Slurm keeps a requeued job ineligible (EligibleTime = requeue time + 121 s).
REQUEUE_DELAY_S = 121


def fmt_time(epoch: float | None) -> str:
    """Slurm's timestamp format; "Unknown" for unset."""
    if epoch is None:
        return "Unknown"
    return datetime.fromtimestamp(epoch).strftime("%Y-%m-%dT%H:%M:%S")


@dataclass
class FakeRun:
    """One finished run of a job (kept for ``sacct --duplicates``)."""

    state: str
    start: float | None
    end: float | None
    nodes: list[str]
    exit_code: int = 0
    exit_signal: int = 0
    failed_node: str = ""  # the node blamed for a NODE_FAIL (sacct FailedNode, 23.02+)


@dataclass
class FakeJob:
    """A job as the fake controller tracks it. Times are epoch seconds."""

    job_id: str
    name: str
    partition: str
    num_nodes: int
    command: str
    work_dir: str
    requeue: bool
    time_limit_s: int | None
    submit_time: float
    eligible_time: float | None
    state: str = "PENDING"
    reason: str | None = "None"
    nodes: list[str] = field(default_factory=list)
    exc_nodes: list[str] = field(default_factory=list)
    restarts: int = 0
    start_time: float | None = None
    end_time: float | None = None
    exit_code: int = 0
    exit_signal: int = 0
    by_uid: int | None = None
    history: list[FakeRun] = field(default_factory=list)
    signals: list[str] = field(default_factory=list)
    preempt_time: float | None = None  # when Slurm preempted it (FakeSlurm.preempt)
    failed_node: str = ""  # this run's node that failed (NODE_FAIL without a requeue)
    env: dict[str, str] = field(default_factory=dict)
    sbatch_args: list[str] = field(default_factory=list)

    @property
    def held(self) -> bool:
        return self.state == "PENDING" and self.reason in {
            "JobHeldUser", "JobHeldAdmin", "job_requeued_in_held_state"}

    def key_values(self, now: float) -> list[tuple[str, str]]:
        """The fields of ``scontrol show job``, in Slurm's order."""
        nodes = compress_hostlist(self.nodes) if self.nodes else ""
        n = self.num_nodes
        run_s = int((self.end_time or now) - self.start_time) if self.start_time else 0
        return [
            ("JobId", self.job_id), ("JobName", self.name), ("UserId", "root(0)"),
            ("GroupId", "root(0)"), ("Priority", "0" if self.held else "4294901757"),
            ("Account", "root"), ("QOS", "normal"), ("JobState", self.state),
            ("Reason", self.reason or "None"), ("Dependency", "(null)"),
            ("Requeue", "1" if self.requeue else "0"), ("Restarts", str(self.restarts)),
            ("BatchFlag", "1"), ("ExitCode", f"{self.exit_code}:{self.exit_signal}"),
            ("RunTime", format_time_limit(max(run_s, 0))),
            ("TimeLimit", format_time_limit(self.time_limit_s)),
            ("SubmitTime", fmt_time(self.submit_time)),
            ("EligibleTime", fmt_time(self.eligible_time)),
            ("StartTime", fmt_time(self.start_time)), ("EndTime", fmt_time(self.end_time)),
            # captured from 22.05: "PreemptTime=None" until Slurm preempts the job
            ("PreemptTime", fmt_time(self.preempt_time) if self.preempt_time else "None"),
            ("Partition", self.partition), ("AllocNode:Sid", "localhost:1"),
            ("ReqNodeList", "(null)"),
            ("ExcNodeList", compress_hostlist(self.exc_nodes) if self.exc_nodes else "(null)"),
            ("NodeList", nodes), *([("BatchHost", self.nodes[0])] if self.nodes else []),
            # A pending job shows its node count as a min-max range (captured: NumNodes=2-2).
            ("NumNodes", str(n) if self.nodes else f"{n}-{n}"), ("NumTasks", str(n)),
            ("TRES", f"cpu={n},node={n}"),
            ("Command", self.command), ("WorkDir", self.work_dir),
            ("StdErr", f"{self.work_dir}/slurm-{self.job_id}.out"), ("StdIn", "/dev/null"),
            ("StdOut", f"{self.work_dir}/slurm-{self.job_id}.out"), ("Power", ""),
        ]

    def current_run(self) -> FakeRun:
        return FakeRun(self.state, self.start_time, self.end_time, list(self.nodes),
                       self.exit_code, self.exit_signal, self.failed_node)


@dataclass
class FakeNode:
    """A node of the fake cluster."""

    name: str
    partitions: list[str]
    state: str = "IDLE"
    flags: list[str] = field(default_factory=list)
    reason: str | None = None
    gres: str = "gpu:4"
    cpus: int = 2
    real_memory_mb: int = 4000

    @property
    def usable(self) -> bool:
        return self.state in {"IDLE", "MIXED", "ALLOCATED"} and not self.flags

    def state_text(self) -> str:
        base = self.state + ("*" if "NOT_RESPONDING" in self.flags else "")
        rest = [f for f in self.flags if f != "NOT_RESPONDING"]
        return "+".join([base, *rest])

    def line(self, port: int, default_port: str = "") -> str:
        """As scontrol prints a node: ``Port=`` only where it differs from the SlurmdPort."""
        alloc = 2 if self.state == "ALLOCATED" else 0
        shown = "" if str(port) == default_port else f" Port={port}"
        parts = [
            f"NodeName={self.name} Arch=x86_64 CoresPerSocket=1 ",
            f"CPUAlloc={alloc} CPUEfctv={self.cpus} CPUTot={self.cpus} CPULoad=0.00",
            "AvailableFeatures=(null) ActiveFeatures=(null)", f"Gres={self.gres}",
            f"NodeAddr=127.0.0.1 NodeHostName=fakehost{shown} Version=22.05.8",
            "OS=Linux 6.1.0-18-amd64 #1 SMP PREEMPT_DYNAMIC Debian 6.1.76-1 (2024-02-01) ",
            f"RealMemory={self.real_memory_mb} AllocMem=0 FreeMem=3000",
            f"Sockets={self.cpus} Boards=1",
            f"State={self.state_text()} ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A",
            f"Partitions={','.join(self.partitions)} ",
            f"CfgTRES=cpu={self.cpus},mem={self.real_memory_mb}M,billing={self.cpus}",
            "AllocTRES=",
        ]
        if self.reason:
            parts.append(f"Reason={self.reason} [root@2026-11-30T00:00:00]")
        return " ".join(parts)


def sacct_line(job: FakeJob, run: FakeRun, fields: list[str], step: str | None) -> str:
    """One ``--parsable2`` row of a job (``step`` None) or of one of its steps."""
    started = run.start is not None
    state = run.state
    if step is not None and state in {"REQUEUED", "NODE_FAIL", "TIMEOUT", "PREEMPTED"}:
        state = "CANCELLED"  # the steps of an interrupted job end cancelled, as in the captures
    if step is None and state == "CANCELLED" and job.by_uid is not None:
        state = f"CANCELLED by {job.by_uid}"
    end = run.end
    elapsed = int((end or run.start or 0) - (run.start or 0)) if started else 0
    values = {
        "JobID": job.job_id + (f".{step}" if step else ""),
        "JobName": job.name if step is None else ("batch" if step == "batch" else "bash"),
        "State": state, "ExitCode": f"{run.exit_code}:{run.exit_signal}",
        "Start": fmt_time(run.start), "End": fmt_time(end), "Elapsed": format_time_limit(elapsed),
        "NodeList": (compress_hostlist(run.nodes[:1] if step == "batch" else run.nodes)
                     if run.nodes else "None assigned"),
        "Reason": (job.reason or "None") if step is None else "",
        "Partition": job.partition, "NNodes": str(job.num_nodes),
        "FailedNode": run.failed_node if step is None else "",
    }
    return "|".join(values.get(f, "") for f in fields)


def render_config(config: dict[str, str], now: float) -> str:
    """``scontrol show config``: aligned ``Key = value`` lines."""
    lines = [f"Configuration data as of {fmt_time(now)}"]
    lines += [f"{k:<23} = {v}" for k, v in sorted(config.items())]
    return "\n".join(lines) + "\n\nSlurmctld(primary) at fakehost is UP\n"


def sbatch_directives(script: str) -> list[str]:
    """Arguments of the leading ``#SBATCH`` lines; Slurm stops at the first command."""
    args: list[str] = []
    for line in script.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#!"):
            continue
        if not stripped.startswith("#"):
            break
        if stripped.startswith("#SBATCH"):
            args += shlex.split(stripped[len("#SBATCH"):], comments=True)
    return args


class FakeCommandFailure(Exception):
    """A fake command's error exit: what it prints on stderr and its status."""

    def __init__(self, stderr: str, returncode: int = 1) -> None:
        super().__init__(stderr)
        self.stderr = stderr
        self.returncode = returncode


# sbatch options that take no value, and short options with their long names.
_SBATCH_FLAGS = {"--parsable", "--requeue", "--no-requeue", "--hold", "--exclusive", "--wait",
                 "--test-only", "--no-kill", "--overcommit", "--contiguous", "--quiet",
                 "--verbose", "--use-min-nodes", "--spread-job"}
_SBATCH_SHORT = {"-J": "--job-name", "-N": "--nodes", "-p": "--partition", "-t": "--time",
                 "-x": "--exclude", "-o": "--output", "-e": "--error", "-n": "--ntasks",
                 "-c": "--cpus-per-task", "-A": "--account", "-q": "--qos", "-w": "--nodelist",
                 "-D": "--chdir", "-G": "--gpus", "-a": "--array", "-d": "--dependency",
                 "-C": "--constraint", "-H": "--hold", "-W": "--wait", "-k": "--no-kill",
                 "-O": "--overcommit", "-Q": "--quiet", "-v": "--verbose"}


def parse_sbatch_args(args: list[str]) -> tuple[dict[str, str], list[str]]:
    """sbatch options -> ({long option: value ("" for flags)}, [script, script args...])."""
    opts: dict[str, str] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            return opts, args[i + 1:]
        if not arg.startswith("-") or arg == "-":
            return opts, args[i:]
        if arg.startswith("--"):
            name, eq, value = arg.partition("=")
        else:
            name, value = _SBATCH_SHORT.get(arg[:2], arg[:2]), arg[2:]
            eq = "=" if value else ""
        if name in _SBATCH_FLAGS:
            opts[name] = ""
        elif eq:
            opts[name] = value
        elif i + 1 < len(args):
            opts[name] = args[i + 1]
            i += 1
        else:
            raise FakeCommandFailure(f"sbatch: option '{name}' requires an argument")
        i += 1
    return opts, []
