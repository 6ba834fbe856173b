"""The report's pictures: matplotlib on the Agg backend (no display, no network), PNG bytes out.

Each function takes the loaded run (``slurmkit.report.run.RunData``) and returns the PNG, so
the caller decides where it goes (a file next to report.html and a data URI inside it).
Times on the x axis are seconds since the run's first ledger event (its submission).
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import matplotlib

matplotlib.use("Agg")  # before pyplot: never look for a display

import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from slurmkit.ledger.names import (ALLOCATION_START, CKPT_DURABLE, CKPT_FAILED,  # noqa: E402
                                   CKPT_RESTORED, CKPT_SAVED, DECISION, END, REQUEUE, TRAIN_STARTED)
from slurmkit.ledger.summary import percent  # noqa: E402
from slurmkit.report.breakdown import LABELS, partition, spans  # noqa: E402
from slurmkit.report.model import goodput  # noqa: E402
from slurmkit.report.run import RunData, stretches  # noqa: E402

COLORS = {"productive": "#2e7d32", "lost": "#c62828", "queue": "#9e9e9e", "detection": "#f9a825",
          "restart": "#ef6c00", "restore": "#6a1b9a", "startup": "#1565c0", "other": "#cfd8dc"}
CLASS_MARKERS = ["X", "P", "D", "v", "^", "s", "*", "h", "<", ">"]
CLASS_COLORS = ["#b71c1c", "#4a148c", "#e65100", "#1a237e", "#004d40", "#880e4f", "#3e2723"]
ACTION_MARKERS = {"restart": ("o", "#ef6c00"), "replace_node": ("s", "#00838f"),
                  "requeue": ("^", "#5d4037"), "stop": ("x", "#000000")}
TIER_ORDER = ("nvme", "buddy", "scratch", "lustre", "object")
# The timeline's text, in points: report.html shows it at the page's full width (a sweep too: one
# variant per row), at about 1.5 px a point (dpi 110), so 9 pt stays ~13 px on screen
TIMELINE_TEXT_PT = 9
TIMELINE_LABEL_PT = 11


def png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def _rel(data: RunData, t: float) -> float:
    return t - data.report.start


def _of(data: RunData, *names: str) -> list[dict[str, Any]]:
    return [e for e in data.events if e.get("event") in names]


def _tiers(data: RunData) -> list[str]:
    found = {str(e.get("tier")) for e in _of(data, CKPT_SAVED, CKPT_DURABLE, CKPT_RESTORED)
             if e.get("tier")}
    return sorted(found, key=lambda t: (TIER_ORDER.index(t) if t in TIER_ORDER else 99, t))


def class_style(classes: Sequence[str]) -> dict[str, tuple[str, str]]:
    return {c: (CLASS_MARKERS[i % len(CLASS_MARKERS)], CLASS_COLORS[i % len(CLASS_COLORS)])
            for i, c in enumerate(sorted(set(classes)))}


def _bars(ax: Any, y: float, items: Sequence[tuple[float, float, str, str]],
          fontsize: float = TIMELINE_TEXT_PT) -> None:
    """(start, end, colour, text) bars in one lane."""
    for a, b, color, text in items:
        ax.barh(y, b - a, left=a, height=0.6, color=color, edgecolor="white", linewidth=0.5)
        if text:
            ax.text(a + (b - a) / 2, y, text, ha="center", va="center", fontsize=fontsize, color="white")


def timeline(data: RunData) -> bytes:
    """Lanes: allocations, generations, where the time went, failures, decisions, tiers."""
    tiers = _tiers(data)
    lanes = ["allocations", "generations", "time", "failures", "decisions", *[f"ckpt {t}" for t in tiers]]
    y = {name: len(lanes) - 1 - i for i, name in enumerate(lanes)}
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.65 * len(lanes)))
    end = _rel(data, data.report.start + data.report.wall_s)

    allocs = _of(data, ALLOCATION_START)
    items = []
    for i, e in enumerate(allocs):
        stop = next((float(x["t"]) for x in data.events if float(x["t"]) > float(e["t"])
                     and x.get("event") in (REQUEUE, END, ALLOCATION_START)), data.report.start + data.report.wall_s)
        spare = f", {len(e.get('spares') or [])} spare" if e.get("spares") else ""
        items.append((_rel(data, float(e["t"])), _rel(data, stop), "#455a64",
                      f"{e.get('attempt', i)}: {len(e.get('nodes') or [])} nodes{spare}"))
    _bars(ax, y["allocations"], items)

    gens = [e for e in _of(data, TRAIN_STARTED)]
    items = []
    for i, e in enumerate(gens):
        stop = float(gens[i + 1]["t"]) if i + 1 < len(gens) else data.report.start + data.report.wall_s
        items.append((_rel(data, float(e["t"])), _rel(data, stop), ("#78909c", "#90a4ae")[i % 2],
                      f"g{e.get('generation', '?')} from {e.get('step', 0)}"))
    _bars(ax, y["generations"], items)

    parts = partition(spans(data.events), data.report.start, data.report.start + data.report.wall_s)
    _bars(ax, y["time"], [(_rel(data, s.start), _rel(data, s.end), COLORS[s.label], "") for s in parts])

    styles = class_style([f.cls for f in data.report.failures])
    for f in data.report.failures:
        marker, color = styles[f.cls]
        where = f.node if f.rank < 0 else f"r{f.rank}@{f.node}"
        ax.scatter([_rel(data, f.fault_time)], [y["failures"]], marker=marker, color=color, s=90,
                   zorder=3, label=f"{f.cls}")
        ax.annotate(f"{f.cls}\n{where}", (_rel(data, f.fault_time), y["failures"]),
                    xytext=(0, 9), textcoords="offset points", ha="center", fontsize=TIMELINE_TEXT_PT)
    for e in _of(data, DECISION):
        marker, color = ACTION_MARKERS.get(str(e.get("action")), ("o", "#000000"))
        ax.scatter([_rel(data, float(e["t"]))], [y["decisions"]], marker=marker, color=color, s=50)
        ax.annotate(str(e.get("action")), (_rel(data, float(e["t"])), y["decisions"]),
                    xytext=(0, 7), textcoords="offset points", ha="center", fontsize=TIMELINE_TEXT_PT)
    for e in _of(data, REQUEUE):
        ax.axvline(_rel(data, float(e["t"])), color="#5d4037", linestyle="--", linewidth=0.8)
    for tier in tiers:
        lane = y[f"ckpt {tier}"]
        for name, marker, color in ((CKPT_SAVED, "|", "#1565c0"), (CKPT_DURABLE, "|", "#2e7d32"),
                                    (CKPT_RESTORED, "o", "#6a1b9a"), (CKPT_FAILED, "x", "#c62828")):
            ts = [_rel(data, float(e["t"])) for e in _of(data, name) if e.get("tier") == tier]
            if ts:
                ax.scatter(ts, [lane] * len(ts), marker=marker, color=color, s=80 if marker == "|" else 40,
                           label=name.replace("ckpt_", "checkpoint "))
    ax.set_yticks(list(y.values()), list(y.keys()))
    ax.tick_params(labelsize=TIMELINE_LABEL_PT)
    ax.set_xlim(0, max(end, 1.0))
    ax.set_ylim(-0.7, len(lanes) - 0.2)
    ax.set_xlabel("seconds since submission", fontsize=TIMELINE_LABEL_PT)
    ax.set_title(f"{data.name}: timeline", fontsize=TIMELINE_LABEL_PT + 2)
    handles, labels = ax.get_legend_handles_labels()
    uniq = dict(zip(labels, handles))
    for label in LABELS:
        if any(s.label == label for s in parts):
            uniq[label] = plt.Rectangle((0, 0), 1, 1, color=COLORS[label])
    ax.legend(uniq.values(), uniq.keys(), loc="upper left", bbox_to_anchor=(1.01, 1.0),
              fontsize=TIMELINE_TEXT_PT)
    ax.grid(axis="x", alpha=0.3)
    return png(fig)


def curves(data: RunData) -> bytes:
    """Loss and tokens/s over steps; each stretch of training (generation) its own colour, so
    recomputed steps after a restart show as a second line over the same steps."""
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 5.5), sharex=True)
    runs = stretches(data.metrics)
    for i, part in enumerate(runs):
        steps = [int(m["step"]) for m in part]
        top.plot(steps, [float(m.get("loss", float("nan"))) for m in part], linewidth=1.2,
                 label=f"stretch {i} (from step {steps[0] - 1})")
        bottom.plot(steps, [float(m.get("tokens_per_s", 0.0)) for m in part], linewidth=1.0)
    if not runs:
        top.text(0.5, 0.5, "no metrics.jsonl in the run directory", ha="center", transform=top.transAxes)
    top.set_ylabel("loss")
    bottom.set_ylabel("tokens / s")
    bottom.set_xlabel("step")
    top.set_title(f"{data.name}: loss and throughput")
    if runs:
        top.legend(fontsize=7)
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    return png(fig)


def goodput_bar(runs: Sequence[RunData]) -> bytes:
    """Where the wall time went, one stacked bar per run (a sweep: one per variant)."""
    fig, ax = plt.subplots(figsize=(10, 0.9 + 0.6 * len(runs)))
    for i, data in enumerate(runs):
        left = 0.0
        for label in LABELS:
            width = data.breakdown[label]
            if width <= 0:
                continue
            ax.barh(i, width, left=left, color=COLORS[label], label=label if i == 0 else None,
                    edgecolor="white", linewidth=0.5)
            if width / max(data.report.wall_s, 1e-9) > 0.06:
                ax.text(left + width / 2, i, f"{width:.0f}s", ha="center", va="center", fontsize=7,
                        color="white")
            left += width
    ax.set_yticks(range(len(runs)), [f"{d.name}\ngoodput {percent(d.report.goodput)}" for d in runs])
    ax.invert_yaxis()
    ax.set_xlabel("seconds of wall time")
    ax.set_title("goodput breakdown")
    handles, labels = ax.get_legend_handles_labels()
    for label in LABELS:  # every label in the legend, also those no run has
        if label not in labels:
            handles.append(plt.Rectangle((0, 0), 1, 1, color=COLORS[label]))
            labels.append(label)
    ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)
    return png(fig)


def saves(data: RunData) -> bytes:
    """Training blocked per save (and the background write time rank 0 reported)."""
    fig, ax = plt.subplots(figsize=(10, 3.2))
    rows = data.saves
    xs = list(range(len(rows)))
    ax.bar([x - 0.2 for x in xs], [r["blocking_s"] or 0.0 for r in rows], width=0.4,
           color="#c62828", label="training blocked (metrics.jsonl)")
    ax.bar([x + 0.2 for x in xs], [r["write_s"] or 0.0 for r in rows], width=0.4,
           color="#90caf9", label="background write (ledger ckpt_saved)")
    ax.set_xticks(xs, [f"{r['step']}\n{r['tier']}" for r in rows], fontsize=7)
    ax.set_xlabel("save (step, tier)")
    ax.set_ylabel("seconds")
    ax.set_title(f"{data.name}: checkpoint cost per save")
    if not rows:
        ax.text(0.5, 0.5, "no checkpoint saves", ha="center", transform=ax.transAxes)
    else:
        ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)
    return png(fig)


def advice(data: RunData) -> bytes | None:
    """The model's goodput over the checkpoint interval, with the compared intervals marked."""
    if data.advice is None:
        return None
    a = data.advice
    hi = max(o.interval_steps for o in a.options) * 1.5
    steps = [hi ** (i / 400) for i in range(401)]  # 1 .. hi, evenly on the log axis
    fig, ax = plt.subplots(figsize=(10, 3.5))
    ax.plot(steps, [goodput(s * a.figures.step_s, a.figures) for s in steps], color="#37474f")
    for i, o in enumerate(a.options):
        ax.scatter([o.interval_steps], [o.goodput], zorder=3, color="#2e7d32" if "Daly" in o.label.split(", ")
                   else "#c62828" if "current" in o.label else "#1565c0")
        ax.annotate(f"{o.label}\n{o.interval_steps} steps, {o.goodput:.1%}", (o.interval_steps, o.goodput),
                    xytext=(0, 10 if i % 2 == 0 else -12), textcoords="offset points", ha="center",
                    va="bottom" if i % 2 == 0 else "top", fontsize=7,
                    bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": "none", "alpha": 0.85})
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_xlim(0.8, hi)
    ax.margins(y=0.35)
    ax.set_xlabel("checkpoint interval (steps, log scale)")
    ax.set_ylabel("model goodput")
    ax.set_title("goodput model over the checkpoint interval (Daly 2006)")
    ax.grid(alpha=0.3)
    return png(fig)


def loss_overlay(runs: Sequence[RunData]) -> bytes:
    """A sweep's loss curves on one axis (each variant's last value per step)."""
    fig, ax = plt.subplots(figsize=(10, 4))
    for data in runs:
        last: dict[int, float] = {}
        for m in data.metrics:
            last[int(m.get("step", 0))] = float(m.get("loss", float("nan")))
        if last:
            xs = sorted(last)
            ax.plot(xs, [last[x] for x in xs], label=data.name, linewidth=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("loss per variant")
    ax.grid(alpha=0.3)
    if any(d.metrics for d in runs):
        ax.legend(fontsize=7)
    return png(fig)
