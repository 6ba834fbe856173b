"""Live progress for ``submit.wait=true``: a bar of steps with the current loss, then the summary.

The same readers as ``slurmkit status --watch`` (:class:`slurmkit.runview.RunWatcher`, one
batched Slurm query per refresh through :class:`slurmkit.jobstates.JobPoller`), drawn as a
rich progress bar instead of a table. When the job is over the run's summary table is printed,
the one ``python -m slurmkit.supervise RUN_DIR`` prints, and under it the newest failure with the
failing rank's last line (``python: can't open file ...``, a traceback's last line).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text

from slurmkit.jobstates import GONE, JobPoller, JobRef, make_client
from slurmkit.ledger.summary import RunReport, failure_text
from slurmkit.runview import RunWatcher, clean
from slurmkit.untrusted import safe_line


def _description(phase: str, state: str) -> str:
    # rich reads markup in a task description: brackets from the ledger are escaped too;
    # a local job whose processes are gone is "ended" (the phase says how), not "gone"
    word = "ended" if state == GONE else state.lower()
    return escape(safe_line(f"{word} / {phase}"))


def last_failure(report: RunReport) -> str | None:
    """The newest failure as one safe terminal line (:func:`slurmkit.ledger.summary.failure_text`:
    why a crashed rank failed, in its own words), None when the run has had none."""
    return failure_text(report.failures[-1]) if report.failures else None


def follow_progress(run_dir: str, job_id: str, executor: str, env: Mapping[str, str],
                    console: Console, timeout_s: float = 0, *, poll_s: float = 1.0,
                    max_poll_s: float = 10.0, poller: JobPoller | None = None,
                    sleep: Callable[[float], None] = time.sleep,
                    clock: Callable[[], float] = time.monotonic) -> float:
    """Show the run's progress until its job is over; returns the seconds of ``timeout_s``
    left (``timeout_s`` itself when it is 0, no limit) for the caller's final wait."""
    watcher = RunWatcher(run_dir)
    poller = poller or JobPoller(make_client(env) if executor == "slurm" else None)
    ref = JobRef(job_id, executor)
    start = clock()
    interval = poll_s
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("steps  loss {task.fields[loss]}  {task.fields[tps]} tok/s"),
               TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as bar:
        task = bar.add_task("submitted", total=None, loss="-", tps="-")
        while True:
            job = poller.poll([ref])[ref]  # first: once it is over, the refresh sees all it wrote
            changed = watcher.refresh()
            v = watcher.view
            if v is not None:
                bar.update(task, description=_description(v.phase, job.state),
                           total=v.total_steps, completed=v.step or 0,
                           loss="-" if v.loss is None else f"{v.loss:.4f}",
                           tps="-" if v.tokens_per_s is None else f"{v.tokens_per_s:,.0f}")
            if job.over or (timeout_s > 0 and clock() - start >= timeout_s):
                break
            interval = poll_s if changed else min(max_poll_s, interval * 1.5)
            sleep(interval)
    if watcher.view is not None and watcher.view.report is not None:
        from slurmkit.supervise.__main__ import summary_table

        console.print(summary_table(watcher.view.report))
        last = last_failure(watcher.view.report)
        if last is not None:
            console.print(Text(f"last failure: {last}"), highlight=False)
    else:
        console.print(clean(f"no ledger events in {run_dir}"))
    if timeout_s <= 0:
        return timeout_s
    return max(1.0, timeout_s - (clock() - start))
