"""``python -m slurmkit.health``: run this node's pre-flight checks now and print them.

For an operator on a node (is this one fit to run the job?) and for a site's prolog. The
checks are those a run's agents would run: from a run directory's frozen config and layout
(``--run-dir``), or composed from the same overrides ``slurmkit.submit`` takes. Exit code: 0 fit,
1 a bad node, 2 waiting on a shared tier, 3 a configuration error.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from collections.abc import Sequence

from rich.console import Console
from rich.table import Table
from rich.text import Text

from slurmkit.errors import SlurmkitError, print_error
from slurmkit.health.preflight import build_checks
from slurmkit.health.result import CheckResult, Verdict, overall
from slurmkit.health.runner import run_checks
from slurmkit.runfiles import CONFIG_NAME

EXIT = {Verdict.OK: 0, Verdict.SKIPPED: 0, Verdict.BAD_NODE: 1, Verdict.WAIT: 2}
_STYLE = {Verdict.OK: "green", Verdict.SKIPPED: "dim", Verdict.BAD_NODE: "bold red", Verdict.WAIT: "yellow"}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m slurmkit.health", description=__doc__.split("\n\n")[0])
    p.add_argument("--run-dir", help="a run directory: its frozen config.yaml and layout.json")
    p.add_argument("--node", help="the node name the tiers are keyed by (default: SLURMD_NODENAME or the host name)")
    p.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    p.add_argument("overrides", nargs="*", help="config overrides as for slurmkit.submit (without --run-dir)")
    return p


def table(results: Sequence[CheckResult], node: str) -> Table:
    t = Table(title=f"pre-flight on {node}", title_justify="left")
    for col in ("check", "verdict", "seconds", "figures", "message"):
        t.add_column(col, overflow="fold")
    for r in results:
        figures = " ".join(f"{k}={v}" for k, v in r.figures.items() if k != "output")
        t.add_row(Text(r.name), Text(r.verdict.value, style=_STYLE[r.verdict]), f"{r.duration_s:.3f}",
                  Text(figures), Text(r.message))
    return t


def main(argv: Sequence[str] | None = None, env: dict[str, str] | None = None) -> int:
    args = _parser().parse_intermixed_args(argv)
    env = dict(os.environ) if env is None else env
    console = Console(highlight=False)
    node = args.node or env.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]
    try:
        if args.run_dir:
            from slurmkit.config import load_frozen
            from slurmkit.layout import load_layout

            run_dir = os.path.abspath(args.run_dir)
            cfg = load_frozen(os.path.join(run_dir, CONFIG_NAME))
            gpus = load_layout(run_dir, cfg).gpus_per_node
            env["SLURMKIT_RUN_DIR"] = run_dir
        else:
            from slurmkit.config import compose
            from slurmkit.layout import resolve_layout

            cfg = compose(list(args.overrides))
            gpus = resolve_layout(cfg).gpus_per_node
        checks = build_checks(cfg.health, cfg.store, gpus_planned=gpus, node=node, env=env)
    except SlurmkitError as exc:
        print_error(console, exc)
        return 3
    results = run_checks(checks)
    verdict = overall(results)
    if args.json:
        print(json.dumps({"node": node, "verdict": verdict.value, "checks": [r.to_json() for r in results]}))
    else:
        console.print(table(results, node))
        console.print(Text.assemble("verdict: ", (verdict.value, _STYLE[verdict])))
    return EXIT[verdict]


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
