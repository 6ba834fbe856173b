"""Write report.html and its PNGs for a run directory or a sweep directory.

A run: ``timeline.png``, ``curves.png`` (loss, tokens/s), ``goodput.png``, ``saves.png`` and,
when there is advice, ``advice.png``. A sweep: the same per variant as ``v<index>-<name>.png``
plus ``goodput.png`` and ``loss.png`` with every variant on one axis. Files are written to a
temporary name and renamed, so a browser never shows half a report.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

from slurmkit.atomic import atomic_write
from slurmkit.report import figures
from slurmkit.report.html import SweepHead, SweepVariant, run_page, sweep_page
from slurmkit.report.run import RunData, load_run
from slurmkit.runfiles import LEDGER_NAME, REPORT_NAME, SWEEP_NAME



def _put(path: str, content: bytes) -> None:
    atomic_write(path, content, mode=None)


def run_pngs(data: RunData) -> dict[str, bytes | None]:
    makers: dict[str, Callable[[RunData], bytes | None]] = {
        "timeline": figures.timeline, "curves": figures.curves, "saves": figures.saves,
        "advice": figures.advice, "goodput": lambda d: figures.goodput_bar([d])}
    return {name: make(data) for name, make in makers.items()}


def _save_pngs(out: str, pngs: Mapping[str, bytes | None], prefix: str = "") -> list[str]:
    written = []
    for name, content in pngs.items():
        if content is not None:
            path = os.path.join(out, f"{prefix}{name}.png")
            _put(path, content)
            written.append(path)
    return written


def write_run(run_dir: str, out: str | None = None, mtbf_h: float | None = None) -> list[str]:
    """Report one run; returns the paths written, report.html first."""
    data = load_run(run_dir, mtbf_h)
    out = out or run_dir
    os.makedirs(out, exist_ok=True)
    pngs = run_pngs(data)
    html = os.path.join(out, REPORT_NAME)
    written = _save_pngs(out, pngs)
    _put(html, run_page(data, pngs).encode("utf-8"))
    return [html, *written]


def write_sweep(sweep_dir: str, out: str | None = None, mtbf_h: float | None = None) -> list[str]:
    """Report every variant of a sweep: a table of them, then each one's figures (variants without a
    ledger yet are in the table and noted)."""
    from slurmkit.sweepdir import load_sweep  # checks every run_dir is <sweep_dir>/<index>

    sweep = load_sweep(sweep_dir)
    out = out or sweep.sweep_dir
    os.makedirs(out, exist_ok=True)
    runs: list[RunData] = []
    variants = []
    for v in sweep.variants:
        if not os.path.isfile(os.path.join(v.run_dir, LEDGER_NAME)):
            variants.append(SweepVariant(v.index, list(v.overrides), None))
            continue  # not started yet: nothing to draw
        data = load_run(v.run_dir, mtbf_h)
        data.name = f"{v.index}: {' '.join(v.overrides) or 'defaults'}"
        runs.append(data)
        variants.append(SweepVariant(v.index, list(v.overrides), data))
    per = [run_pngs(d) for d in runs]
    shared = {"goodput": figures.goodput_bar(runs), "loss": figures.loss_overlay(runs)}
    written = _save_pngs(out, shared)
    for v_png, d in zip(per, runs):
        written += _save_pngs(out, v_png, prefix=f"v{d.name.split(':')[0]}-")
    html = os.path.join(out, REPORT_NAME)
    head = SweepHead(sweep.name, sweep.job_id, sweep.array, variants, list(sweep.common_overrides))
    _put(html, sweep_page(head, runs, per, shared).encode("utf-8"))
    return [html, *written]


def write(path: str, out: str | None = None, mtbf_h: float | None = None) -> list[str]:
    """A sweep directory (holds sweep.json) or a run directory."""
    if os.path.isfile(os.path.join(path, SWEEP_NAME)):
        return write_sweep(path, out, mtbf_h)
    return write_run(path, out, mtbf_h)
