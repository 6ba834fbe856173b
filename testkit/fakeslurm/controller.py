"""The state and command handlers of the fake Slurm controller (see
:mod:`testkit.fakeslurm.cluster`).

Handlers take the arguments after the program name and return stdout, or raise
:class:`FakeCommandFailure` with the real Slurm error text.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

from slurmkit.errors import ConfigError
from slurmkit.slurm.hostlist import compress_hostlist, expand_hostlist
from slurmkit.slurm.timelimit import format_time_limit, parse_time_limit
from testkit.fakeslurm.jobs import (
    REQUEUE_DELAY_S,
    FakeCommandFailure,
    FakeJob,
    FakeNode,
    FakeRun,
    render_config,
    sacct_line,
)

_ACTIVE = {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED"}
_SACCT_CANONICAL = {"jobid": "JobID", "jobname": "JobName", "state": "State",
                    "exitcode": "ExitCode", "start": "Start", "end": "End", "elapsed": "Elapsed",
                    "nodelist": "NodeList", "reason": "Reason", "partition": "Partition",
                    "nnodes": "NNodes"}
_SQUEUE_DEFAULT = "%.18i %.9P %.8j %.8u %.2t %.10M %.6D %R"
_NOT_PENDING = "Job is no longer pending execution for job {}"
_DISABLED = "Requested operation is presently disabled for job {}"
_FINISHED = "Job has already finished for job {}"


def _option_values(args: list[str], names: tuple[str, ...]) -> list[str]:
    """Values of ``-x v``, ``-xv``, ``--long=v``, ``--long v`` for any of ``names``."""
    out = []
    for i, arg in enumerate(args):
        for name in names:
            if arg == name and i + 1 < len(args):
                out.append(args[i + 1])
            elif name.startswith("--") and arg.startswith(name + "="):
                out.append(arg[len(name) + 1:])
            elif not name.startswith("--") and arg.startswith(name) and len(arg) > len(name):
                out.append(arg[len(name):])
    return out


class FakeController:
    """Job table, node table and the Slurm commands that read or change them."""

    def __init__(
        self,
        partitions: Mapping[str, str] | None,
        max_time_s: Mapping[str, int] | None,
        clock: Callable[[], float],
        config: Mapping[str, str] | None,
        gres: str,
        cluster_name: str | None,
    ) -> None:
        # sacct's FailedNode column: Slurm 23.02+ (22.05, the fake's text formats, refuses it)
        self.failed_node_field = False
        parts = partitions or {"debug": "node[1-4]"}
        self.partitions = {name: expand_hostlist(expr) for name, expr in parts.items()}
        self.max_time_s = dict(max_time_s or {})
        self.clock = clock
        self.cluster_name = cluster_name
        self.nodes: dict[str, FakeNode] = {}
        for part, names in self.partitions.items():
            for n in names:
                self.nodes.setdefault(n, FakeNode(n, [], gres=gres)).partitions.append(part)
        self.config = {"ClusterName": cluster_name or "fake", "KillWait": "30 sec",
                       "SlurmdTimeout": "300 sec", "MinJobAge": "300 sec",
                       "SlurmctldTimeout": "120 sec", "MessageTimeout": "10 sec",
                       "JobRequeue": "1", "SlurmdPort": "17001", **(config or {})}
        self.jobs: dict[str, FakeJob] = {}
        self.purged: set[str] = set()
        self.controller_up = True

    # --- shared helpers --------------------------------------------------------------------

    def _job(self, job_id: str) -> FakeJob:
        job = self.jobs.get(job_id)
        if job is None or job_id in self.purged:
            raise FakeCommandFailure("slurm_load_jobs error: Invalid job id specified")
        return job

    def _free_nodes(self, job: FakeJob) -> list[str]:
        return [n for n in self.partitions[job.partition]
                if self.nodes[n].usable and self.nodes[n].state == "IDLE"
                and n not in job.exc_nodes]

    def _free(self, job: FakeJob) -> None:
        for n in job.nodes:
            if self.nodes[n].state == "ALLOCATED":
                self.nodes[n].state = "IDLE"

    def _requeue(self, job: FakeJob, run_state: str, *, hold: bool, failed_node: str = "") -> None:
        now = self.clock()
        job.history.append(FakeRun(run_state, job.start_time, job.end_time or now,
                                   list(job.nodes), job.exit_code, job.exit_signal, failed_node))
        self._free(job)
        job.state = "PENDING"
        job.reason = "job_requeued_in_held_state" if hold else "BeginTime"
        job.restarts += 1
        job.eligible_time = now + REQUEUE_DELAY_S
        job.nodes, job.start_time, job.end_time = [], None, None
        job.failed_node = ""
        job.exit_code = job.exit_signal = 0
        job.by_uid = None
        job.preempt_time = None  # a new run: not preempted (yet)

    # --- squeue / sacct / scancel ----------------------------------------------------------

    def _squeue(self, args: list[str]) -> str:
        formats = _option_values(args, ("-o", "--format"))
        fmt = formats[-1] if formats else _SQUEUE_DEFAULT
        users = {u for v in _option_values(args, ("-u", "--user")) for u in v.split(",")}
        ids = [i for v in _option_values(args, ("-j", "--jobs")) for i in v.split(",")]
        if ids and not any(i in self.jobs and i not in self.purged for i in ids):
            raise FakeCommandFailure("slurm_load_jobs error: Invalid job id specified")
        lines = []
        for job in self.jobs.values():
            if job.state not in _ACTIVE or job.job_id in self.purged:
                continue
            if (ids and job.job_id not in ids) or (users and "root" not in users):
                continue
            lines.append(re.sub(r"%\.?\d*([a-zA-Z])",
                                lambda m: self._squeue_field(job, m.group(1)), fmt))
        return "".join(line + "\n" for line in lines)

    def _squeue_field(self, job: FakeJob, code: str) -> str:
        now = self.clock()
        # squeue spells this one reason with spaces (captured: "(job requeued in held state)").
        reason = (job.reason or "None").replace("job_requeued_in_held_state",
                                                "job requeued in held state")
        where = compress_hostlist(job.nodes) if job.nodes else f"({reason})"
        used = int(now - job.start_time) if job.start_time else 0
        minutes, secs = divmod(used, 60)
        return {
            "i": job.job_id, "j": job.name, "T": job.state, "t": job.state[:2],
            "M": format_time_limit(used) if used >= 3600 else f"{minutes}:{secs:02d}",
            "D": str(job.num_nodes), "R": where, "u": "root", "P": job.partition,
            "N": compress_hostlist(job.nodes), "r": job.reason or "None",
            "l": format_time_limit(job.time_limit_s),
        }.get(code, "")

    def _sacct(self, args: list[str]) -> str:
        fields = [f for v in _option_values(args, ("-o", "--format")) for f in v.split(",")]
        fields = fields or ["JobID", "JobName", "Partition", "State", "ExitCode"]
        known = {**_SACCT_CANONICAL, **({"failednode": "FailedNode"} if self.failed_node_field else {})}
        for f in fields:
            if f.lower() not in known:
                raise FakeCommandFailure(f'sacct: error: Invalid field requested: "{f}"')
        fields = [known[f.lower()] for f in fields]
        ids = {i for v in _option_values(args, ("-j", "--jobs")) for i in v.split(",")}
        duplicates = "--duplicates" in args or "-D" in args
        no_steps = "-X" in args or "--allocations" in args
        lines = []
        for job in self.jobs.values():
            if ids and job.job_id not in ids:
                continue
            runs = (job.history if duplicates else []) + [job.current_run()]
            for run in runs:
                lines.append(sacct_line(job, run, fields, None))
                if run.start is not None and not no_steps:
                    lines += [sacct_line(job, run, fields, s) for s in ("batch", "0")]
        return "".join(line + "\n" for line in lines)

    def _scancel(self, args: list[str]) -> str:
        signals = _option_values(args, ("-s", "--signal"))
        signal = signals[-1] if signals else None
        ids = [a for a in args if a.isdigit()]
        for job_id in ids:
            job = self.jobs.get(job_id)
            # Real scancel says nothing and exits 0 for finished or unknown jobs (captured).
            if job is None or job.state not in _ACTIVE:
                continue
            if signal:
                job.signals.append(signal)
                continue
            job.state, job.by_uid, job.end_time = "CANCELLED", 0, self.clock()
            self._free(job)
        return ""

    # --- scontrol --------------------------------------------------------------------------

    def _scontrol(self, args: list[str]) -> str:
        one_line = any(a in ("-o", "--oneliner") for a in args)
        args = [a for a in args if a not in ("-o", "--oneliner")]
        verb, rest = (args[0].lower(), args[1:]) if args else ("", [])
        if verb == "ping":
            state = "UP" if self.controller_up else "DOWN"
            line = f"Slurmctld(primary) at fakehost is {state}\n"
            if not self.controller_up:
                raise FakeCommandFailure(line)
            return line
        if verb == "show":
            return self._show(rest, one_line)
        if verb == "update":
            return self._update(rest)
        if verb in ("requeue", "requeuehold"):
            for job_id in rest[0].split(","):
                job = self._job(job_id)
                if not job.requeue or job.state == "PENDING":
                    raise FakeCommandFailure(_DISABLED.format(job_id))
                self._requeue(job, "REQUEUED", hold=verb == "requeuehold")
            return ""
        if verb in ("hold", "release"):
            job = self._job(rest[0])
            if job.state != "PENDING":
                raise FakeCommandFailure(_NOT_PENDING.format(job.job_id))
            job.reason = "JobHeldUser" if verb == "hold" else "None"
            return ""
        raise FakeCommandFailure(f"invalid keyword: {verb}")

    def _show(self, rest: list[str], one_line: bool) -> str:
        what, target = (rest[0].lower() if rest else ""), (rest[1] if len(rest) > 1 else None)
        if what == "config":
            return render_config(self.config, self.clock())
        if what == "node":
            names = expand_hostlist(target) if target else list(self.nodes)
            missing = [n for n in names if n not in self.nodes]
            if missing:
                raise FakeCommandFailure(f"Node {missing[0]} not found")
            order = list(self.nodes)
            default = self.config.get("SlurmdPort", "")
            return "".join(self.nodes[n].line(17000 + order.index(n) + 1, default) + "\n" for n in names)
        if what == "partition":
            return "".join(self._partition_line(p) + "\n" for p in self.partitions
                           if target in (None, p))
        if what == "job":
            jobs = [self._job(target)] if target else [
                j for j in self.jobs.values() if j.job_id not in self.purged]
            if not jobs:
                return "No jobs in the system\n"
            sep, end = (" ", "\n") if one_line else ("\n   ", "\n\n")
            now = self.clock()
            return "".join(sep.join(f"{k}={v}" for k, v in j.key_values(now)) + end
                           for j in jobs)
        raise FakeCommandFailure(f"invalid entity: {what}")

    def _partition_line(self, name: str) -> str:
        nodes = self.partitions[name]
        max_time = format_time_limit(self.max_time_s.get(name))
        default = "YES" if name == next(iter(self.partitions)) else "NO"
        cpus = sum(self.nodes[n].cpus for n in nodes)
        return (f"PartitionName={name} AllowGroups=ALL AllowAccounts=ALL AllowQos=ALL "
                f"AllocNodes=ALL Default={default} QoS=N/A DefaultTime=NONE GraceTime=0 "
                f"MaxNodes=UNLIMITED MaxTime={max_time} MinNodes=0 "
                f"Nodes={compress_hostlist(nodes)} State=UP TotalCPUs={cpus} "
                f"TotalNodes={len(nodes)} JobDefaults=(null)")

    def _update(self, rest: list[str]) -> str:
        kv: dict[str, str] = {}
        for token in rest:
            key, _, value = token.partition("=")
            kv[key.lower()] = value
        if "nodename" in kv:
            return self._update_node(kv)
        job = self._job(kv.pop("jobid", ""))
        for key, value in kv.items():
            if job.state not in _ACTIVE:
                raise FakeCommandFailure(_FINISHED.format(job.job_id))
            if job.state != "PENDING" and key in ("starttime", "excnodelist", "numnodes"):
                raise FakeCommandFailure(_NOT_PENDING.format(job.job_id))
            if key == "starttime":
                job.eligible_time = self.clock() if value.lower() == "now" else job.eligible_time
                if job.reason == "BeginTime":
                    job.reason = "None"
            elif key == "excnodelist":
                job.exc_nodes = expand_hostlist(value)
            elif key == "timelimit":
                try:
                    job.time_limit_s = parse_time_limit(value)
                except ConfigError:
                    raise FakeCommandFailure("Invalid TimeLimit value") from None
            elif key == "jobname":
                job.name = value
            elif key == "requeue":
                job.requeue = value not in ("0", "no")
            else:
                raise FakeCommandFailure(f"Update of this parameter is not supported: {key}")
        return ""

    def _update_node(self, kv: dict[str, str]) -> str:
        names = expand_hostlist(kv["nodename"])
        if any(n not in self.nodes for n in names):
            raise FakeCommandFailure("Invalid node name specified")
        state = kv.get("state", "").upper()
        for name in names:
            node = self.nodes[name]
            if state == "DOWN":
                self._node_down(name, kv.get("reason", "down"))
            elif state == "DRAIN":
                node.flags, node.reason = sorted({*node.flags, "DRAIN"}), kv.get("reason")
            elif state in ("RESUME", "IDLE"):
                node.state, node.flags, node.reason = "IDLE", [], None
            else:
                raise FakeCommandFailure(f"Invalid node state specified: {state}")
        return ""

    def _node_down(self, name: str, reason: str) -> None:
        node = self.nodes[name]
        node.state, node.flags, node.reason = "DOWN", ["NOT_RESPONDING"], reason
        for job in self.jobs.values():
            if job.state == "RUNNING" and name in job.nodes:
                job.end_time = self.clock()
                if job.requeue:
                    self._requeue(job, "NODE_FAIL", hold=False, failed_node=name)
                else:
                    job.state, job.reason, job.failed_node = "NODE_FAIL", "NodeDown", name
                    self._free(job)
