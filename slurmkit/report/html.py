"""report.html: one self-contained page (PNG data URIs, inline CSS, no script, no network).

The markup is Jinja2 templates (slurmkit/report/templates/: ``base.html.j2`` the page with its
Content-Security-Policy and CSS, ``run.html.j2`` and ``sweep.html.j2`` the two pages,
``parts.html.j2`` the sections both use) rendered with autoescape on: every value from the run
directory (ledger fields, log lines, config values, overrides, node names) is text, escaped by
the engine, never marked safe. This module only turns the loaded run into strings and rows; it
writes no markup. The one value passed as :class:`markupsafe.Markup` is the supervise figures'
JSON (``<script type="application/json" id="supervise-figures">``, data, never executed), built
with "<" as \\u003c so nothing in it can close the element; a reader or a test can compare it
with ``python -m slurmkit.supervise RUN_DIR --json``. PNGs are data URIs (base64: nothing to
escape).
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import json
import math
import os
import shlex
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jinja2
from markupsafe import Markup

from slurmkit.ledger.summary import LINE_CHARS, FailureReport, RunReport, percent
from slurmkit.report.breakdown import LABELS
from slurmkit.report.figures import COLORS
from slurmkit.report.model import __doc__ as MODEL_DOC
from slurmkit.report.run import MTBF_MIN_FAILURES, Header, RunData
from slurmkit.untrusted import safe_line

TEMPLATE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "templates")  # package data


@functools.lru_cache(maxsize=1)
def environment() -> jinja2.Environment:
    """The report's templates, HTML-escaping every ``{{ value }}`` (autoescape on), failing on an
    undefined name instead of printing nothing."""
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATE_DIR),
        autoescape=True,  # every template is HTML
        undefined=jinja2.StrictUndefined,
        trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True,
    )
    env.tests["numeric"] = _numeric  # a table cell that is a number: right-aligned
    return env


def render(name: str, **context: Any) -> str:
    return environment().get_template(name).render(**context)


@dataclass(frozen=True)
class Row:
    cells: Sequence[str]
    attrs: Mapping[str, str] = field(default_factory=dict)  # attributes of the <tr>


def data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def picture(png: bytes | None, alt: str) -> dict[str, str] | None:
    """An <img> for the templates (parts.html.j2's ``img``); None draws nothing."""
    return None if png is None else {"src": data_uri(png), "alt": alt}


def _s(seconds: float | None) -> str:  # the formats of python -m slurmkit.supervise
    return "-" if seconds is None else f"{seconds:.1f} s"


def _f(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.1f}"


def _n(value: int | None) -> str:
    return "-" if value is None else str(value)


def _numeric(cell: Any) -> bool:
    cell = str(cell)
    return bool(cell) and (cell[0].isdigit() or cell[0] == "-" and cell[1:2].isdigit())


def utc(t: float | None) -> str:
    """Epoch seconds as the header shows them: "2026-12-07 14:58 UTC"; "-" when unknown."""
    return "-" if t is None else time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t))


