"""``python -m slurmkit.clean [--root RUN_ROOT] [--older-than-days D] [--keep N] [--yes]``

Removes finished runs below the run root (default: the config's ``submit.run_root``). A tiny run
leaves a few hundred MB there (its node-local checkpoint tier, logs, ledger), and nothing else
ever removes it.

What it removes: a run directory (or a whole sweep directory, when every variant finished)
whose ledger ended for good (``completed``, ``stopped``, ``failed``, ``cancelled``; a run handed
to a requeued job at a signal has not), last written more than ``--older-than-days`` ago, that
is not among the ``--keep`` newest finished ones, and that belongs to the user running this
(a shared run root holds other users' runs). Without ``--yes`` it only lists what it would
remove and how much space that frees. Checkpoints on tiers outside the run directory (Lustre,
the object store) are not touched: ``slurmkit store gc`` prunes those.

Exit codes: 0, 2 for a run root that cannot be read.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from slurmkit.cli.logs import FINAL_ENDS
from slurmkit.errors import ConfigError
from slurmkit.ledger.ledger import LEDGER_NAME
from slurmkit.runview import build_view, clean, default_run_root, find_dirs, ledger_edges, read_sweep


@dataclass(frozen=True)
class Finished:
    path: str
    kind: str  # "run" | "sweep"
    status: str  # the end status; a sweep: its variants' statuses, joined
    last_write: float  # epoch seconds: the newest ledger write
    size: int  # bytes


def _status(run_dir: str) -> str | None:
    """The run's final end status, None while it may still run."""
    v = build_view(run_dir, ledger_edges(run_dir), full=False)
    return v.phase if v.ended and v.phase in FINAL_ENDS else None


def _last_write(run_dir: str) -> float:
    try:
        return os.path.getmtime(os.path.join(run_dir, LEDGER_NAME))
    except OSError:
        return os.path.getmtime(run_dir)


def tree_size(path: str) -> int:
    """Bytes below ``path``, links not followed."""
    total = 0
    for d, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(d, f)).st_size
            except OSError:
                pass
    return total


def finished_runs(root: str, uid: int) -> list[Finished]:
    """Runs and sweeps below ``root`` that ended for good and belong to ``uid``, newest first."""
    runs, sweeps = find_dirs(root)
    out: list[Finished] = []
    in_sweep: set[str] = set()
    for p in sweeps:
        try:
            variants = [v.run_dir for v in read_sweep(p).variants]
        except ConfigError:
            continue
        in_sweep.update(os.path.abspath(v) for v in variants)
        statuses = [_status(v) if os.path.isdir(v) else "gone" for v in variants]
        if variants and all(statuses) and os.lstat(p).st_uid == uid:
            last = max((_last_write(v) for v in variants if os.path.isdir(v)), default=os.path.getmtime(p))
            out.append(Finished(p, "sweep", ",".join(sorted(set(s for s in statuses if s))), last, tree_size(p)))
    for p in runs:
        if os.path.abspath(p) in in_sweep or os.lstat(p).st_uid != uid:
            continue
        status = _status(p)
        if status:
            out.append(Finished(p, "run", status, _last_write(p), tree_size(p)))
    return sorted(out, key=lambda f: f.last_write, reverse=True)


def select(found: list[Finished], *, older_than_s: float, keep: int, now: float) -> list[Finished]:
    """What goes: past the ``keep`` newest, and idle longer than ``older_than_s``."""
    return [f for f in found[keep:] if now - f.last_write >= older_than_s]


def prune_empty_parents(path: str, root: str) -> None:
    """Remove the now empty ``<run_root>/<job.name>/`` folders up to (not including) the root."""
    root = os.path.abspath(root)
    path = os.path.abspath(path)
    while path.startswith(root + os.sep):
        try:
            os.rmdir(path)  # only an empty one
        except OSError:
            return
        path = os.path.dirname(path)


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def main(argv: list[str], console: Console | None = None, *,
         clock: Callable[[], float] = time.time, uid: int | None = None) -> int:
    p = argparse.ArgumentParser(prog="slurmkit clean", description="Remove finished runs.")
    p.add_argument("--root", help="the run root (default: the config's submit.run_root)")
    p.add_argument("--older-than-days", type=float, default=0.0,
                   help="only runs whose ledger was last written this many days ago (default 0)")
    p.add_argument("--keep", type=int, default=0, help="keep this many newest finished runs (default 0)")
    p.add_argument("--yes", action="store_true", help="remove them (without: only list them)")
    args = p.parse_args(argv)
    console = console or Console()
    root = os.path.abspath(args.root or default_run_root(os.environ))
    if not os.path.isdir(root):
        Console(stderr=True).print(clean(f"error: Detected: the run root {root} is not a directory. "
                                         "Requirement: the directory runs were submitted into. "
                                         "Fix: pass --root RUN_ROOT (submit.run_root)."))
        return 2
    found = finished_runs(root, os.getuid() if uid is None else uid)
    going = select(found, older_than_s=max(0.0, args.older_than_days) * 86400, keep=max(0, args.keep),
                   now=clock())
    if not going:
        console.print(clean(f"nothing to remove below {root} ({len(found)} finished run(s) of yours, "
                            "none past --keep and --older-than-days)"))
        return 0
    t = Table(title=clean(f"finished runs below {root}"), title_justify="left")
    for col in ("last written", "kind", "status", "size", "directory"):
        t.add_column(col, justify="right" if col == "size" else "left")
    for f in going:
        t.add_row(clean(time.strftime("%Y-%m-%d %H:%M", time.localtime(f.last_write))), f.kind,
                  clean(f.status), _mb(f.size), clean(f.path))
    console.print(t)
    total = sum(f.size for f in going)
    if not args.yes:
        console.print(clean(f"would remove {len(going)} run(s), {_mb(total)}; run again with --yes "
                            "to remove them"))
        return 0
    for f in going:
        shutil.rmtree(f.path)
        prune_empty_parents(os.path.dirname(f.path), root)
    console.print(clean(f"removed {len(going)} run(s), {_mb(total)}; checkpoints on tiers outside the run "
                        "directories are kept (slurmkit store gc prunes them)"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
