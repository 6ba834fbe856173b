"""A typed client for the Slurm CLI: submit, inspect, requeue, exclude, release, cancel.

All commands go through one :class:`CommandRunner`, wrapped in :class:`RetryingRunner` so
transient controller errors are retried and permanent ones surface at once.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Collection, Mapping
from typing import Literal

from slurmkit.errors import SubmissionError
from slurmkit.slurm.errors import SlurmCommandError, SlurmJobStateError, SlurmParseError, SlurmWaitTimeout
from slurmkit.slurm.hostlist import compress_hostlist, expand_hostlist
from slurmkit.slurm.jsonparse import parse_sacct_json
from slurmkit.slurm.parsers import (
    SACCT_FIELDS,
    SQUEUE_FORMAT,
    parse_sacct,
    parse_scontrol_config,
    parse_scontrol_jobs,
    parse_scontrol_nodes,
    parse_scontrol_partitions,
    parse_squeue,
)
from slurmkit.slurm.records import (
    TERMINAL_STATES,
    JobInfo,
    NodeInfo,
    PartitionInfo,
    SacctRow,
    SqueueRow,
)
from slurmkit.slurm.retry import RetryingRunner, RetryPolicy
from slurmkit.slurm.runner import CommandResult, CommandRunner, SubprocessRunner

log = logging.getLogger(__name__)

# Seconds one Slurm command may take: the control plane's own calls, and the calls a person at a
# terminal waits on (status, the queue hint at submit), who is better told "no answer" sooner.
COMMAND_TIMEOUT_S = 30.0
INTERACTIVE_TIMEOUT_S = 15.0

_SUBMITTED = re.compile(r"^(\d+)(?:;(\S+))?$")
#: What slurmctld answers for a job it does not know, and (24.11, not 22.05) for a signal to a
#: running job with no step yet.
INVALID_JOB = "Invalid job id specified"


class SlurmClient:
    """Slurm operations slurmkit needs, on top of a runner.

    Args:
        runner: runs the commands (:class:`SubprocessRunner`; in tests
            ``testkit.fakeslurm.FakeSlurm``).
        retry: backoff for transient errors; None uses :class:`RetryPolicy` defaults.
        timeout_s: per-command timeout in seconds.
        clock: monotonic seconds, for :meth:`wait_for_state` deadlines.
        sleep: waits between polls of :meth:`wait_for_state`.
    """

    def __init__(
        self,
        runner: CommandRunner,
        *,
        retry: RetryPolicy | None = None,
        timeout_s: float = COMMAND_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        json_accounting: bool = False,
        failed_node_field: bool = False,
    ) -> None:
        self.raw_runner = runner
        self.runner = RetryingRunner(runner, retry)
        self.timeout_s = timeout_s
        self.clock = clock
        self.sleep = sleep
        # sacct --json where the site's capabilities say it is there and right
        # (SiteCapabilities.json_accounting); text whenever a JSON answer cannot be read.
        self.json_accounting = json_accounting
        # sacct knows FailedNode (SiteCapabilities.failed_node_field: 23.02+): text output asks
        # for it (an older sacct refuses an unknown field); JSON carries it where it exists.
        self.failed_node_field = failed_node_field

    def bounded(self, retry: RetryPolicy, timeout_s: float) -> SlurmClient:
        """The same runner (the same cluster, or the same fake) with a shorter retry budget.

        For callers that must not wait long on a busy controller (the supervisor confirming a
        lost node while every agent waits for its decision); everything else keeps the
        client's own policy.
        """
        return SlurmClient(self.raw_runner, retry=retry, timeout_s=timeout_s, clock=self.clock,
                           sleep=self.sleep, json_accounting=self.json_accounting,
                           failed_node_field=self.failed_node_field)

    def _run(self, args: list[str], *, env: Mapping[str, str] | None = None) -> CommandResult:
        return self.runner.run(args, timeout_s=self.timeout_s, env=env)

    # --- submission ------------------------------------------------------------------------

    def submit(self, script_path: str, *, extra_args: list[str] | None = None,
               env: Mapping[str, str] | None = None) -> str:
        """Submit a batch script with ``sbatch --parsable``; returns the job id.

        ``extra_args`` go before the script path (they override its #SBATCH lines); ``env``
        is added to sbatch's environment, which the job inherits (``--export=ALL``).
        Raises SubmissionError; after an ambiguous failure (timeout) the message says to check
        the queue, since the job may exist.
        """
        args = ["sbatch", "--parsable", *(extra_args or []), script_path]
        try:
            result = self._run(args, env=env)
        except SlurmCommandError as exc:
            raise SubmissionError(f"sbatch failed: {exc}. If the command timed out, the job may "
                                  "still have been queued: check `squeue --me`") from exc
        line = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
        m = _SUBMITTED.match(line)
        if not m:
            raise SubmissionError(f"sbatch printed no job id: stdout={result.stdout!r} "
                                  f"stderr={result.stderr!r}")
        log.info("submitted %s as job %s", script_path, m.group(1))
        return m.group(1)

    # --- inspection ------------------------------------------------------------------------

    def job(self, job_id: str) -> JobInfo:
        """``scontrol show job -o``; raises SlurmCommandError once the controller forgot it."""
        jobs = parse_scontrol_jobs(self._run(["scontrol", "show", "job", "-o", job_id]).stdout)
        for job in jobs:
            if job.job_id == job_id:
                return job
        if len(jobs) == 1:
            return jobs[0]  # e.g. an array job asked for by its base id
        raise SlurmJobStateError(f"scontrol show job {job_id} returned {len(jobs)} jobs")

    def sacct(self, job_id: str, *, duplicates: bool = False) -> list[SacctRow]:
        """Accounting rows of a job and its steps; ``duplicates`` adds earlier (requeued) runs.

        sacct lags slurmctld: just after a job starts or ends its row can be missing or
        incomplete (seen on 22.05: JobName ``allocation`` and only the batch host for a
        second). Prefer :meth:`job` while the controller still knows the job.
        """
        if self.json_accounting:
            args = ["sacct", "--json", "-j", job_id] + (["--duplicates"] if duplicates else [])
            try:
                return parse_sacct_json(self._run(args).stdout)
            except (SlurmParseError, SlurmCommandError) as exc:
                # Read as text from now on: a site whose JSON this client cannot use keeps
                # working, and says so once.
                log.warning("sacct --json unusable here (%s); reading sacct as text", exc)
                self.json_accounting = False
        fields = (*SACCT_FIELDS, "FailedNode") if self.failed_node_field else SACCT_FIELDS
        args = ["sacct", "--parsable2", "--noheader", "-o", ",".join(fields), "-j", job_id]
        if duplicates:
            args.insert(1, "--duplicates")
        return parse_sacct(self._run(args).stdout, fields)

    def squeue(self, user: str | None = None, job_ids: Collection[str] | None = None,
               states: str | None = None) -> list[SqueueRow]:
        """Queued and running jobs, optionally of one user or of the given job ids.

        ``states`` is squeue's ``-t`` (``all`` adds jobs that ended within MinJobAge: a job
        cancelled while pending after a requeue is then CANCELLED here, while sacct still
        shows the requeued run)."""
        args = ["squeue", "--noheader", "-o", SQUEUE_FORMAT]
        if user:
            args += ["-u", user]
        if states:
            args += ["-t", states]
        if job_ids is not None:
            if not job_ids:
                return []
            args += ["-j", ",".join(job_ids)]
        try:
            return parse_squeue(self._run(args).stdout)
        except SlurmCommandError as exc:
            if job_ids and INVALID_JOB in exc.output:
                return []  # all asked-for jobs are gone: an empty queue, not an error
            raise

    def nodes(self, names: Collection[str] | None = None) -> list[NodeInfo]:
        """All nodes (``scontrol show node -o``), or only ``names`` (one hostlist argument).

        Asking for the few nodes one cares about keeps the answer (and the controller's work)
        O(those nodes) instead of O(cluster): a supervisor confirming 2 lost nodes of a
        2,048-node job must not make slurmctld serialise every node of the cluster.
        """
        args = ["scontrol", "show", "node", "-o"]
        if names is not None:
            if not names:
                return []
            args.append(compress_hostlist(list(names)))
        return parse_scontrol_nodes(self._run(args).stdout)

    def partitions(self) -> list[PartitionInfo]:
        """All partitions (``scontrol show partition -o``)."""
        return parse_scontrol_partitions(
            self._run(["scontrol", "show", "partition", "-o"]).stdout)

    def config(self) -> dict[str, str]:
        """``scontrol show config`` as {"KillWait": "30 sec", ...}."""
        return parse_scontrol_config(self._run(["scontrol", "show", "config"]).stdout)

    def controller_reachable(self, timeout_s: float = 5) -> bool:
        """True when ``scontrol ping`` reports a controller UP. Tries once, no retries."""
        try:
            result = self.raw_runner.run(["scontrol", "ping"], timeout_s=timeout_s)
        except SlurmCommandError as exc:
            log.info("slurm controller not reachable: %s", exc)
            return False
        return bool(re.search(r"Slurmctld\(\w+\) at \S+ is UP", result.stdout))

    # --- actions ---------------------------------------------------------------------------

    def cancel(self, job_id: str, signal: str | None = None) -> None:
        """``scancel``; with ``signal`` (e.g. "USR1") only signal the job, don't end it."""
        args = ["scancel", *([f"--signal={signal}"] if signal else []), job_id]
        self._run(args)
        log.info("%s job %s", f"sent {signal} to" if signal else "cancelled", job_id)

    def requeue(self, job_id: str, *, hold: bool = False) -> None:
        """``scontrol requeue`` (or ``requeuehold``). The job needs ``--requeue``."""
        self._run(["scontrol", "requeuehold" if hold else "requeue", job_id])
        log.info("requeued job %s%s", job_id, " held" if hold else "")

    def update_job(self, job_id: str, **fields: str) -> None:
        """``scontrol update JobId=<job> Key=Value ...`` (e.g. ``Requeue="0"``)."""
        for key, value in fields.items():
            if not key.isalnum() or any(c.isspace() or ord(c) < 32 for c in str(value)):
                raise ValueError(f"refusing scontrol update field {key}={value!r}")
        self._run(["scontrol", "update", f"jobid={job_id}", *(f"{k}={v}" for k, v in fields.items())])
        log.info("job %s updated: %s", job_id, fields)

    def release(self, job_id: str) -> None:
        """``scontrol release``: lift a user/admin hold."""
        self._run(["scontrol", "release", job_id])

    def release_now(self, job_id: str) -> None:
        """Make a pending job eligible now: a requeued job otherwise waits ~121 s.

        A held job must also be released (:meth:`release`); this does not lift holds.
        """
        self._run(["scontrol", "update", f"jobid={job_id}", "StartTime=now"])
        log.info("job %s eligible now", job_id)

    def update_exclude(self, job_id: str, nodes: list[str]) -> list[str]:
        """Add ``nodes`` to a pending job's ExcNodeList (keeping the existing ones).

        ``nodes`` may hold hostlist expressions. Returns the merged list in hostlist order.
        Slurm refuses this for a job that is no longer pending.
        """
        current = self.job(job_id).excluded_nodes
        wanted = [n for x in nodes for n in expand_hostlist(x)]
        expr = compress_hostlist([*current, *wanted])
        if set(wanted) <= set(current):
            return expand_hostlist(expr)
        self._run(["scontrol", "update", f"jobid={job_id}", f"ExcNodeList={expr}"])
        log.info("job %s now excludes %s", job_id, expr)
        return expand_hostlist(expr)

    # --- waiting ---------------------------------------------------------------------------

    def job_state(self, job_id: str, source: Literal["auto", "scontrol", "sacct"] = "auto") -> str:
        """Current state: from scontrol while the controller knows the job, else from sacct."""
        if source != "sacct":
            try:
                return self.job(job_id).state
            except SlurmCommandError as exc:
                if source == "scontrol" or INVALID_JOB not in exc.output:
                    raise
        runs = [r for r in self.sacct(job_id) if not r.is_step]
        if not runs:
            raise SlurmJobStateError(f"job {job_id} is unknown to scontrol and sacct")
        return runs[-1].state

    def wait_for_state(
        self,
        job_id: str,
        states: Collection[str],
        timeout_s: float,
        *,
        poll_s: float = 1.0,
        max_poll_s: float | None = None,
        source: Literal["auto", "scontrol", "sacct"] = "auto",
        clock: Callable[[], float] | None = None,
        sleep: Callable[[float], None] | None = None,
    ) -> str:
        """Poll until the job is in one of ``states``; returns that state.

        ``poll_s`` is the first wait between polls, in seconds. With ``max_poll_s`` the wait
        doubles after each poll up to ``max_poll_s`` (a long wait then costs the controller
        and slurmdbd a query every ``max_poll_s`` rather than every second); without it every
        wait is ``poll_s``. The last wait is cut short at the deadline.

        Raises SlurmJobStateError if the job ends in another terminal state (it cannot get
        there any more) and SlurmWaitTimeout after ``timeout_s`` seconds of ``clock``.
        """
        if poll_s <= 0 or (max_poll_s is not None and max_poll_s < poll_s):
            raise ValueError(f"Detected: poll_s={poll_s:g}, max_poll_s={max_poll_s}. Requirement: "
                             "0 < poll_s <= max_poll_s. Fix: pass a positive poll_s and a max_poll_s "
                             "no smaller than it (or none, for a fixed interval).")
        clock = clock or self.clock
        sleep = sleep or self.sleep
        wanted = set(states)
        deadline = clock() + timeout_s
        seen = "UNKNOWN"
        wait_s = poll_s
        while True:
            seen = self._poll_state(job_id, source, default=seen)
            if seen in wanted:
                return seen
            if seen in TERMINAL_STATES:
                raise SlurmJobStateError(
                    f"job {job_id} ended {seen} while waiting for {sorted(wanted)}")
            if clock() >= deadline:
                raise SlurmWaitTimeout(
                    f"job {job_id} still {seen} after {timeout_s:g} s, expected {sorted(wanted)}")
            sleep(min(wait_s, deadline - clock()))
            if max_poll_s is not None:
                wait_s = min(wait_s * 2, max_poll_s)

    def _poll_state(self, job_id: str, source: Literal["auto", "scontrol", "sacct"],
                    default: str) -> str:
        try:
            return self.job_state(job_id, source)
        except SlurmJobStateError:
            # sacct lags slurmctld by a moment after submission: keep polling.
            if source == "sacct":
                return default
            raise


def slurm_client(env: Mapping[str, str], *, interactive: bool = False, timeout_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                 json_accounting: bool = False, failed_node_field: bool = False) -> SlurmClient:
    """The one way slurmkit reaches the real Slurm CLI: a :class:`SlurmClient` over a
    :class:`SubprocessRunner` with ``env``, the default retry policy, and the command timeout of
    its kind (``interactive``: :data:`INTERACTIVE_TIMEOUT_S`, else :data:`COMMAND_TIMEOUT_S`;
    ``timeout_s`` only where a caller's own bound is the point, as in a reachability probe).
    Tests pass a fake runner to :class:`SlurmClient` directly."""
    if timeout_s is None:
        timeout_s = INTERACTIVE_TIMEOUT_S if interactive else COMMAND_TIMEOUT_S
    return SlurmClient(SubprocessRunner(env=env), timeout_s=timeout_s, clock=clock, sleep=sleep,
                       json_accounting=json_accounting, failed_node_field=failed_node_field)
