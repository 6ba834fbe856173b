"""``python -m slurmkit.plan +exp=llama70b cluster=dgx_h100``: the memory plan, before submit.

Composes the config exactly as submit does, estimates memory per device for the layout and
prints it as a table. Exit 0 when the layout fits, 2 (with the Detected/Requirement/Fix
message) when it does not or cannot work.
"""

from __future__ import annotations

import os
import sys

from rich.console import Console
from rich.table import Table

from slurmkit.config.compose import compose
from slurmkit.errors import ConfigError, print_error
from slurmkit.train.planner import MemoryEstimate, check_config, estimate_on, hardware_of


def host_mem_gb() -> float:
    """This machine's memory (a local run's ranks share it)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9


def render(est: MemoryEstimate, title: str) -> Table:
    table = Table(title=title, show_header=True, header_style="bold")
    table.add_column("item")
    table.add_column("per device", justify="right")
    for label, value in est.rows():
        style = "red" if label == "fits" and not est.fits else None
        table.add_row(label, value, style=style)
    return table


def main(argv: list[str] | None = None, console: Console | None = None) -> int:
    overrides = list(sys.argv[1:] if argv is None else argv)
    console = console or Console()
    try:
        cfg = compose(overrides)
    except ConfigError as exc:
        print_error(console, exc, "configuration error")
        return 2
    title = f"slurmkit plan: {cfg.model.name} on {cfg.cluster.name}"
    try:
        est = check_config(cfg, host_mem_gb=host_mem_gb())
    except ConfigError as exc:
        try:  # show the numbers that failed, when the layout itself is possible
            hw = hardware_of(cfg, host_mem_gb=host_mem_gb())
            console.print(render(estimate_on(cfg.model, cfg.parallel, cfg.train, hw), title))
        except ConfigError:
            pass  # the layout is impossible: the message below says why
        print_error(console, exc, "configuration error")
        return 2
    console.print(render(est, title))
    return 0


if __name__ == "__main__":
    sys.exit(main())
