"""Everything the report shows about one run directory, read once.

Sources, all written by the run itself: ``ledger.jsonl`` (events: allocations, generations,
failures, decisions, requeues, checkpoints per tier), ``metrics.jsonl`` (rank 0, one line per
step: loss, tokens/s, step time, checkpoint blocking time) and the frozen ``config.yaml``
(interval, GPUs per node, ``cluster.gpu_hour_cost``). The goodput figures are
``slurmkit.ledger.summary.summarize`` over the ledger, the very code behind
``python -m slurmkit.supervise RUN_DIR``. A file that is missing is a note in the report,
never a made-up figure.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from slurmkit.errors import ConfigError
from slurmkit.ledger.ledger import LEDGER_NAME, read_ledger
from slurmkit.ledger.names import (ALLOCATION_START, CKPT_SAVED, END, REQUEUE, SUBMITTED, SUCCESSOR,
                                   TRAIN_STARTED)
from slurmkit.ledger.summary import RunReport, summarize
from slurmkit.report.breakdown import breakdown
from slurmkit.report.model import Advice, Figures, advise
from slurmkit.runfiles import CONFIG_NAME, LAYOUT_NAME, METRICS_NAME
from slurmkit.untrusted import UntrustedDataError, bounded_lines, parse_object

METRICS_LINE_BYTES = 64 * 1024  # one step's metrics line is ~300 bytes
# the fields the figures read as numbers (float(m[...])): anything else in them refuses the row
METRICS_NUMBERS = ("loss", "tokens_per_s", "step_time_s", "ckpt_blocking_s", "mfu")
# Below this many failures this run's own mean time between failures is a guess, not a rate: the
# advice says so and asks for --mtbf-h
MTBF_MIN_FAILURES = 3


@dataclass(frozen=True)
class Header:
    """Who and what the run was, from the ledger and the frozen config. ``None`` is unknown (an
    older ledger, a missing config.yaml): the page shows "-", never an empty or made-up value."""

    jobs: list[str]  # every job the run ran as: submitted events' job_id, then successors, in order
    command: list[str] | None  # the frozen config's job.command
    overrides: list[str] | None  # as given at submit (the newest submitted event's)
    commit: str | None  # the git commit submit ran from ("...-dirty": with uncommitted changes)
    resumes: list[str]  # the jobs `slurmkit resume` went on from
    hosts: list[str]  # every allocation's nodes, deduplicated, in order
    submitted: float | None  # epoch seconds of the first submitted event
    ended: float | None  # epoch seconds of the last end, None while the run goes on


@dataclass(frozen=True)
class Cost:
    gpu_hour_cost: float
    gpus_per_node: int
    gpu_hours: float  # allocated: every node of every allocation, spares included
    useful_gpu_hours: float  # productive time x the GPUs that trained
    useful_tokens: int
    total: float

    @property
    def per_useful_gpu_hour(self) -> float:
        return self.total / self.useful_gpu_hours if self.useful_gpu_hours > 0 else math.inf

    @property
    def per_million_tokens(self) -> float:
        return self.total / (self.useful_tokens / 1e6) if self.useful_tokens > 0 else math.inf


@dataclass
class RunData:
    run_dir: str
    name: str
    events: list[dict[str, Any]]
    report: RunReport
    breakdown: dict[str, float]
    metrics: list[dict[str, Any]]  # per step, in file order (recomputed steps appear again)
    config: dict[str, Any]
    saves: list[dict[str, Any]]  # per save: step, blocking_s (metrics), seconds/tier (ledger)
    advice: Advice | None
    cost: Cost | None
    notes: list[str] = field(default_factory=list)  # figures the run's files do not hold
    header: Header | None = None


def _jsonl(path: str, notes: list[str] | None = None) -> list[dict[str, Any]]:
    """The metrics rows of a JSONL file that rank 0 wrote: each a JSON object within
    slurmkit.untrusted's limits, with an integer ``step`` and numbers where the figures read
    numbers. A torn last line (writer killed mid-line) is skipped; other refused lines are
    counted in ``notes``, with the first one's reason."""
    out, refused = [], []
    with open(path, "rb") as f:
        for lineno, line in enumerate(bounded_lines(f, METRICS_LINE_BYTES), 1):
            if len(line) > METRICS_LINE_BYTES or not line.strip():
                refused += [f"line {lineno}: over {METRICS_LINE_BYTES} bytes"] if line.strip() else []
                continue
            try:
                row = parse_object(line, max_bytes=METRICS_LINE_BYTES)
            except UntrustedDataError as exc:
                refused.append(f"line {lineno}: {exc}")
                continue
            why = _metrics_problem(row)
            if why:
                refused.append(f"line {lineno}: {why}")
            else:
                out.append(row)
    if refused and notes is not None:
        notes.append(f"{len(refused)} line(s) of {path} skipped ({refused[0]})")
    return out


