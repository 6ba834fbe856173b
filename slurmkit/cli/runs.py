"""``python -m slurmkit.runs [--root RUN_ROOT] [--limit N]``: recent runs, newest first.

One line per run directory below the run root (default: the config's ``submit.run_root``):
when it started, its name, job id, Slurm's state and the run's own phase, the step, and the
directory. Sweeps show as one line of their own, with their variants below it.

Each run costs two small reads (its ledger's first line and its last block: see
:func:`slurmkit.runview.ledger_edges`) however long it ran, and all jobs listed cost Slurm one
batched query.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Mapping

from rich.console import Console
from rich.table import Table
from rich.text import Text

from slurmkit.cli.status import state_text, step_text
from slurmkit.errors import ConfigError
from slurmkit.jobstates import JobPoller, JobRef, JobState, make_client
from slurmkit.ledger.ledger import LEDGER_NAME
from slurmkit.runfiles import CONFIG_NAME, SWEEP_NAME
from slurmkit.runview import RunView, build_view, clean, default_run_root, find_dirs, ledger_edges, read_sweep


def _mtime(path: str) -> float:
    """When the run was created: its frozen config (or sweep.json) is written once, at submit."""
    for name in (CONFIG_NAME, SWEEP_NAME, LEDGER_NAME):
        try:
            return os.path.getmtime(os.path.join(path, name))
        except OSError:
            continue
    return 0.0


def listing(root: str, limit: int) -> list[tuple[str, str, RunView | None, str | None]]:
    """(kind, path, view, sweep path) rows, newest first; a sweep's variants follow it."""
    runs, sweeps = find_dirs(root)
    in_sweep: dict[str, str] = {}
    variants: dict[str, list[str]] = {}
    for p in sweeps:
        try:
            variants[p] = [v.run_dir for v in read_sweep(p).variants]
        except ConfigError:
            variants[p] = []
        for r in variants[p]:
            in_sweep[os.path.abspath(r)] = p
    tops = [("sweep", p) for p in sweeps] + [("run", p) for p in runs if p not in in_sweep]
    tops.sort(key=lambda kp: _mtime(kp[1]), reverse=True)
    rows: list[tuple[str, str, RunView | None, str | None]] = []
    for kind, path in tops[:limit]:
        if kind == "sweep":
            rows.append(("sweep", path, None, None))
            rows += [("run", r, build_view(r, ledger_edges(r), full=False), path) for r in variants[path]]
        else:
            rows.append(("run", path, build_view(path, ledger_edges(path), full=False), None))
    return rows


def table(rows: list[tuple[str, str, RunView | None, str | None]],
          jobs: Mapping[JobRef, JobState]) -> Table:
    t = Table(title="runs, newest first", title_justify="left")
    for col in ("started", "name", "job", "state", "step", "run directory"):
        t.add_column(col, justify="right" if col == "step" else "left")
    for kind, path, v, sweep in rows:
        if kind == "sweep" or v is None:
            t.add_row(clean(time.strftime("%m-%d %H:%M", time.localtime(_mtime(path)))),
                      clean(f"sweep {os.path.basename(os.path.dirname(path))}"), clean("-"),
                      clean("-"), clean("-"), clean(path))
            continue
        ref = JobRef(v.job_id, v.executor or "slurm") if v.job_id else None
        started = time.strftime("%m-%d %H:%M", time.localtime(_mtime(path)))
        t.add_row(clean(started), clean(("  " if sweep else "") + v.name), clean(v.job_id or "-"),
                  clean(state_text(v, jobs.get(ref) if ref else None)), clean(step_text(v)),
                  clean(path))
    return t


def main(argv: list[str], env: Mapping[str, str] | None = None, console: Console | None = None) -> int:
    p = argparse.ArgumentParser(prog="slurmkit runs", description="Recent runs under a run root.")
    p.add_argument("--root", help="the run root (default: the config's submit.run_root)")
    p.add_argument("--limit", type=int, default=20, help="how many runs or sweeps (default 20)")
    args = p.parse_args(argv)
    env = dict(os.environ) if env is None else env
    console = console or (Console() if sys.stdout.isatty() else Console(width=200))
    root = args.root or default_run_root(env)
    if not os.path.isdir(root):
        Console(stderr=True).print(Text(
            f"error: Detected: no run root {os.path.abspath(root)}. Requirement: the directory "
            "slurmkit.submit writes runs into. Fix: pass --root RUN_ROOT (submit.run_root)."))
        return 2
    rows = listing(root, max(1, args.limit))
    refs = [JobRef(v.job_id, v.executor or "slurm") for _, _, v, _ in rows
            if v is not None and v.job_id and not v.ended]
    jobs = JobPoller(make_client(env) if any(r.executor == "slurm" for r in refs) else None).poll(refs)
    console.print(table(rows, jobs))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
