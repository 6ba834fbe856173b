"""``python -m slurmkit.supervise [report] RUN_DIR [--json]``: a run's figures from its ledger.

Prints the summary (wall time, goodput, failures by class, restarts, requeues) and one row per
failure (detection latency, time to restart/restore/resume, steps lost) as rich tables, or the
same figures as JSON with ``--json``. Exit 2 when RUN_DIR has no ledger.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from rich.console import Console
from rich.table import Table

from slurmkit.errors import ConfigError, print_error
from slurmkit.ledger.ledger import LEDGER_NAME, read_ledger
from slurmkit.ledger.summary import FailureReport, RunReport, percent, summarize


def _parse(argv: list[str]) -> argparse.Namespace:
    if argv and argv[0] == "report":  # the subcommand is optional: report is the only one
        argv = argv[1:]
    parser = argparse.ArgumentParser(prog="python -m slurmkit.supervise [report]",
                                     description="Figures about a run from RUN_DIR/ledger.jsonl.")
    parser.add_argument("run_dir", help="the run directory (holds ledger.jsonl)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    return parser.parse_args(argv)


def load(run_dir: str) -> RunReport:
    path = os.path.join(run_dir, LEDGER_NAME)
    if not os.path.isfile(path):
        raise ConfigError(f"no {LEDGER_NAME} in {run_dir}",
                          "a run directory that slurmkit.submit created",
                          "pass the run directory printed at submit (e.g. runs/<name>/<stamp>)")
    return summarize(read_ledger(path))


def _s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.1f} s"


def _n(value: int | None) -> str:
    return "-" if value is None else str(value)


def summary_table(r: RunReport) -> Table:
    t = Table(title="run", show_header=False)
    t.add_column("figure", style="bold")
    t.add_column("value")
    by_class = ", ".join(f"{c} {n}" for c, n in sorted(r.failures_by_class.items())) or "none"
    rows = [("status", r.status), ("wall time", _s(r.wall_s)), ("productive", _s(r.productive_s)),
            ("goodput", percent(r.goodput)), ("final step", _n(r.final_step)),
            ("failures", by_class), ("restarts", str(r.restarts)),
            ("node replacements", str(r.replacements)), ("requeues", str(r.requeues)),
            ("excluded nodes", ", ".join(r.excluded_nodes) or "none"), ("steps lost", _n(r.steps_lost))]
    for name, value in rows:
        t.add_row(name, value)
    return t


def failures_table(r: RunReport) -> Table:
    """One row per failure; durations in seconds from the fault (column names carry the unit)."""
    t = Table(title="failures (seconds from the fault; * = injected fault time)")
    for col in ("fault +s", "class", "where", "action", "detect", "restart", "restore", "resume",
                "steps", "lost"):
        t.add_column(col, justify="left" if col in ("class", "where", "action") else "right")
    for f in r.failures:
        t.add_row(*_failure_row(r.start, f))
    return t


def _f(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.1f}"


def _failure_row(start: float, f: FailureReport) -> list[str]:
    where = f.node if f.rank < 0 else f"r{f.rank}@{f.node}"
    steps = "-" if f.fault_step is None else f"{f.fault_step}->{_n(f.restored_step)}"
    return [f"{f.fault_time - start:.1f}" + ("*" if f.injected else ""), f.cls, where,
            f.action or "-", _f(f.detection_s), _f(f.restart_s), _f(f.restore_s), _f(f.resume_s),
            steps, _n(f.steps_lost)]


def main(argv: list[str], out: Console | None = None) -> int:
    args = _parse(argv)
    # Piped output would be cut to 80 columns and wrap every cell of the failures table.
    console = out or (Console() if sys.stdout.isatty() else Console(width=140))
    try:
        report = load(args.run_dir)
    except ConfigError as exc:
        print_error(Console(stderr=True), exc)
        return 2
    if args.json:
        console.print_json(json.dumps(dataclasses.asdict(report)))
        return 0
    console.print(summary_table(report))
    if report.failures:
        console.print(failures_table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
