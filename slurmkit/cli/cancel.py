"""``python -m slurmkit.cancel RUN_DIR|SWEEP_DIR|JOB_ID [--checkpoint] [--timeout-s S]``

Cancels a run's job cleanly and says so in its ledger (``cancel_requested``, then ``end`` with
status ``cancelled``).

Without ``--checkpoint``: ``scancel`` (through the project's Slurm client and its retries); a
local-executor job gets SIGINT, as submitit's own cancel sends it.

With ``--checkpoint`` the job saves a final checkpoint first, through the stop path the agents
and ranks already have: the cancel request file is written (:mod:`slurmkit.supervise.cancel_request`),
then SIGUSR1 goes to every agent (``scancel --signal=USR1``; locally SIGTERM to submitit's
controller, which forwards it). Ranks checkpoint at the next step boundary and leave; node 0
sees the request, writes ``end`` status ``cancelled`` and cancels its own job, so Slurm ends it
CANCELLED and never requeues it. A pending job has nothing to save: it is cancelled at once.
If the job is not over within ``--timeout-s`` it is cancelled without waiting any longer.
"""

from __future__ import annotations

import argparse
import getpass
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from rich.console import Console
from rich.text import Text

from slurmkit.errors import ConfigError
from slurmkit.jobstates import GONE, JobPoller, JobRef, JobState, make_client
from slurmkit.ledger.ledger import LEDGER_NAME, Ledger
from slurmkit.ledger.names import CANCEL_REQUESTED, CHECKPOINTED_ON_SIGNAL, END, RANKS_STARTED, SUBMITTED
from slurmkit.runview import RunWatcher, default_run_root, read_sweep, resolve
from slurmkit.slurm.client import INVALID_JOB, SlurmClient
from slurmkit.slurm.errors import SlurmCommandError
from slurmkit.supervise.cancel_request import cancel_request_path, write_cancel_request
from slurmkit.supervise.exits.successor import successor_chain


@dataclass(frozen=True)
class Target:
    run_dir: str
    ref: JobRef


def targets(kind: str, path: str) -> list[Target]:
    """The jobs to cancel: one run's, or one per variant of a sweep (its array tasks)."""
    if kind == "sweep":
        sweep = read_sweep(path)
        out: list[Target] = []
        for v in sweep.variants:
            w = RunWatcher(v.run_dir)
            w.refresh()
            job = sweep.job_ref(v) or (w.view.job_id if w.view else None)
            if job:
                out.append(Target(v.run_dir, JobRef(job, (w.view.executor if w.view else None) or "slurm")))
        return out
    w = RunWatcher(path)
    w.refresh()
    if w.view is None or w.view.job_id is None:
        raise ConfigError(f"{path} has no job in its ledger", "a run that slurmkit.submit submitted",
                          "nothing to cancel: the run was never submitted")
    return [Target(path, JobRef(w.view.job_id, w.view.executor or "slurm"))]


def stop_local_runner(sweep_dir: str, kill: Callable[[int, int], None] = os.kill) -> bool:
    """A local sweep: stop its runner first, so it starts no more variants; True if it ran.

    The pid counts only while it is still that runner (its command line names the module)."""
    if not os.path.isdir(sweep_dir):
        return False
    pid = read_sweep(sweep_dir).runner_pid
    if pid is None or pid <= 1:
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"slurmkit.sweep.local" not in f.read():
                return False
        kill(pid, signal.SIGTERM)
    except (OSError, ProcessLookupError):
        return False
    return True


def local_rank_pids(run_dir: str) -> list[int]:
    """Rank pids of the run's last generation that are still this run's processes.

    The ledger's ``ranks_started`` events name them; a pid counts only while its environment
    still says ``SLURMKIT_RUN_DIR=<run_dir>`` (pids are reused).
    """
    w = RunWatcher(run_dir)
    w.refresh()
    started = [e for e in w.tail.events if e.get("event") == RANKS_STARTED]
    last_gen = started[-1].get("generation") if started else None
    marker = f"SLURMKIT_RUN_DIR={run_dir}".encode()
    out = []
    for e in started:
        if e.get("generation") != last_gen:
            continue
        for pid in e.get("pids") or []:
            if not isinstance(pid, int) or pid <= 1:
                continue
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if marker in f.read().split(b"\0"):
                        out.append(pid)
            except OSError:
                continue
    return out


