"""``python -m slurmkit.report RUN_DIR|SWEEP_DIR [--out DIR] [--mtbf-h H]`` (= ``slurmkit report``).

Writes report.html (self-contained: open it from anywhere, offline) and the PNGs it embeds into
the run directory, or into ``--out``. ``--mtbf-h`` gives the mean time between failures, in
hours, for the checkpoint-interval advice instead of this run's own failure rate. Prints the
path of the report. Exit 2 when the directory holds no ledger (or no valid sweep.json).
"""

from __future__ import annotations

import argparse
import sys

from rich.console import Console

from slurmkit.errors import SlurmkitError, print_error
from slurmkit.report.write import write


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from exc
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of hours, not {text}")
    return value


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m slurmkit.report",
                                     description="An HTML report with plots of a run or a sweep.")
    parser.add_argument("path", help="a run directory (ledger.jsonl) or a sweep directory (sweep.json)")
    parser.add_argument("--out", help="where to write report.html and the PNGs (default: the directory)")
    parser.add_argument("--mtbf-h", type=_positive, default=None,
                        help="mean time between failures in hours for the interval advice "
                             "(default: this run's failure rate)")
    return parser.parse_args(argv)


def main(argv: list[str], out: Console | None = None) -> int:
    args = _parse(argv)
    console = out or Console()
    try:
        paths = write(args.path, args.out, args.mtbf_h)
    except SlurmkitError as exc:
        print_error(Console(stderr=True), exc)
        return 2
    console.print(f"report: {paths[0]}", markup=False, highlight=False, soft_wrap=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
