"""``python -m slurmkit.status [RUN_DIR|SWEEP_DIR|JOB_ID] [--watch]``: where a run is right now.

One run: Slurm's state and nodes, the supervisor's phase and generation, the step (of the
total), loss, tokens/s and MFU of the last step, the newest checkpoint per tier, the failures so
far by class, the newest one with the failing rank's last line, and the goodput so far (the
same figures ``python -m slurmkit.supervise`` derives from the ledger, computed by the same
code). A sweep directory (or an array job id) shows one line per variant. Without a target:
the newest run under the run root.

``--watch`` redraws in place until every run shown has ended. Each refresh reads only what the
run's files gained (see :mod:`slurmkit.runview`) and costs Slurm one batched query for all jobs
shown (see :mod:`slurmkit.jobstates`); when nothing changed the interval doubles up to
``--max-interval-s``. Exit codes (so a script can act on them): 0 while every run shown is
queued, running or ended well (completed, cancelled, handed on at a signal); 1 when one failed
(its ledger ended ``stopped`` or ``failed``, or its job is over in a failed state without an
``end`` record: FAILED, NODE_FAIL, TIMEOUT, OUT_OF_MEMORY, ..., or a local job's processes
gone, shown as "FAILED (no end record)"); 2 for a
target that names no run. ``--watch`` exits with the final code.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from slurmkit.errors import ConfigError
from slurmkit.jobstates import GONE, UNKNOWN, JobPoller, JobRef, JobState, make_client
from slurmkit.ledger.summary import failure_text
from slurmkit.runview import (
    RunView,
    RunWatcher,
    Variant,
    clean,
    default_run_root,
    find_dirs,
    read_sweep,
    resolve,
)


# ------------------------------------------------------------------ formatting

def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def step_text(v: RunView) -> str:
    if v.step is None:
        return "-"
    return f"{v.step}/{v.total_steps}" if v.total_steps else str(v.step)


def ckpt_text(v: RunView) -> str:
    return ", ".join(f"{tier} {step}" for tier, step in v.checkpoints.items()) or "none"


def failures_text(v: RunView) -> str:
    return ", ".join(f"{cls} {n}" for cls, n in sorted(v.failures.items())) or "none"


def last_failure_text(v: RunView) -> str:
    """The newest failure: class, rank and node, and the failing rank's last line (the ledger's
    words, escaped by failure_text); "-" while the summary is not read yet."""
    if v.report is not None and v.report.failures:
        return failure_text(v.report.failures[-1])
    return "-" if v.failures else "none"


def stragglers_text(v: RunView) -> str:
    return ", ".join(f"{node} (score {score:.2f}" + (f", step {step})" if step is not None else ")")
                     for node, (score, step) in sorted(v.stragglers.items())) or "none"


#: A local job's processes are gone: Slurm's word for how its ledger ended.
LOCAL_END_STATES = {"completed": "COMPLETED", "cancelled": "CANCELLED", "stopped": "FAILED", "failed": "FAILED",
                    "signalled": "PREEMPTED"}


def state_text(v: RunView, job: JobState | None) -> str:
    """Slurm's state of the job (for a local job, the one Slurm would show) / the run's phase."""
    slurm = job.state if job is not None else "-"
    if slurm == GONE:  # a local job, its processes gone: say it in Slurm's words
        slurm = LOCAL_END_STATES.get(v.phase, "FAILED") if v.ended else "FAILED (no end record)"
    return f"{slurm} / {v.phase}"


def tokens_text(v: RunView) -> str:
    return _num(v.tokens_per_s, ",.0f")


def mfu_text(v: RunView) -> str:
    return "-" if v.mfu is None else f"{v.mfu:.1%}"


def goodput_text(v: RunView) -> str:
    return "-" if v.goodput is None else f"{v.goodput:.1%}"


def duration_text(seconds: float | None) -> str:
    """``3h 05m``, ``4m 10s``, ``12s``; "-" when unknown."""
    if seconds is None or seconds < 0:
        return "-"
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    return f"{s // 60}m {s % 60:02d}s" if s >= 60 else f"{s}s"


def elapsed_text(v: RunView, now: float) -> str:
    """Since submit (queueing and requeues included), to the end once the run ended."""
    if v.submitted_at is None:
        return "-"
    return duration_text((v.ended_at if v.ended_at is not None else now) - v.submitted_at)


def eta_text(v: RunView) -> str:
    """The steps left at the newest step's pace: no queueing, restarts or saves to come."""
    if v.ended or v.step is None or not v.total_steps or v.step_time_s is None:
        return "-"
    return f"{duration_text(max(0, v.total_steps - v.step) * v.step_time_s)} at the last step's pace"