def _metrics_problem(row: Mapping[str, Any]) -> str:
    """Why a metrics row cannot be shown ("" when it can)."""
    step = row.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        return f"step={step!r:.40} is not a step"
    for name in METRICS_NUMBERS:
        value = row.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            return f"{name}={value!r:.40} is not a number"
    return ""


def _config(path: str) -> dict[str, Any]:
    from omegaconf import OmegaConf  # loads plain YAML: nothing in it is executed

    try:
        raw = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except Exception as exc:  # OmegaConf raises several kinds on hostile YAML
        raise ConfigError(f"cannot read {path}: {exc}", "the config.yaml submit froze",
                          "report a run directory slurmkit.submit created") from exc
    return {str(k): v for k, v in raw.items()} if isinstance(raw, dict) else {}


def _get(cfg: Mapping[str, Any], dotted: str, default: Any = None) -> Any:
    node: Any = cfg
    for key in dotted.split("."):
        if not isinstance(node, Mapping) or key not in node:
            return default
        node = node[key]
    return default if node is None else node


def _num(value: Any, default: float = 0.0) -> float:
    try:
        out = float(value)
    except (TypeError, ValueError):
        return default
    return out if math.isfinite(out) else default


def stretches(metrics: Sequence[Mapping[str, Any]]) -> list[list[Mapping[str, Any]]]:
    """metrics.jsonl cut where the step goes back: one stretch per start of training."""
    out: list[list[Mapping[str, Any]]] = []
    for m in metrics:
        if not out or _num(m.get("step")) <= _num(out[-1][-1].get("step")):
            out.append([])
        out[-1].append(m)
    return out


def save_rows(events: Sequence[Mapping[str, Any]], metrics: Sequence[Mapping[str, Any]]
              ) -> list[dict[str, Any]]:
    """One row per save: blocking time from metrics.jsonl, tier and write time from the ledger.

    Each ``train_started`` (step k) owns the next metrics stretch that begins at step k + 1
    (a start that failed before its first step has none); a ``ckpt_saved`` takes the blocking
    time of its step from the stretch of the training it happened in. Generation numbers cannot
    do this: they start again in every allocation.
    """
    pending = [[(int(_num(m.get("step"))), _num(m.get("ckpt_blocking_s"))) for m in part
                if _num(m.get("ckpt_blocking_s")) > 0] for part in stretches(metrics)]
    firsts = [int(_num(part[0].get("step"))) for part in stretches(metrics)]
    rows: list[dict[str, Any]] = []
    current, nxt = None, 0
    for e in sorted(events, key=lambda e: _num(e.get("t"))):
        if e.get("event") == TRAIN_STARTED:
            start = int(_num(e.get("step"))) + 1
            hit = next((i for i in range(nxt, len(firsts)) if firsts[i] == start), None)
            current, nxt = (hit, hit + 1) if hit is not None else (None, nxt)
        elif e.get("event") == CKPT_SAVED:
            step = int(_num(e.get("step")))
            own = pending[current] if current is not None else []
            i = next((i for i, (s, _) in enumerate(own) if s == step), None)
            rows.append({"t": _num(e.get("t")), "step": step, "tier": str(e.get("tier", "")),
                         "write_s": _num(e.get("seconds")),
                         "blocking_s": None if i is None else own.pop(i)[1]})
    # saves that blocked training but never committed (killed mid-write): still a cost
    rows += [{"t": None, "step": s, "tier": "", "write_s": None, "blocking_s": b}
             for own in pending for s, b in own]
    return rows


