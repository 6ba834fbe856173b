"""FakeSlurm: an in-memory Slurm controller behind the :class:`CommandRunner` interface.

For fast unit tests of code that drives Slurm (the client here, submission, the supervisor).
It answers sbatch, squeue, sacct, scancel and scontrol (show job/node/partition/config,
update, requeue, requeuehold, hold, release, ping) in Slurm 22.05's text formats and with its
error messages, records every call, and can fail the next N calls with a transient error.
Jobs move only when a test says so (:meth:`FakeSlurm.start`, :meth:`FakeSlurm.finish`,
:meth:`FakeSlurm.fail_node`), so tests are deterministic.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from slurmkit.errors import ConfigError
from slurmkit.slurm.errors import SlurmCommandError, SlurmCommandTimeout
from slurmkit.slurm.hostlist import expand_hostlist
from slurmkit.slurm.runner import CommandResult
from slurmkit.slurm.timelimit import parse_time_limit
from testkit.fakeslurm.controller import FakeController
from testkit.fakeslurm.jobs import (
    FakeCommandFailure,
    FakeJob,
    parse_sbatch_args,
    sbatch_directives,
)

#: The transient error injected by default (what a busy slurmctld makes the CLI print).
SOCKET_TIMEOUT = "slurm_load_jobs error: Socket timed out on send/recv operation"
_SUBMIT_FAILED = "sbatch: error: Batch job submission failed: "


class FakeSlurm(FakeController):
    """An in-memory Slurm cluster (see module docstring).

    Args:
        partitions: partition name -> hostlist of its nodes; the first is the default.
            Default: ``{"debug": "node[1-4]"}``.
        max_time_s: partition name -> MaxTime in seconds (absent: UNLIMITED).
        cluster_name: if set, ``sbatch --parsable`` prints ``<id>;<cluster>`` as a
            multi-cluster setup does.
        clock: epoch seconds, for submit/start/end/eligible times.
        config: extra or overriding ``scontrol show config`` entries.
        gres: the Gres of every node.

    Attributes:
        calls: every argument list run, in order; ``envs`` the matching ``env`` arguments.
        jobs: job id -> :class:`FakeJob`; ``nodes``: name -> FakeNode.
        controller_up: set False to make every command fail as with a dead slurmctld.
    """

    def __init__(
        self,
        partitions: Mapping[str, str] | None = None,
        *,
        max_time_s: Mapping[str, int] | None = None,
        cluster_name: str | None = None,
        clock: Callable[[], float] = time.time,
        config: Mapping[str, str] | None = None,
        gres: str = "gpu:4",
    ) -> None:
        super().__init__(partitions, max_time_s, clock, config, gres, cluster_name)
        self.calls: list[list[str]] = []
        self.envs: list[dict[str, str] | None] = []
        self._next_id = 1
        self._failures: list[tuple[str | None, str | None]] = []

    # --- test controls ---------------------------------------------------------------------

    def fail_next(self, n: int = 1, message: str | None = SOCKET_TIMEOUT, *,
                  command: str | None = None) -> None:
        """Fail the next ``n`` calls (of program ``command`` only, if given) with ``message``.

        ``message=None`` makes them time out instead (:class:`SlurmCommandTimeout`).
        """
        self._failures += [(command, message)] * n

    def start(self, job_id: str, nodes: list[str] | None = None) -> list[str]:
        """Start a pending job on ``nodes`` (default: the first free usable ones)."""
        job = self.jobs[job_id]
        if job.state != "PENDING":
            raise ValueError(f"job {job_id} is {job.state}, not PENDING")
        chosen = nodes or self._free_nodes(job)[: job.num_nodes]
        if len(chosen) < job.num_nodes:
            raise ValueError(f"job {job_id} needs {job.num_nodes} nodes, {len(chosen)} free")
        job.state, job.reason, job.nodes = "RUNNING", "None", list(chosen)
        job.start_time, job.end_time = self.clock(), None
        for n in chosen:
            self.nodes[n].state = "ALLOCATED"
        return list(chosen)

    def finish(self, job_id: str, state: str = "COMPLETED", exit_code: int = 0,
               exit_signal: int = 0) -> None:
        """End a job in ``state`` (COMPLETED, FAILED, TIMEOUT, OUT_OF_MEMORY, ...)."""
        job = self.jobs[job_id]
        job.state, job.exit_code, job.exit_signal = state, exit_code, exit_signal
        job.reason = "NonZeroExitCode" if exit_code else "None"
        job.end_time = self.clock()
        self._free(job)

    def preempt(self, job_id: str) -> None:
        """A higher-priority job preempts a running one: PreemptTime is set and its steps get
        SIGTERM; what follows (requeue or end) is up to the test, as GraceTime would be."""
        job = self.jobs[job_id]
        job.preempt_time = self.clock()
        job.signals.append("TERM")

    def fail_node(self, name: str, reason: str = "Not responding") -> None:
        """A node stops responding: its jobs end NODE_FAIL; requeueable ones go back to PENDING."""
        self._node_down(name, reason)

    def forget(self, job_id: str) -> None:
        """The controller purges a finished job (after MinJobAge); sacct still knows it."""
        self.purged.add(job_id)

    # --- CommandRunner ---------------------------------------------------------------------

    def run(self, args: list[str], *, timeout_s: float = 30, input: str | None = None,
            env: Mapping[str, str] | None = None) -> CommandResult:
        """Answer one command as the real CLI would (see :class:`CommandRunner`)."""
        argv = [str(a) for a in args]
        self.calls.append(argv)
        self.envs.append(dict(env) if env is not None else None)
        self._maybe_inject(argv, timeout_s)
        try:
            stdout = self._dispatch(argv, input, env)
        except FakeCommandFailure as fail:
            raise SlurmCommandError(argv, fail.returncode, fail.stderr) from None
        return CommandResult(argv, 0, stdout, "")

    def _maybe_inject(self, argv: list[str], timeout_s: float) -> None:
        for i, (command, message) in enumerate(self._failures):
            if command is None or command == argv[0]:
                del self._failures[i]
                if message is None:
                    raise SlurmCommandTimeout(argv, timeout_s, "")
                raise SlurmCommandError(argv, 1, message)
        if not self.controller_up and argv[:2] != ["scontrol", "ping"]:
            raise SlurmCommandError(
                argv, 1, f"{argv[0]}: error: Unable to contact slurm controller (connect failure)")

    def _dispatch(self, argv: list[str], input: str | None, env: Mapping[str, str] | None) -> str:
        prog, rest = argv[0], argv[1:]
        if prog == "sbatch":
            return self._sbatch(rest, input, env)
        handlers = {"squeue": self._squeue, "sacct": self._sacct, "scancel": self._scancel,
                    "scontrol": self._scontrol}
        if prog not in handlers:
            raise FakeCommandFailure(f"{prog}: command not found", 127)
        return handlers[prog](rest)

    # --- sbatch ----------------------------------------------------------------------------

    def _sbatch(self, rest: list[str], input: str | None, env: Mapping[str, str] | None) -> str:
        cli, positional = parse_sbatch_args(rest)
        if positional:
            try:
                with open(positional[0]) as f:
                    script = f.read()
            except OSError:
                raise FakeCommandFailure(
                    f"sbatch: error: Unable to open file {positional[0]}") from None
        elif input is not None:
            script = input
        else:
            raise FakeCommandFailure("sbatch: error: Batch script is empty!")
        directives, _ = parse_sbatch_args(sbatch_directives(script))
        job = self._new_job({**directives, **cli}, positional[0] if positional else "(stdin)")
        job.env = dict(env or {})
        job.sbatch_args = list(rest)
        self.jobs[job.job_id] = job
        return job.job_id + (f";{self.cluster_name}" if self.cluster_name else "") + "\n"

    def _new_job(self, opts: dict[str, str], command: str) -> FakeJob:
        partition = opts.get("--partition") or next(iter(self.partitions), None)
        if partition is None:
            raise FakeCommandFailure(_SUBMIT_FAILED + "No partition specified or system default partition")
        if partition not in self.partitions:
            raise FakeCommandFailure(_SUBMIT_FAILED + "Invalid partition name specified")
        try:
            num_nodes = int(opts.get("--nodes", "1").split("-")[0])
            limit = parse_time_limit(opts["--time"]) if "--time" in opts else None
        except (ValueError, ConfigError):
            raise FakeCommandFailure("sbatch: error: Invalid numeric value") from None
        if num_nodes > len(self.partitions[partition]):
            raise FakeCommandFailure(
                _SUBMIT_FAILED + "Requested node configuration is not available")
        max_time = self.max_time_s.get(partition)
        if max_time is not None and limit is not None and limit > max_time:
            raise FakeCommandFailure(
                _SUBMIT_FAILED + "Requested time limit is invalid (missing or exceeds some limit)")
        now = self.clock()
        job_id = str(self._next_id)
        self._next_id += 1
        hold = "--hold" in opts
        return FakeJob(
            job_id=job_id, name=opts.get("--job-name") or command.rsplit("/", 1)[-1],
            partition=partition, num_nodes=num_nodes, command=command,
            work_dir=opts.get("--chdir", "/tmp"),
            requeue="--requeue" in opts and "--no-requeue" not in opts,
            time_limit_s=limit if limit is not None else max_time, submit_time=now,
            eligible_time=None if hold else now, reason="JobHeldUser" if hold else "None",
            exc_nodes=expand_hostlist(opts.get("--exclude", "")),
        )