def goodput_row(v: RunView) -> str:
    if v.goodput is None:
        return "- (no training start recorded yet)" if not v.ended else "-"
    return f"{v.goodput:.1%} of the time since submit trained toward the result (queue and start-up count)"


def run_table(v: RunView, job: JobState | None) -> Table:
    t = Table(title=clean(v.name), show_header=False, title_justify="left")
    t.add_column("figure", style="bold")
    t.add_column("value")
    where = job.where if job is not None and job.where else ", ".join(v.nodes)
    rows = [
        ("run", v.run_dir), ("job", f"{v.job_id or '-'} ({v.executor or 'not submitted'})"),
        ("state", state_text(v, job)), ("nodes", where or "-"),
        ("generation", "-" if v.generation is None else str(v.generation)),
        ("step", step_text(v)), ("loss", _num(v.loss, ".4f")), ("tokens/s", tokens_text(v)),
        ("MFU", mfu_text(v)), ("checkpoints", ckpt_text(v)), ("failures", failures_text(v)),
        ("last failure", last_failure_text(v)),
        ("stragglers", stragglers_text(v)), ("goodput so far", goodput_row(v)),
        ("elapsed", elapsed_text(v, time.time())), ("time limit", f"{v.time_limit} per allocation"
                                                    if v.time_limit else "-"),
        ("ETA", eta_text(v)),
    ]
    for name, value in rows:
        t.add_row(name, clean(value))
    return t


SWEEP_COLUMNS = ("#", "overrides", "job", "state", "step", "loss", "tokens/s", "MFU",
                 "checkpoints", "failures", "goodput")


def sweep_table(title: str, rows: Sequence[tuple[int, str, RunView, JobState | None]]) -> Table:
    t = Table(title=clean(title), title_justify="left")
    for col in SWEEP_COLUMNS:
        t.add_column(col, justify="right" if col in ("#", "step", "loss", "tokens/s", "MFU") else "left")
    for index, overrides, v, job in rows:
        t.add_row(*(clean(c) for c in (
            index, overrides, v.job_id or "-", state_text(v, job), step_text(v),
            _num(v.loss, ".4f"), tokens_text(v), mfu_text(v), ckpt_text(v), failures_text(v),
            goodput_text(v))))
    return t


# ------------------------------------------------------------------ what is shown

@dataclass
class Shown:
    """One run on screen: its watcher, the label of its line and the job it runs in."""

    watcher: RunWatcher
    index: int = 0
    label: str = ""
    job_override: str | None = None  # a sweep's array task id, when the ledger lacks one

    def ref(self) -> JobRef | None:
        v = self.watcher.view
        job_id = self.job_override or (v.job_id if v is not None else None)
        if job_id is None:
            return None
        executor = (v.executor if v is not None else None) or "slurm"
        return JobRef(job_id, executor)


#: How a run's ledger ends when it failed (slurmkit.supervise.exits.endings, the agent).
FAILED_ENDS = frozenset({"stopped", "failed"})
#: Jobs over without an ``end`` record in a state that is no failure of the run.
JOB_STATES_NOT_FAILED = frozenset({"COMPLETED", "CANCELLED", "PREEMPTED", "REVOKED"})
EXIT_FAILED = 1


