"""``python -m slurmkit.store ls|verify|promote|gc <uri>...``: inspect and manage tiers.

A URI is a tier root (for the NVMe tier: one node's directory). S3 credentials come from the
environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, SLURMKIT_S3_ENDPOINT/AWS_ENDPOINT_URL).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Mapping, Sequence

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TaskID, TransferSpeedColumn
from rich.table import Table
from rich.text import Text

from slurmkit.errors import SlurmkitError, print_error
from slurmkit.store.catalog import StepStatus, check_step, list_steps
from slurmkit.store.promote import promote_step
from slurmkit.store.retention import gc_tier
from slurmkit.store.tier import FsspecTier, make_tier


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{int(size)} B"
        size /= 1024
    return f"{n} B"


def _tiers(uris: Sequence[str], env: Mapping[str, str]) -> list[FsspecTier]:
    return [make_tier(f"tier{i}", u, env) for i, u in enumerate(uris)]


def _progress(console: Console) -> Progress:
    return Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                    TransferSpeedColumn(), console=console, transient=True)


def status_table(tiers: Sequence[FsspecTier], deep: bool, console: Console) -> int:
    """One row per step: tiers holding it verified, size, and why a copy does not verify."""
    rows: dict[int, list[StepStatus]] = {}
    with _progress(console) as prog:
        for t in tiers:
            for s in list_steps(t):
                task = prog.add_task(f"{'verify' if deep else 'check'} {t.uri} step {s}")

                def advance(n: int, k: TaskID = task) -> None:
                    prog.advance(k, n)

                # (never raises: a hostile step is a row in red, not a traceback)
                st = check_step(t, s, deep=deep, on_bytes=advance, contents=deep)
                prog.remove_task(task)
                rows.setdefault(s, []).append(st)
    table = Table(title=f"checkpoints ({'checksums verified' if deep else 'sizes checked'})")
    for col in ("step", "verified on", "size", "status"):
        table.add_column(col, justify="right" if col in ("step", "size") else "left")
    bad = 0
    for step in sorted(rows, reverse=True):
        ok = [st.tier.uri for st in rows[step] if st.ok]
        problems = [f"{st.tier.uri}: {st.problem}" for st in rows[step] if not st.ok]
        size = next((st.manifest.total_bytes for st in rows[step] if st.manifest), 0)
        # Problems quote file names from the tier: literal text, never rich markup.
        status = Text("verified", "green") if not problems else Text("; ".join(problems), "red")
        bad += bool(problems)
        table.add_row(str(step), "\n".join(ok) or "-", _human(size), status)
    console.print(table)
    return 1 if bad and deep else 0


def promote(src: FsspecTier, dest: FsspecTier, step: int | None, console: Console) -> int:
    steps = [step] if step is not None else list_steps(src)
    for s in steps:
        st = check_step(src, s, deep=True)
        if st.ok and st.manifest is not None:
            m = st.manifest
            with _progress(console) as prog:
                task = prog.add_task(f"step {s} -> {dest.uri}", total=m.total_bytes)
                promote_step([src], dest, m, max_workers=4,
                             on_bytes=lambda n: prog.advance(task, n))
            console.print(f"step {s}: promoted {_human(m.total_bytes)} to {dest.uri}")
            return 0
        console.print(f"step {s} on {src.uri} does not verify: {st.problem}", markup=False)
    console.print(Text(f"no verified step to promote on {src.uri}", "red"))
    return 1


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m slurmkit.store", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("ls", help="list steps (manifest + sizes)").add_argument("uri", nargs="+")
    sub.add_parser("verify", help="check every checksum").add_argument("uri", nargs="+")
    pp = sub.add_parser("promote", help="copy the newest verified step: promote SRC DEST")
    pp.add_argument("uri", nargs=2)
    pp.add_argument("--step", type=int, default=None)
    pg = sub.add_parser("gc", help="keep the newest N verified steps per tier")
    pg.add_argument("uri", nargs="+")
    pg.add_argument("--keep", type=int, required=True)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    console = Console()
    try:
        tiers = _tiers(args.uri, env if env is not None else os.environ)
        if args.cmd in ("ls", "verify"):
            return status_table(tiers, args.cmd == "verify", console)
        if args.cmd == "promote":
            return promote(tiers[0], tiers[1], args.step, console)
        for t in tiers:
            deleted = gc_tier(t, max(1, args.keep), protected=set())
            console.print(f"{t.uri}: deleted steps {deleted or 'none'}")
        return 0
    except SlurmkitError as exc:
        print_error(console, exc)
        return 2


if __name__ == "__main__":
    sys.exit(main())