def duration(seconds: float) -> str:
    """46 s, 12 min, 3.2 h: a span as a reader says it."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _words(items: Sequence[str] | None, empty: str) -> str:
    """A command line as one would type it; "-" when unknown, ``empty`` for a known empty list."""
    if items is None:
        return "-"
    return shlex.join(items) if items else empty


def header_rows(h: Header | None) -> list[Row]:
    """The run page's header, one (name, value) row each; "-" where the run's files do not say."""
    if h is None:
        return []
    rows = [Row(["job" if len(h.jobs) <= 1 else "jobs", ", ".join(h.jobs) or "-"], {"data-field": "jobs"})]
    if h.resumes:
        rows.append(Row(["resumes", ", ".join(f"job {j}" for j in h.resumes) + " (slurmkit resume)"],
                        {"data-field": "resumes"}))
    rows += [Row(["command", _words(h.command, "-")], {"data-field": "command"}),
             Row(["overrides", _words(h.overrides, "none given")], {"data-field": "overrides"}),
             Row(["commit", h.commit or "-"], {"data-field": "commit"}),
             Row(["hosts" if len(h.hosts) != 1 else "host", ", ".join(h.hosts) or "-"], {"data-field": "hosts"}),
             Row(["submitted", utc(h.submitted)], {"data-field": "submitted"}),
             Row(["ended", utc(h.ended)], {"data-field": "ended"})]
    return rows


def cards(r: RunReport) -> list[dict[str, str]]:
    items = [("goodput", percent(r.goodput), r.goodput), ("wall time", _s(r.wall_s), r.wall_s),
             ("productive", _s(r.productive_s), r.productive_s),
             ("failures", str(len(r.failures)), len(r.failures)),
             ("steps lost", _n(r.steps_lost), r.steps_lost),
             ("final step", _n(r.final_step), r.final_step)]
    return [{"name": k, "text": text, "value": json.dumps(v)} for k, text, v in items]


def summary(r: RunReport) -> list[Row]:
    by_class = ", ".join(f"{c} {n}" for c, n in sorted(r.failures_by_class.items())) or "none"
    rows = [("status", r.status), ("wall time", _s(r.wall_s)), ("productive", _s(r.productive_s)),
            ("goodput", percent(r.goodput)), ("final step", _n(r.final_step)), ("failures", by_class),
            ("restarts", str(r.restarts)), ("node replacements", str(r.replacements)),
            ("requeues", str(r.requeues)), ("excluded nodes", ", ".join(r.excluded_nodes) or "none"),
            ("steps lost", _n(r.steps_lost))]
    return [Row(row) for row in rows]


def failures(start: float, fs: Sequence[FailureReport]) -> list[dict[str, Any]]:
    out = []
    for f in fs:
        where = f"rank {f.rank} on {f.node}" if f.rank >= 0 else f"node {f.node}"
        steps = "-" if f.fault_step is None else f"{f.fault_step} -> {_n(f.restored_step)}"
        out.append({
            "attrs": {"class": "failure", "data-class": f.cls, "data-rank": str(f.rank)},
            "cells": [f"{f.fault_time - start:.1f}" + ("*" if f.injected else ""), f.cls, where,
                      f.action or "-", _f(f.detection_s), _f(f.restart_s), _f(f.restore_s),
                      _f(f.resume_s), steps, _n(f.steps_lost)],
            "evidence": f.evidence[:160],
            # the failing rank's last telling line (a traceback's last line, "can't open file ..."):
            # untrusted, so control characters are shown escaped (and the template escapes markup)
            "said": safe_line(f.line[:LINE_CHARS]) if f.line else ""})
    return out


def breakdown_rows(d: RunData) -> list[dict[str, str]]:
    wall = d.report.wall_s or 1.0
    return [{"label": k, "color": COLORS[k], "seconds": f"{d.breakdown[k]:.1f}",
             "share": f"{d.breakdown[k] / wall:.1%}"} for k in LABELS]


def blocked_s(d: RunData) -> str:
    return f"{sum(s['blocking_s'] or 0.0 for s in d.saves):.1f}"


def mtbf_basis(d: RunData) -> tuple[str, bool]:
    """How many failures the advice's M rests on, in words, and whether that is too few to be a
    rate (fewer than MTBF_MIN_FAILURES: then the page says so and asks for --mtbf-h)."""
    a = d.advice
    assert a is not None
    if a.mtbf_failures is None:
        return (f"The mean time between failures is yours ({a.mtbf_source}), not this run's "
                "failures.", False)
    n, held = a.mtbf_failures, duration(a.mtbf_held_s or 0.0)
    said = f"{n} failure{'' if n == 1 else 's'} in {held} of run"
    if n < MTBF_MIN_FAILURES:
        return (f"This advice rests on {said}: the mean time between failures is a guess, not a "
                "rate; pass --mtbf-h with your site's figure (slurmkit report RUN_DIR --mtbf-h "
                "HOURS).", True)
    return f"This advice rests on {said} (nodes held).", False


def advice(d: RunData, png: bytes | None) -> dict[str, Any] | None:
    a = d.advice
    if a is None:
        return None
    f = a.figures
    current = next((o for o in a.options if "current" in o.label.split(", ")), None)
    basis, caveat = mtbf_basis(d)
    return {
        "recommended": a.recommended_steps, "daly": f"{a.daly_s:.1f}", "young": f"{a.young_s:.1f}",
        "basis": basis, "caveat": caveat, "failures": a.mtbf_failures,
        "figures": [
            Row(["C: training blocked per save", f"{f.save_s:.3f} s", "mean of ckpt_blocking_s in metrics.jsonl"]),
            Row(["M: mean time between failures", f"{f.mtbf_s:.1f} s ({f.mtbf_s / 3600:.3g} h)", a.mtbf_source]),
            Row(["R: recovery per failure", f"{f.recovery_s:.1f} s",
                 f"fault -> training again (restore s): {a.recovery_source}"]),
            Row(["step time", f"{f.step_s:.3f} s", "median step without a save"])],
        "options": [Row([o.label, str(o.interval_steps), f"{o.interval_s:.1f}", f"{o.goodput:.2%}"],
                        {"class": "rec"} if "Daly" in o.label.split(", ") else {}) for o in a.options],
        "current": None if current is None else f"{current.goodput:.1%}",
        "measured": percent(d.report.goodput), "picture": picture(png, "model goodput over the interval"),
        "model_doc": MODEL_DOC or ""}


def cost(d: RunData) -> list[Row] | None:
    c = d.cost
    if c is None:
        return None
    mtok = "-" if c.useful_tokens <= 0 else f"{c.per_million_tokens:.4g}"
    return [Row(r) for r in [
        ["price (cluster.gpu_hour_cost)", f"{c.gpu_hour_cost:g} per GPU-hour"],
        ["GPU-hours allocated (every node of every allocation, spares included)", f"{c.gpu_hours:.4g}"],
        ["useful GPU-hours (productive time x training GPUs)", f"{c.useful_gpu_hours:.4g}"],
        ["cost of the run", f"{c.total:.4g}"],
        ["cost per useful GPU-hour", f"{c.per_useful_gpu_hour:.4g}"],
        ["useful tokens", str(c.useful_tokens)], ["cost per million useful tokens", mtok]]]


def saves(d: RunData) -> dict[str, str] | None:
    blocked = [s["blocking_s"] for s in d.saves if s["blocking_s"] is not None]
    if not blocked:
        return None
    return {"count": str(len(d.saves)), "mean": f"{sum(blocked) / len(blocked):.3f}",
            "max": f"{max(blocked):.3f}"}


def figures_json(r: RunReport) -> Markup:
    # "<" as \u003c: nothing from a log line can close or reopen the script element. The one
    # Markup of the page: JSON inside <script> is not HTML, escaping it would change the data.
    return Markup(json.dumps(dataclasses.asdict(r)).replace("<", "\\u003c"))


def run_view(d: RunData, pngs: Mapping[str, bytes | None]) -> dict[str, Any]:
    """Everything parts.html.j2 shows of one run (a run page, or one variant of a sweep)."""
    r = d.report
    return {
        "name": d.name, "run_dir": d.run_dir, "status": r.status, "header": header_rows(d.header),
        "cards": cards(r), "summary": summary(r), "failures": failures(r.start, r.failures),
        "breakdown": breakdown_rows(d), "blocked_s": blocked_s(d), "saves": saves(d),
        "advice": advice(d, pngs.get("advice")), "cost": cost(d), "notes": list(d.notes),
        "timeline": picture(pngs.get("timeline"), "timeline"),
        "goodput": picture(pngs.get("goodput"), "goodput breakdown"),
        "curves": picture(pngs.get("curves"), "loss and tokens per second"),
        "saves_png": picture(pngs.get("saves"), "checkpoint blocking per save")}


def run_page(d: RunData, pngs: Mapping[str, bytes | None]) -> str:
    return render("run.html.j2", title=f"{d.name}: run report", run=run_view(d, pngs),
                  figures_json=figures_json(d.report))


@dataclass(frozen=True)
class SweepVariant:
    index: int
    overrides: list[str]  # what sets it apart (sweep.json)
    run: RunData | None  # None: no ledger yet (not started)


@dataclass(frozen=True)
class SweepHead:
    name: str
    job_id: str | None
    array: str
    variants: list[SweepVariant]
    common_overrides: list[str] = field(default_factory=list)


def final_loss(d: RunData) -> float | None:
    """The loss of the newest metrics row that has one (recomputed steps: the last written)."""
    for m in reversed(d.metrics):
        loss = m.get("loss")
        if isinstance(loss, (int, float)) and not isinstance(loss, bool) and math.isfinite(loss):
            return float(loss)
    return None


def variant_row(v: SweepVariant) -> Row:
    attrs = {"class": "variant", "data-index": str(v.index)}
    if v.run is None:
        return Row([str(v.index), _words(v.overrides, "defaults"), "not started", "-", "-", "-", "-"], attrs)
    r, loss = v.run.report, final_loss(v.run)
    return Row([str(v.index), _words(v.overrides, "defaults"), r.status, _n(r.final_step),
                "-" if loss is None else f"{loss:.4g}", percent(r.goodput), _n(r.steps_lost)], attrs)


def sweep_page(sweep: SweepHead, runs: Sequence[RunData],
               pngs: Sequence[Mapping[str, bytes | None]], shared: Mapping[str, bytes | None]) -> str:
    """``runs`` and ``pngs``: the variants that started, in order (those of sweep.variants with a run)."""
    views = [run_view(d, p) for d, p in zip(runs, pngs)]
    waiting = [f"{v.index}: {' '.join(v.overrides) or 'defaults'}" for v in sweep.variants if v.run is None]
    return render("sweep.html.j2", title=f"sweep {sweep.name}: report", sweep=sweep, runs=views,
                  waiting=waiting, variants=[variant_row(v) for v in sweep.variants],
                  common=_words(sweep.common_overrides, "none"),
                  goodput=picture(shared.get("goodput"), "goodput per variant"),
                  loss=picture(shared.get("loss"), "loss per variant"),
                  columns=max(1, len(runs)))