class StatusBoard:
    """The runs of one status target, refreshed together."""

    def __init__(self, kind: str, path: str) -> None:
        self.kind, self.path = kind, path
        if kind == "sweep":
            sweep = read_sweep(path)
            self.title = f"sweep {sweep.name} (array job {sweep.job_id or '-'})  {path}"
            self.shown = [Shown(RunWatcher(v.run_dir), v.index, " ".join(v.overrides), sweep.job_ref(v))
                          for v in sweep.variants]
        else:
            self.title = path
            self.shown = [Shown(RunWatcher(path))]
        self.jobs: dict[JobRef, JobState] = {}
        for s in self.shown:
            s.watcher.refresh()  # the job ids to ask Slurm about are in the ledgers

    def refresh(self, poller: JobPoller) -> bool:
        """Re-read every run and ask Slurm once; True when anything shown changed."""
        # Jobs first: a job seen over has written all it will, so the files read next are final.
        refs = [r for r in (s.ref() for s in self.shown) if r is not None]
        jobs = poller.poll(refs)
        changed = jobs != self.jobs
        self.jobs = jobs
        for s in self.shown:
            changed = s.watcher.refresh() or changed
        return changed

    def done(self) -> bool:
        """Every run's job is over; where Slurm cannot tell (no job yet, no Slurm), its ledger ended.

        The ledger's ``end`` comes a moment before Slurm's end (and a preempted run is requeued
        after one), so Slurm's word counts whenever there is one."""
        for s in self.shown:
            ref, v = s.ref(), s.watcher.view
            job = self.jobs.get(ref) if ref is not None else None
            if job is not None and job.state != UNKNOWN:
                if not job.over:
                    return False
            elif not (v is not None and v.ended):
                return False
        return True

    def failed(self) -> list[str]:
        """The runs shown that failed (see the module's exit codes), as their directories."""
        out = []
        for s in self.shown:
            ref, v = s.ref(), s.watcher.view
            job = self.jobs.get(ref) if ref is not None else None
            if v is not None and v.ended:
                bad = v.phase in FAILED_ENDS
            else:
                bad = job is not None and job.over and job.state not in JOB_STATES_NOT_FAILED
            if bad:
                out.append(s.watcher.run_dir)
        return out

    def render(self) -> RenderableType:
        views = [(s, s.watcher.view) for s in self.shown]
        if self.kind == "run":
            s, v = views[0]
            assert v is not None  # noqa: S101 - refresh() ran
            ref = s.ref()
            return run_table(v, self.jobs.get(ref) if ref else None)
        rows = []
        for s, v in views:
            if v is not None:
                ref = s.ref()
                rows.append((s.index, s.label, v, self.jobs.get(ref) if ref else None))
        return sweep_table(self.title, rows)


def watch(board: StatusBoard, poller: JobPoller, console: Console, *, interval_s: float,
          max_interval_s: float, sleep: Callable[[float], None] = time.sleep,
          clock: Callable[[], float] = time.monotonic, timeout_s: float = 0) -> int:
    """Redraw until every run ended (or ``timeout_s``); returns the number of refreshes."""
    refreshes, interval = 0, interval_s
    deadline = clock() + timeout_s if timeout_s > 0 else None
    board.refresh(poller)
    with Live(board.render(), console=console, auto_refresh=False, transient=False) as live:
        while not board.done() and (deadline is None or clock() < deadline):
            sleep(interval)
            refreshes += 1
            changed = board.refresh(poller)
            interval = interval_s if changed else min(max_interval_s, interval * 2)
            stamp = Text(f"refreshed {time.strftime('%H:%M:%S')}, next in {interval:g} s",
                         style="dim")
            live.update(Group(board.render(), stamp), refresh=True)
    return refreshes


# ------------------------------------------------------------------ the command

def newest_run(root: str) -> tuple[str, str]:
    runs, sweeps = find_dirs(root)
    sweep_runs = {v.run_dir for p in sweeps for v in _variants(p)}
    candidates = [("sweep", p) for p in sweeps] + [("run", p) for p in runs if p not in sweep_runs]
    if not candidates:
        raise ConfigError(f"no runs under {os.path.abspath(root)}", "a run submitted with slurmkit.submit",
                          "pass RUN_DIR, or --root where runs were submitted (submit.run_root)")
    return max(candidates, key=lambda c: os.path.getmtime(c[1]))


def _variants(path: str) -> list[Variant]:
    try:
        return read_sweep(path).variants
    except ConfigError:
        return []


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="slurmkit status", description="Where a run is right now.")
    p.add_argument("target", nargs="?", help="run directory, sweep directory or job id "
                   "(default: the newest run under the run root)")
    p.add_argument("--root", help="run root to search (default: the config's submit.run_root)")
    p.add_argument("--watch", action="store_true", help="refresh until every run shown has ended")
    p.add_argument("--interval-s", type=float, default=2.0, help="refresh interval (default 2)")
    p.add_argument("--max-interval-s", type=float, default=30.0,
                   help="longest interval after the backoff when nothing changes (default 30)")
    return p.parse_args(argv)


def main(argv: list[str], env: Mapping[str, str] | None = None, console: Console | None = None) -> int:
    args = _parse(argv)
    env = dict(os.environ) if env is None else env
    console = console or (Console() if sys.stdout.isatty() else Console(width=160))
    try:
        root = args.root or default_run_root(env)
        kind, path = resolve(args.target, root) if args.target else newest_run(root)
        board = StatusBoard(kind, path)
    except ConfigError as exc:
        Console(stderr=True).print(clean(f"error: {exc}"))
        return 2
    poller = JobPoller(make_client(env))
    if args.watch:
        watch(board, poller, console, interval_s=max(0.1, args.interval_s),
              max_interval_s=max(args.interval_s, args.max_interval_s))
    else:
        board.refresh(poller)
        console.print(board.render())
    return EXIT_FAILED if board.failed() else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
