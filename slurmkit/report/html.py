"""report.html: one self-contained page (PNG data URIs, inline CSS, no script, no network).

Every value that comes from the run directory (node names, evidence lines, overrides) is
HTML-escaped: a log line is untrusted input. The supervise figures are also embedded as JSON
(``<script type="application/json" id="supervise-figures">``, data, never executed) so a
reader or a test can compare them with ``python -m slurmkit.supervise RUN_DIR --json``.
"""

from __future__ import annotations

import base64
import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from html import escape

from slurmkit.ledger.summary import LINE_CHARS, FailureReport, RunReport, percent
from slurmkit.report.breakdown import LABELS
from slurmkit.report.figures import COLORS
from slurmkit.report.model import __doc__ as MODEL_DOC
from slurmkit.report.run import RunData
from slurmkit.untrusted import safe_line

CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 24px auto; max-width: 1280px; color: #212121; }
h1 { font-size: 22px; margin-bottom: 4px; } h2 { font-size: 17px; margin-top: 28px; }
.sub { color: #616161; margin-top: 0; }
table { border-collapse: collapse; margin: 8px 0; } td, th { border: 1px solid #ddd; padding: 3px 8px; }
th { background: #f5f5f5; text-align: left; } td.n { text-align: right; font-variant-numeric: tabular-nums; }
img { max-width: 100%; border: 1px solid #eee; }
.cards { display: flex; gap: 12px; flex-wrap: wrap; }
.card { border: 1px solid #ddd; border-radius: 6px; padding: 8px 14px; min-width: 120px; }
.card b { display: block; font-size: 20px; }
.swatch { display: inline-block; width: 10px; height: 10px; margin-right: 6px; }
.note { color: #8d6e63; } .rec { background: #e8f5e9; font-weight: bold; }
.variants { display: grid; gap: 12px; overflow-x: auto; }
.variants > div { min-width: 0; overflow-x: auto; }  /* a wide table scrolls inside its column */
pre { background: #fafafa; border: 1px solid #eee; padding: 8px; white-space: pre-wrap; }
"""


def data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def img(png: bytes | None, alt: str) -> str:
    return "" if png is None else f'<img src="{data_uri(png)}" alt="{escape(alt)}">'


def _s(seconds: float | None) -> str:  # the formats of python -m slurmkit.supervise
    return "-" if seconds is None else f"{seconds:.1f} s"


def _f(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.1f}"


def _n(value: int | None) -> str:
    return "-" if value is None else str(value)


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], row_attrs: Sequence[str] = ()) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    body = []
    for i, row in enumerate(rows):
        attrs = row_attrs[i] if i < len(row_attrs) else ""
        cells = "".join(f'<td class="n">{c}</td>' if _numeric(c) else f"<td>{c}</td>" for c in row)
        body.append(f"<tr{attrs}>{cells}</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def _numeric(cell: str) -> bool:
    return bool(cell) and (cell[0].isdigit() or cell[0] == "-" and cell[1:2].isdigit())


def cards(r: RunReport) -> str:
    items = [("goodput", percent(r.goodput), r.goodput), ("wall time", _s(r.wall_s), r.wall_s),
             ("productive", _s(r.productive_s), r.productive_s),
             ("failures", str(len(r.failures)), len(r.failures)),
             ("steps lost", _n(r.steps_lost), r.steps_lost),
             ("final step", _n(r.final_step), r.final_step)]
    return '<div class="cards">' + "".join(
        f'<div class="card">{escape(k)}<b data-figure="{escape(k)}" data-value="{escape(json.dumps(v))}">'
        f"{escape(text)}</b></div>" for k, text, v in items) + "</div>"


def summary(r: RunReport) -> str:
    by_class = ", ".join(f"{c} {n}" for c, n in sorted(r.failures_by_class.items())) or "none"
    rows = [("status", r.status), ("wall time", _s(r.wall_s)), ("productive", _s(r.productive_s)),
            ("goodput", percent(r.goodput)), ("final step", _n(r.final_step)), ("failures", by_class),
            ("restarts", str(r.restarts)), ("node replacements", str(r.replacements)),
            ("requeues", str(r.requeues)), ("excluded nodes", ", ".join(r.excluded_nodes) or "none"),
            ("steps lost", _n(r.steps_lost))]
    return _table(["figure", "value"], [(escape(k), escape(v)) for k, v in rows])


def failures(start: float, fs: Sequence[FailureReport]) -> str:
    if not fs:
        return "<p>No failure.</p>"
    rows, attrs = [], []
    for f in fs:
        where = f"rank {f.rank} on {f.node}" if f.rank >= 0 else f"node {f.node}"
        steps = "-" if f.fault_step is None else f"{f.fault_step} -> {_n(f.restored_step)}"
        rows.append([f"{f.fault_time - start:.1f}" + ("*" if f.injected else ""), escape(f.cls),
                     escape(where), escape(f.action or "-"), _f(f.detection_s), _f(f.restart_s),
                     _f(f.restore_s), _f(f.resume_s), escape(steps), _n(f.steps_lost),
                     escape(f.evidence[:160]) + _last_line(f.line)])
        attrs.append(f' class="failure" data-class="{escape(f.cls)}" data-rank="{f.rank}"')
    return _table(["fault +s", "class", "root cause", "action", "detect s", "restart s", "restore s",
                   "resume s", "steps", "lost", "evidence"], rows, attrs) + \
        "<p class=sub>Seconds from the fault; * = fault time recorded by the injector, else the " \
        "classifier's estimate.</p>"


def _last_line(line: str) -> str:
    """The failing rank's last telling line under the evidence (a traceback's last line, "can't
    open file ..."): untrusted, so control characters are shown escaped and markup as text."""
    if not line:
        return ""
    return f'<br><span class="line">said: {escape(safe_line(line[:LINE_CHARS]))}</span>'


def breakdown_table(d: RunData) -> str:
    wall = d.report.wall_s or 1.0
    rows = [[f'<span class="swatch" style="background:{COLORS[k]}"></span>{escape(k)}',
             f"{d.breakdown[k]:.1f}", f"{d.breakdown[k] / wall:.1%}"] for k in LABELS]
    blocked = sum(s["blocking_s"] or 0.0 for s in d.saves)
    return _table(["where the time went", "seconds", "of wall"], rows) + (
        f"<p class=sub>Productive time includes {blocked:.1f} s of training blocked by checkpoint "
        "saves (shown per save below). Definitions: slurmkit/report/breakdown.py.</p>")


def advice(d: RunData, picture: bytes | None) -> str:
    a = d.advice
    if a is None:
        return "<p class=note>No advice: see the notes at the end.</p>"
    f = a.figures
    figs = _table(["model input", "value", "from"], [
        ["C: training blocked per save", f"{f.save_s:.3f} s", "mean of ckpt_blocking_s in metrics.jsonl"],
        ["M: mean time between failures", f"{f.mtbf_s:.1f} s ({f.mtbf_s / 3600:.3g} h)", escape(a.mtbf_source)],
        ["R: recovery per failure", f"{f.recovery_s:.1f} s",
         f"fault -> training again (restore s): {escape(a.recovery_source)}"],
        ["step time", f"{f.step_s:.3f} s", "median step without a save"]])
    rows, attrs = [], []
    for o in a.options:
        rows.append([escape(o.label), str(o.interval_steps), f"{o.interval_s:.1f}", f"{o.goodput:.2%}"])
        attrs.append(' class="rec"' if "Daly" in o.label.split(", ") else "")
    opts = _table(["interval", "steps", "seconds of compute", "model goodput"], rows, attrs)
    current = next((o for o in a.options if "current" in o.label.split(", ")), None)
    if current is not None:
        opts += (f"<p class=sub>At this run's interval the model gives {current.goodput:.1%}; the run "
                 f"measured {percent(d.report.goodput)} (the model leaves out the queue wait and the first "
                 "start, which no interval changes).</p>")
    return (f"<p>Recommended checkpoint interval: <b>train.ckpt_interval_steps={a.recommended_steps}</b> "
            f"(Daly {a.daly_s:.1f} s, Young sqrt(2CM) {a.young_s:.1f} s of compute).</p>"
            f"{figs}{opts}{img(picture, 'model goodput over the interval')}"
            f"<details><summary>The goodput model</summary><pre>{escape(MODEL_DOC or '')}</pre></details>")


def cost(d: RunData) -> str:
    c = d.cost
    if c is None:
        return "<p class=note>No cost figures: see the notes at the end.</p>"
    mtok = "-" if c.useful_tokens <= 0 else f"{c.per_million_tokens:.4g}"
    return _table(["figure", "value"], [
        ["price (cluster.gpu_hour_cost)", f"{c.gpu_hour_cost:g} per GPU-hour"],
        ["GPU-hours allocated (every node of every allocation, spares included)", f"{c.gpu_hours:.4g}"],
        ["useful GPU-hours (productive time x training GPUs)", f"{c.useful_gpu_hours:.4g}"],
        ["cost of the run", f"{c.total:.4g}"],
        ["cost per useful GPU-hour", f"{c.per_useful_gpu_hour:.4g}"],
        ["useful tokens", str(c.useful_tokens)], ["cost per million useful tokens", mtok]])


def saves_text(d: RunData) -> str:
    blocked = [s["blocking_s"] for s in d.saves if s["blocking_s"] is not None]
    if not blocked:
        return "<p class=note>No checkpoint blocking time recorded.</p>"
    return (f"<p>{len(d.saves)} saves; training blocked {sum(blocked) / len(blocked):.3f} s on average, "
            f"{max(blocked):.3f} s at most.</p>")


def notes(d: RunData) -> str:
    if not d.notes:
        return ""
    return "<h2>Not in this run's files</h2><ul>" + "".join(
        f"<li class=note>{escape(n)}</li>" for n in d.notes) + "</ul>"


def figures_json(r: RunReport) -> str:
    # "<" as \u003c: nothing from a log line can close or reopen a script element
    text = json.dumps(dataclasses.asdict(r)).replace("<", "\\u003c")
    return f'<script type="application/json" id="supervise-figures">{text}</script>'


def page(title: str, body: str) -> str:
    return ("<!DOCTYPE html>\n<html lang=en><head><meta charset=utf-8>"
            "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; "
            "img-src data:; style-src 'unsafe-inline'\">"
            f"<title>{escape(title)}</title><style>{CSS}</style></head><body>{body}</body></html>\n")


def run_page(d: RunData, pngs: Mapping[str, bytes | None]) -> str:
    r = d.report
    body = [f"<h1>{escape(d.name)}</h1><p class=sub>{escape(d.run_dir)} &middot; status "
            f"<b>{escape(r.status)}</b></p>", cards(r),
            '<section id="timeline"><h2>Timeline</h2>', img(pngs.get("timeline"), "timeline"),
            "<h3>Failures</h3>", failures(r.start, r.failures), "</section>",
            "<h2>Goodput</h2>", img(pngs.get("goodput"), "goodput breakdown"), breakdown_table(d),
            "<h2>Run summary</h2><p class=sub>The figures of <code>python -m slurmkit.supervise "
            "RUN_DIR</code>, computed by the same code.</p>", summary(r),
            "<h2>Loss and throughput</h2>", img(pngs.get("curves"), "loss and tokens per second"),
            "<h2>Checkpoints</h2>", saves_text(d), img(pngs.get("saves"), "checkpoint blocking per save"),
            "<h2>Checkpoint interval advice</h2>", advice(d, pngs.get("advice")),
            "<h2>Cost</h2>", cost(d), notes(d), figures_json(r)]
    return page(f"{d.name}: run report", "".join(body))


@dataclass(frozen=True)
class SweepHead:
    name: str
    job_id: str | None
    array: str
    waiting: list[str]  # variants without a ledger yet ("<index>: <overrides>")


def sweep_page(sweep: SweepHead, runs: Sequence[RunData],
               pngs: Sequence[Mapping[str, bytes | None]], shared: Mapping[str, bytes]) -> str:
    cols = f"grid-template-columns: repeat({max(1, len(runs))}, minmax(420px, 1fr))"

    def row(title: str, cell: Callable[[int, RunData], str]) -> str:
        return (f"<h2>{escape(title)}</h2><div class=variants style=\"{cols}\">"
                + "".join(f"<div>{cell(i, d)}</div>" for i, d in enumerate(runs)) + "</div>")

    body = [f"<h1>sweep {escape(sweep.name)}</h1><p class=sub>job {escape(sweep.job_id or '-')}"
            f" &middot; array {escape(sweep.array)} &middot; {len(runs)} variants</p>",
            "".join(f"<p class=note>variant {escape(w)}: no ledger yet (not started)</p>"
                    for w in sweep.waiting),
            "<h2>Goodput per variant</h2>", img(shared.get("goodput"), "goodput per variant"),
            "<h2>Loss per variant</h2>", img(shared.get("loss"), "loss per variant"),
            row("Variants", lambda i, d: f"<h3>{escape(d.name)}</h3>{cards(d.report)}{summary(d.report)}"),
            '<section id="timeline">', row("Timeline", lambda i, d: img(pngs[i].get("timeline"), "timeline")
                + failures(d.report.start, d.report.failures)), "</section>",
            row("Loss and throughput", lambda i, d: img(pngs[i].get("curves"), "curves")),
            row("Checkpoints", lambda i, d: saves_text(d) + img(pngs[i].get("saves"), "saves")),
            row("Checkpoint interval advice", lambda i, d: advice(d, pngs[i].get("advice"))),
            row("Cost", lambda i, d: cost(d) + notes(d))]
    return page(f"sweep {sweep.name}: report", "".join(body))