def _step_time(metrics: Sequence[Mapping[str, Any]]) -> float | None:
    """Median compute time of a step without a save (the first step of a generation warms up)."""
    times = sorted(_num(m.get("step_time_s")) for m in metrics
                   if _num(m.get("ckpt_blocking_s")) == 0 and _num(m.get("step_time_s")) > 0)
    return times[len(times) // 2] if times else None


def _tokens_per_step(metrics: Sequence[Mapping[str, Any]]) -> int | None:
    got = [round(_num(m.get("tokens_per_s")) * _num(m.get("step_time_s"))) for m in metrics
           if _num(m.get("step_time_s")) > 0]
    return max(set(got), key=got.count) if got else None


def _allocations(events: Sequence[Mapping[str, Any]]) -> list[tuple[float, float, int]]:
    """(start, end, nodes) per allocation: allocation_start to the next one, a requeue or the end."""
    ordered = sorted(events, key=lambda e: _num(e.get("t")))
    last = _num(ordered[-1].get("t")) if ordered else 0.0
    out = []
    for i, e in enumerate(ordered):
        if e.get("event") != ALLOCATION_START:
            continue
        t0 = _num(e.get("t"))
        end = next((_num(x.get("t")) for x in ordered[i + 1:]
                    if x.get("event") in (ALLOCATION_START, REQUEUE, END)), last)
        out.append((t0, end, len(e.get("nodes") or []) or 1))
    return out


def _recovery_s(report: RunReport, events: Sequence[Mapping[str, Any]]) -> tuple[float, str]:
    """R of the model: mean fault -> training again over the failures that recovered; a run
    without one gets its startup time (allocation -> training), the same path a restart takes."""
    got = [f.restore_s for f in report.failures if f.restore_s is not None]
    if got:
        return sum(got) / len(got), f"mean over {len(got)} recoveries of this run"
    alloc = [e for e in events if e.get("event") == ALLOCATION_START]
    start = [e for e in events if e.get("event") == TRAIN_STARTED]
    if alloc and start:
        return max(0.0, _num(start[0]["t"]) - _num(alloc[0]["t"])), "this run's startup (no failure recovered)"
    return 0.0, "unknown (0)"


def _strings(value: Any) -> list[str] | None:
    """A list of strings from the ledger or the config (a single string is one item)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)):
        return [str(v) for v in value]
    return None


def _dedup(items: Sequence[str]) -> list[str]:
    return list(dict.fromkeys(i for i in items if i))


def header(events: Sequence[Mapping[str, Any]], config: Mapping[str, Any]) -> Header:
    """The run page's header. Ledger fields are read with care: a hand-written or older ledger
    may lack any of them (check_read has already refused a field of the wrong type)."""
    subs = [e for e in events if e.get("event") == SUBMITTED]
    jobs = _dedup([str(e.get("job_id") or "") for e in events if e.get("event") in (SUBMITTED, SUCCESSOR)])
    newest = subs[-1] if subs else {}
    commit = newest.get("commit")
    hosts = _dedup([str(n) for e in events if e.get("event") == ALLOCATION_START
                    for n in (e.get("nodes") or [])])
    ends = [e for e in events if e.get("event") == END]
    # a run resumed after its end goes on: its end is the one after the newest submission
    ended = _num(ends[-1].get("t")) if ends and (not subs or _num(ends[-1].get("t")) >= _num(newest.get("t"))) \
        else None
    return Header(jobs=jobs, command=_strings(_get(config, "job.command")),
                  overrides=_strings(newest.get("overrides")) if "overrides" in newest else None,
                  commit=str(commit) if isinstance(commit, str) and commit else None,
                  resumes=_dedup([str(e.get("resumes") or "") for e in subs]), hosts=hosts,
                  submitted=_num(subs[0].get("t")) if subs else None, ended=ended)


def _advice(data: RunData, mtbf_h: float | None) -> Advice | None:
    blocking = [s["blocking_s"] for s in data.saves if s["blocking_s"] is not None]
    step_s = _step_time(data.metrics)
    current = int(_num(_get(data.config, "train.ckpt_interval_steps")))
    if not blocking:
        data.notes.append("no checkpoint blocking time in metrics.jsonl (no save, or no metrics): "
                          "no interval advice")
        return None
    if step_s is None:
        data.notes.append("no step times in metrics.jsonl: no interval advice")
        return None
    r = data.report
    failures: int | None = None  # the failures M rests on: None when the user gave M
    held = r.wall_s - data.breakdown["queue"]
    if mtbf_h is not None:
        mtbf, source = mtbf_h * 3600.0, f"--mtbf-h {mtbf_h:g}"
    elif r.failures:
        failures = len(r.failures)
        mtbf = held / failures
        source = f"this run: {failures} failure{'s' if failures != 1 else ''} in {held / 3600:.3g} h holding nodes"
    else:
        data.notes.append("no failure in this run and no --mtbf-h: no interval advice "
                          "(pass --mtbf-h with your cluster's mean time between failures)")
        return None
    recovery, why = _recovery_s(r, data.events)
    figures = Figures(save_s=sum(blocking) / len(blocking), mtbf_s=mtbf, recovery_s=recovery,
                      step_s=step_s)
    return advise(figures, current, source, why, mtbf_failures=failures,
                  mtbf_held_s=None if failures is None else held)


def _layout_of(data: RunData) -> tuple[int, int]:
    """(GPUs per node, training nodes): the run's frozen layout.json, the answer its job and agents
    used; a run directory without one falls back to the same rule (job.gpus_per_node=0 is a CPU
    job, not "the cluster's GPUs")."""
    from slurmkit.layout import LayoutError, read_layout

    if os.path.exists(os.path.join(data.run_dir, LAYOUT_NAME)):
        try:
            layout = read_layout(data.run_dir)
            return layout.gpus_per_node, layout.train_nodes
        except (LayoutError, ValueError, RecursionError) as exc:  # a layout.json written by hand, or worse
            data.notes.append(f"{LAYOUT_NAME} not used: {str(exc)[:200]}")
    job_gpus = _get(data.config, "job.gpus_per_node")
    gpn = _num(job_gpus) if job_gpus is not None else _num(_get(data.config, "cluster.gpus_per_node"))
    return int(gpn), int(_num(_get(data.config, "job.nodes"), 1))


def _cost(data: RunData) -> Cost | None:
    price = _num(_get(data.config, "cluster.gpu_hour_cost"))
    if price <= 0:
        data.notes.append("cluster.gpu_hour_cost is not set: no cost figures")
        return None
    gpn, train_nodes = _layout_of(data)
    if gpn <= 0:
        data.notes.append("no GPUs per node in the config (a CPU job): no cost figures")
        return None
    allocs = _allocations(data.events)
    gpu_hours = sum((b - a) * n * gpn for a, b, n in allocs) / 3600.0
    if data.report.productive_s is None:
        data.notes.append("no training seen in the ledger (no step of the program was read): no cost figures")
        return None
    useful = data.report.productive_s * train_nodes * gpn / 3600.0
    per_step = _tokens_per_step(data.metrics)
    starts = [int(_num(e.get("step"))) for e in data.events if e.get("event") == TRAIN_STARTED]
    kept = (data.report.final_step or 0) - (min(starts) if starts else 0)
    if per_step is None:
        data.notes.append("no tokens per step in metrics.jsonl: no cost per million tokens")
    return Cost(price, gpn, gpu_hours, useful, kept * (per_step or 0), gpu_hours * price)


def load_run(run_dir: str, mtbf_h: float | None = None) -> RunData:
    ledger = os.path.join(run_dir, LEDGER_NAME)
    if not os.path.isfile(ledger):
        raise ConfigError(f"no {LEDGER_NAME} in {run_dir}",
                          "a run directory that slurmkit.submit created (or a sweep directory)",
                          "pass the run directory printed at submit (e.g. runs/<name>/<stamp>)")
    events = sorted(read_ledger(ledger), key=lambda e: _num(e.get("t")))
    notes: list[str] = []
    mpath, cpath = os.path.join(run_dir, METRICS_NAME), os.path.join(run_dir, CONFIG_NAME)
    metrics = _jsonl(mpath, notes) if os.path.isfile(mpath) else []
    if not metrics:
        notes.append(f"no {METRICS_NAME}: no loss, tokens/s or checkpoint blocking figures")
    config = _config(cpath) if os.path.isfile(cpath) else {}
    if not config:
        notes.append(f"no {CONFIG_NAME}: interval and cost unknown")
    data = RunData(run_dir=run_dir, name=str(_get(config, "job.name", os.path.basename(run_dir))),
                   events=events, report=summarize(events), breakdown=breakdown(events),
                   metrics=metrics, config=config, saves=save_rows(events, metrics),
                   advice=None, cost=None, notes=notes, header=header(events, config))
    data.advice = _advice(data, mtbf_h)
    data.cost = _cost(data)
    return data