class Canceller:
    """Signals or cancels jobs and waits until they are over, with one batched poll per round."""

    def __init__(self, client: SlurmClient | None, poller: JobPoller, *, user: str,
                 kill: Callable[[int, int], None] = os.kill,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.client, self.poller, self.user = client, poller, user
        self.kill, self.clock, self.sleep = kill, clock, sleep

    def _slurm(self) -> SlurmClient:
        if self.client is None:
            raise ConfigError("a Slurm job, but no Slurm commands on PATH",
                              "scancel reachable from this shell",
                              "run slurmkit cancel where Slurm is installed (source the cluster env)")
        return self.client

    def hard(self, t: Target) -> None:
        if t.ref.executor == "local":
            self._signal_local(t, signal.SIGINT)  # what submitit's own LocalJob.cancel sends
            for pid in local_rank_pids(t.run_dir):
                # Ranks run in their own sessions: the controller's end does not reach them.
                try:
                    self.kill(-pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        else:
            self._slurm().cancel(t.ref.job_id)

    def request_checkpoint(self, t: Target, state: JobState) -> bool:
        """Ask for a final checkpoint; False when the job has nothing to save (not running)."""
        if state.state != "RUNNING":
            return False
        write_cancel_request(t.run_dir, job_id=t.ref.job_id, by=self.user, time_s=time.time())
        if t.ref.executor == "local":
            self._signal_local(t, signal.SIGTERM)
        else:
            try:
                self._slurm().cancel(t.ref.job_id, signal="USR1")
            except SlurmCommandError as exc:
                # Slurm 24.11 (not 22.05) refuses to signal a job with no step yet: its agents have not
                # started, so there is nothing to save; the caller cancels it outright.
                if INVALID_JOB not in exc.output:
                    raise
                return False
        return True

    def _signal_local(self, t: Target, sig: int) -> None:
        try:
            self.kill(int(t.ref.job_id), sig)
        except (ProcessLookupError, ValueError):
            pass  # already gone

    def wait_over(self, refs: list[JobRef], timeout_s: float, poll_s: float = 1.0) -> dict[JobRef, JobState]:
        deadline = self.clock() + timeout_s
        states = self.poller.poll(refs)  # jobs over already are remembered, not asked again
        while not all(s.over for s in states.values()) and self.clock() < deadline:
            self.sleep(poll_s)
            states = self.poller.poll(refs)
        return states


def cancel(ts: list[Target], canceller: Canceller, *, checkpoint: bool, timeout_s: float,
           console: Console) -> dict[JobRef, JobState]:
    states = canceller.poller.poll([t.ref for t in ts])
    asked: list[Target] = []
    for t in ts:
        if states[t.ref].over:
            console.print(Text(f"job {t.ref.job_id} is over already "
                           f"({states[t.ref].state if states[t.ref].state != GONE else 'its processes are gone'})"))
            continue
        ledger = Ledger(os.path.join(t.run_dir, LEDGER_NAME), source="cancel")
        ledger.append("cancel_requested", job_id=t.ref.job_id, checkpoint=checkpoint,
                      by=canceller.user, job_state=states[t.ref].state)
        if checkpoint and canceller.request_checkpoint(t, states[t.ref]):
            console.print(Text(f"job {t.ref.job_id}: final checkpoint requested"))
        else:
            canceller.hard(t)
            console.print(Text(f"job {t.ref.job_id}: cancelled"))
        asked.append(t)
    final = canceller.wait_over([t.ref for t in asked], timeout_s)
    late = [t for t in asked if not final[t.ref].over]
    for t in late:  # the checkpoint did not come in time: cancel without it
        Ledger(os.path.join(t.run_dir, LEDGER_NAME), source="cancel").append(
            "cancel_forced", job_id=t.ref.job_id, waited_s=timeout_s)
        canceller.hard(t)
    if late:
        final |= canceller.wait_over([t.ref for t in late], 60.0)
    # A handover that raced the cancel: node 0 had already submitted a successor job (its
    # ``successor`` line is in the ledger before the old job ends) when the old job was
    # cancelled; the run would go on in it. One ledger read per run, once its job is over.
    last = {t.run_dir: t for t in asked}
    handed = [n for t in asked for n in handed_over(t)]
    for n in handed:
        Ledger(os.path.join(n.run_dir, LEDGER_NAME), source="cancel").append(
            "cancel_requested", job_id=n.ref.job_id, checkpoint=False, by=canceller.user,
            job_state="successor")
        canceller.hard(n)
        console.print(Text(f"job {n.ref.job_id}: the run's successor job (handed over while "
                           "cancelling), cancelled too"))
        last[n.run_dir] = n
    if handed:
        final |= canceller.wait_over([n.ref for n in handed], 60.0)
    for t in last.values():
        _record_end(t, final[t.ref])
    return {**states, **final}


def handed_over(t: Target) -> list[Target]:
    """The successor jobs the run went on in after ``t``'s job (supervise/exits/successor.py), newest
    last; none for a local job."""
    if t.ref.executor != "slurm":
        return []
    return [Target(t.run_dir, JobRef(j, "slurm")) for j in successor_chain(t.run_dir, t.ref.job_id)[1:]]


#: An end the run wrote by itself, which a later cancel does not overwrite.
ENDED_BY_ITSELF = frozenset({"completed", "stopped", "failed"})


def _record_end(t: Target, state: JobState) -> None:
    """The ledger's last word is the cancel (unless node 0 already wrote it), and the request
    file goes: a later time-limit warning of a job that survived must requeue as usual."""
    try:
        os.unlink(cancel_request_path(t.run_dir))
    except FileNotFoundError:
        pass
    w = RunWatcher(t.run_dir)
    w.refresh()
    last_end = next((e for e in reversed(w.tail.events) if e.get("event") == END), None)
    requested = next((e for e in reversed(w.tail.events) if e.get("event") == CANCEL_REQUESTED), None)
    if last_end is not None and last_end.get("status") == "cancelled" and requested is not None \
            and float(last_end.get("t", 0)) >= float(requested.get("t", 0)):
        return
    # The run ended by itself before the cancel reached it (completed, or the supervisor
    # stopped it), and no new job took it on since: its own end stays the last word.
    last_edge = next((e for e in reversed(w.tail.events) if e.get("event") in (END, SUBMITTED)), None)
    if last_edge is not None and last_edge.get("event") == END and last_edge.get("status") in ENDED_BY_ITSELF:
        return
    Ledger(os.path.join(t.run_dir, LEDGER_NAME), source="cancel").append(
        "end", status="cancelled", job_id=t.ref.job_id, job_state=state.state)


def final_checkpoint(run_dir: str) -> str:
    """What the run's ledger says about the checkpoint it can resume from, in words."""
    w = RunWatcher(run_dir)
    w.refresh()
    events = w.tail.events
    asked = max((i for i, e in enumerate(events) if e.get("event") == CANCEL_REQUESTED), default=0)
    saved = next((e for e in reversed(events[asked:]) if e.get("event") == CHECKPOINTED_ON_SIGNAL), None)
    if saved is not None:
        return f"final checkpoint at step {saved.get('step')}"
    newest = max(w.view.checkpoints.values(), default=None) if w.view else None
    return "no checkpoint" if newest is None else f"newest checkpoint at step {newest}"


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="slurmkit cancel", description="Cancel a run's job cleanly.")
    p.add_argument("target", help="run directory, sweep directory or job id")
    p.add_argument("--checkpoint", action="store_true", help="take a final checkpoint first")
    p.add_argument("--timeout-s", type=float, default=300.0,
                   help="how long to wait for the job to end before cancelling it anyway (default 300)")
    p.add_argument("--root", help="run root to search for a job id (default: submit.run_root)")
    return p.parse_args(argv)


def main(argv: list[str], env: Mapping[str, str] | None = None, console: Console | None = None) -> int:
    args = _parse(argv)
    env = dict(os.environ) if env is None else env
    console = console or Console()
    try:
        kind, path = resolve(args.target, args.root or default_run_root(env))
        if kind == "sweep" and stop_local_runner(path):
            console.print(Text("stopped the sweep's local runner: no more variants start"))
        ts = targets(kind, path)
        client = make_client(env)
        canceller = Canceller(client, JobPoller(client), user=env.get("USER") or getpass.getuser())
        final = cancel(ts, canceller, checkpoint=args.checkpoint, timeout_s=args.timeout_s,
                       console=console)
    except ConfigError as exc:
        Console(stderr=True).print(Text(f"error: {exc}"))
        return 2
    for t in ts:
        word = final[t.ref].state if final[t.ref].state != GONE else "ended"  # a local job's processes are gone
        console.print(Text(f"job {t.ref.job_id}: {word}; {final_checkpoint(t.run_dir)}"))
    return 0 if all(s.over for s in final.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
