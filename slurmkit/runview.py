"""What a run directory says about its run right now, read cheaply enough to refresh every second.

The verbs that watch runs (status, runs, logs, cancel, submit.wait) read the same three sources:

- ``ledger.jsonl``: allocations, generations, checkpoints per tier, failures, the end. It grows
  for the whole run (heartbeat samples every ``supervisor.heartbeat_ledger_interval_s``), so a
  watcher reads it incrementally (:class:`LedgerTail` keeps its byte offset) and a listing reads
  only its first line and its last block (:func:`ledger_edges`).
- ``metrics.jsonl`` (rank 0 of the reference trainer, one line per step): step, loss, tokens/s,
  MFU. Only its last complete line matters, read from the file's end (:func:`last_json_line`).
  Any other program's figures and total steps (slurmkit.userapi.report_metrics,
  set_total_steps) come from node 0's heartbeat samples in the ledger; without them they are
  unknown (never the reference trainer's ``train.steps``).
- rank 0's heartbeat, when there are no metrics: it is node-local (slurmkit.train.heartbeat),
  so it is read only where the viewer runs on rank 0's node (a laptop run, or on node 0);
  elsewhere the ledger's ``heartbeat`` samples carry the step.

Run directories are on a shared file system and written by the job: every file here is
untrusted input. Unreadable or torn lines are skipped, never fatal; values are type-checked
before they are shown.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import yaml
from rich.text import Text

from slurmkit.errors import ConfigError
from slurmkit.ledger.ledger import LEDGER_NAME, LINE_BYTES, parse_record
from slurmkit.ledger.names import (ALLOCATION_START, CANCEL_REQUESTED, CHECKPOINTED_ON_SIGNAL, CKPT_ADOPTED,
                                   CKPT_DURABLE, CKPT_SAVED, END, FAILURE, HEARTBEAT, RANKS_STARTED, REQUEUE, STRAGGLER,
                                   SUBMITTED, SUCCESSOR, TRAIN_FINISHED, TRAIN_RESUMED, TRAIN_STARTED,
                                   TRAIN_STOPPED)
from slurmkit.ledger.summary import RunReport, summarize
from slurmkit.runfiles import CONFIG_NAME, METRICS_NAME, SWEEP_NAME
from slurmkit.failures.programs import is_reference_trainer
from slurmkit.train.heartbeat import LocalDirError, figures_of, local_heartbeat_path, read_heartbeat
from slurmkit.untrusted import UntrustedDataError, parse_json, parse_object, read_regular, safe_line

log = logging.getLogger(__name__)

END_STATUSES = frozenset({"completed", "stopped", "signalled", "cancelled", "failed", "ended"})
TAIL_BYTES = 64 * 1024  # one block from a file's end: far more than one metrics/ledger line
CONFIG_BYTES = 16 * 1024 * 1024  # a frozen config is a few KiB
SWEEP_BYTES = 64 * 1024 * 1024  # sweep.json: a thousand variants with their overrides take ~1 MiB
REFUSALS_NAMED = 20  # refused ledger lines named in the log per watched run


# ------------------------------------------------------------------ reading files cheaply

def _parse_lines(chunk: bytes, *, ledger: bool = True, where: str = "",
                 refused: list[str] | None = None) -> list[dict[str, Any]]:
    """The records on whole lines: ledger records as the ledger's own reader takes them
    (slurmkit.ledger.ledger.parse_record: within slurmkit.untrusted's limits, known fields
    type-checked), other lines (metrics) as JSON objects within the same limits. A torn or
    foreign line is skipped; why is appended to ``refused`` (named by ``where``) when given."""
    out = []
    for raw in chunk.split(b"\n"):
        raw = raw.strip()
        if not raw:
            continue
        if ledger:
            value, why = parse_record(raw)
        else:
            try:
                value, why = parse_object(raw, max_bytes=LINE_BYTES), ""
            except UntrustedDataError as exc:
                value, why = None, str(exc)
        if value is not None:
            out.append(value)
        elif refused is not None and why:
            refused.append(f"{where}: {why}")
    return out


class LedgerTail:
    """The events of one JSONL file, read incrementally: each :meth:`poll` reads only new bytes.

    A line still being written (no newline yet) waits for the next poll. A file that shrank
    (replaced) is read again from the start. A line the ledger's reader refuses is skipped and
    named in the log (the first few); one that grows past the ledger's line limit without a
    newline is dropped as it comes, never held.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.events: list[dict[str, Any]] = []
        self.refused: list[str] = []
        self._offset = 0
        self._partial = b""
        self._skipping = False  # inside a line already refused for its length

    def poll(self) -> bool:
        """Read what was appended since the last poll; True when new events arrived."""
        try:
            size = os.path.getsize(self.path)
        except OSError:
            return False
        if size < self._offset:
            self.events, self._offset, self._partial, self._skipping = [], 0, b"", False
        if size == self._offset:
            return False
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            chunk = f.read(size - self._offset)
        self._offset += len(chunk)
        data = self._partial + chunk
        cut = data.rfind(b"\n") + 1
        whole, self._partial = data[:cut], data[cut:]
        if self._skipping and cut:
            whole, self._skipping = whole[whole.find(b"\n") + 1:], False  # the overlong line's end
        if len(self._partial) > LINE_BYTES:
            self._note([f"{self.path}: a line over {LINE_BYTES} bytes"])
            self._partial, self._skipping = b"", True
        refused: list[str] = []
        new = _parse_lines(whole, where=self.path, refused=refused)
        self._note(refused)
        self.events.extend(new)
        return bool(new)

    def _note(self, refused: list[str]) -> None:
        for why in refused:
            if len(self.refused) < REFUSALS_NAMED:
                log.warning("ledger line skipped: %s", why)
            self.refused.append(why)


def _read_tail(path: str, nbytes: int = TAIL_BYTES) -> bytes:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - nbytes))
            data = f.read(nbytes)
    except OSError:
        return b""
    if size > nbytes:  # the first line of the block is probably cut: drop it
        data = data[data.find(b"\n") + 1:]
    return data


def last_json_line(path: str) -> dict[str, Any] | None:
    """The last complete JSON object line of ``path`` (read from its end), or None."""
    data = _read_tail(path, 8192)
    if not data.endswith(b"\n"):
        data = data[: data.rfind(b"\n") + 1]  # the last line is still being written
    lines = _parse_lines(data, ledger=False)
    return lines[-1] if lines else None


def first_json_line(path: str) -> dict[str, Any] | None:
    try:
        with open(path, "rb") as f:
            line = f.readline(TAIL_BYTES)
    except OSError:
        return None
    lines = _parse_lines(line)
    return lines[0] if lines else None


def ledger_edges(run_dir: str) -> list[dict[str, Any]]:
    """The ledger's first event and those of its last block: enough for a one-line listing."""
    path = os.path.join(run_dir, LEDGER_NAME)
    first = first_json_line(path)
    tail = _parse_lines(_read_tail(path))
    return ([first] if first is not None and (not tail or tail[0] != first) else []) + tail


def read_heartbeat_step(run_dir: str, env: Mapping[str, str] | None = None) -> int | None:
    """Rank 0's step from its node-local heartbeat, when this machine holds it (None elsewhere:
    the run directory holds no heartbeats, nothing on the shared file system is read here)."""
    try:
        path = local_heartbeat_path(run_dir, 0, os.environ if env is None else env)
        st = os.lstat(path)
    except (OSError, LocalDirError):
        return None
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
        return None  # a link or another user's file is not this run's beat
    beat = read_heartbeat(path)
    step = beat.get("step") if beat is not None else None
    return step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None


def read_config(run_dir: str) -> dict[str, Any]:
    """The frozen config as plain data (safe YAML: a config file runs no code), {} if unreadable."""
    try:
        raw = yaml.safe_load(read_regular(os.path.join(run_dir, CONFIG_NAME), CONFIG_BYTES))
    except (OSError, ValueError, yaml.YAMLError, RecursionError):  # too big, not text, nested too deep
        return {}
    return raw if isinstance(raw, dict) else {}


def _get(raw: Mapping[str, Any], dotted: str) -> Any:
    value: Any = raw
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    return value


def clean(value: object) -> Text:
    """A table cell from untrusted text: no markup, and every non-printable character (C0/C1
    controls, bidi overrides, line separators; tabs aside) shown escaped, as ``slurmkit logs``
    shows it (\\x9b, \\u202e): a cell can neither drive the terminal nor read reversed."""
    return Text(safe_line(str(value)))


# ------------------------------------------------------------------ the view of one run

@dataclass(frozen=True)
class RunView:
    """One run as far as its files tell (Slurm's view is added by the caller)."""

    run_dir: str
    name: str
    job_id: str | None
    executor: str | None  # "slurm" | "local" | None (never submitted)
    phase: str  # submitted | starting | training | recovering | requeued | <end status>
    ended: bool
    nodes: list[str]
    generation: int | None
    step: int | None
    total_steps: int | None
    loss: float | None
    tokens_per_s: float | None
    mfu: float | None
    checkpoints: dict[str, int]  # tier -> newest step saved or made durable there
    failures: dict[str, int]  # failure class -> count
    goodput: float | None  # None until the ledger holds a whole summary
    report: RunReport | None = field(default=None, compare=False, repr=False)
    # node -> (score, step) of its newest ``straggler`` event (a node that stayed slow)
    stragglers: dict[str, tuple[float, int | None]] = field(default_factory=dict)
    submitted_at: float | None = None  # epoch seconds of the first ``submitted``
    ended_at: float | None = None  # epoch seconds of the ``end`` that ended it
    time_limit: str | None = None  # job.time of the frozen config (Slurm's --time, per allocation)
    step_time_s: float | None = None  # rank 0's newest step, checkpoint blocking included


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _float(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


# The phase an event puts the run in; ``end`` carries its own status.
_PHASE_OF_EVENT = {
    SUBMITTED: "submitted", ALLOCATION_START: "starting", RANKS_STARTED: "running",
    TRAIN_STARTED: "training", TRAIN_RESUMED: "training", FAILURE: "recovering",
    REQUEUE: "requeued", CHECKPOINTED_ON_SIGNAL: "checkpointing",
    CANCEL_REQUESTED: "cancelling",
}


def phase_of(events: Sequence[Mapping[str, Any]]) -> tuple[str, bool]:
    """(what the run is doing, whether it ended) from its events in ledger order."""
    phase = "created"
    for e in events:
        kind = e.get("event")
        if kind == END:
            phase = str(e.get("status") or "ended")
        elif kind in _PHASE_OF_EVENT:
            phase = _PHASE_OF_EVENT[kind]
    return phase, phase in END_STATUSES


def _job(events: Iterable[Mapping[str, Any]]) -> tuple[str | None, str | None]:
    job_id = executor = None
    for e in events:
        if e.get("event") == SUBMITTED:
            job_id = str(e["job_id"]) if e.get("job_id") is not None else job_id
            executor = str(e.get("executor") or "") or executor
        elif (e.get("event") == SUCCESSOR or (e.get("event") == ALLOCATION_START and e.get("predecessor"))) \
                and e.get("job_id") is not None:
            job_id = str(e["job_id"])  # the run went on in the job this one submitted (supervise/exits/successor.py)
        elif e.get("event") == ALLOCATION_START and job_id is None and e.get("job_id") is not None:
            job_id = str(e["job_id"])
            executor = str(e.get("executor") or "") or executor
    return job_id, executor


def checkpoints_by_tier(events: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for e in events:
        step = _int(e.get("step"))
        # (a program's save the agents adopted into a tier counts there: store.adopt)
        if e.get("event") in (CKPT_SAVED, CKPT_DURABLE, CKPT_ADOPTED) and step is not None and e.get("tier"):
            tier = str(e["tier"])
            out[tier] = max(out.get(tier, step), step)
    return out


def _latest(events: Sequence[Mapping[str, Any]], kind: str) -> Mapping[str, Any] | None:
    return next((e for e in reversed(events) if e.get("event") == kind), None)


def _ledger_step(events: Sequence[Mapping[str, Any]]) -> int | None:
    for e in reversed(events):
        if e.get("event") == HEARTBEAT and isinstance(e.get("steps"), dict):
            steps = [s for s in (_int(v) for v in e["steps"].values()) if s is not None]
            if steps:
                return min(steps)
        if e.get("event") in (TRAIN_STARTED, TRAIN_FINISHED, TRAIN_STOPPED, CKPT_SAVED):
            step = _int(e.get("step"))
            if step is not None:
                return step
    return None


def sample_figures(events: Sequence[Mapping[str, Any]]) -> tuple[dict[str, float | None], int | None]:
    """Rank 0's figures and the run's total steps from the newest heartbeat samples that carry
    them (a program's slurmkit.userapi.report_metrics and set_total_steps; node 0's samples)."""
    figures: dict[str, float | None] | None = None
    total: int | None = None
    for e in reversed(events):
        if e.get("event") != HEARTBEAT:
            continue
        got, got_total = figures_of(e)
        if figures is None and got:
            figures = got
        if total is None:
            total = got_total
        if figures is not None and total is not None:
            break
    return figures or {}, total


def configured_total(cfg: Mapping[str, Any]) -> int | None:
    """``train.steps`` when the job runs the reference trainer (or names no command: a config
    written before commands were frozen); another program's length is its own to tell."""
    command = _get(cfg, "job.command")
    if isinstance(command, list) and not is_reference_trainer([str(a) for a in command]):
        return None
    return _int(_get(cfg, "train.steps"))


def stragglers_of(events: Iterable[Mapping[str, Any]]) -> dict[str, tuple[float, int | None]]:
    """node -> (score, step) from the ledger's ``straggler`` events, the newest per node."""
    out: dict[str, tuple[float, int | None]] = {}
    for e in events:
        node, score = e.get("node"), _float(e.get("score"))
        if e.get("event") == STRAGGLER and isinstance(node, str) and score is not None:
            out[node] = (score, _int(e.get("step")))
    return out


def build_view(run_dir: str, events: Sequence[Mapping[str, Any]], *, full: bool,
               config: Mapping[str, Any] | None = None) -> RunView:
    """The view of ``run_dir`` from its ``events`` (all of them when ``full``: then failures and
    goodput come from :func:`slurmkit.ledger.summary.summarize`, the numbers the run's report
    shows; a listing passes only the ledger's edges and gets failures seen there, no goodput)."""
    cfg = read_config(run_dir) if config is None else config
    job_id, executor = _job(events)
    phase, ended = phase_of(events)
    alloc = _latest(events, ALLOCATION_START)
    started = _latest(events, RANKS_STARTED)
    metrics = last_json_line(os.path.join(run_dir, METRICS_NAME))
    metrics_step = _int(metrics.get("step")) if metrics else None
    step = max((s for s in (metrics_step, _ledger_step(events), read_heartbeat_step(run_dir))
                if s is not None), default=None)
    figures, sampled_total = sample_figures(events)
    report = summarize(events) if full and events else None
    failures = (dict(report.failures_by_class) if report is not None else
                dict(Counter(str(e.get("cls")) for e in events if e.get("event") == FAILURE)))
    name = _get(cfg, "job.name") or (str(_latest(events, SUBMITTED).get("name"))  # type: ignore[union-attr]
                                     if _latest(events, SUBMITTED) else os.path.basename(run_dir))
    nodes = alloc.get("train_nodes") or alloc.get("nodes") if alloc else None
    first_submit = next((e for e in events if e.get("event") == SUBMITTED), None)
    last_end = _latest(events, END)
    return RunView(
        run_dir=run_dir, name=str(name), job_id=job_id, executor=executor, phase=phase, ended=ended,
        nodes=[str(n) for n in nodes] if isinstance(nodes, list) else [],
        generation=_int(started.get("generation")) if started else None,
        step=step, total_steps=sampled_total if sampled_total is not None else configured_total(cfg),
        loss=_float(metrics.get("loss")) if metrics else figures.get("loss"),
        tokens_per_s=_float(metrics.get("tokens_per_s")) if metrics else figures.get("tokens_per_s"),
        mfu=_float(metrics.get("mfu")) if metrics else figures.get("mfu"),
        checkpoints=checkpoints_by_tier(events), failures=failures,
        goodput=report.goodput if report is not None else None, report=report,
        stragglers=stragglers_of(events),
        submitted_at=_float(first_submit.get("t")) if first_submit else None,
        ended_at=_float(last_end.get("t")) if ended and last_end else None,
        time_limit=str(_get(cfg, "job.time")) if _get(cfg, "job.time") else None,
        step_time_s=_float(metrics.get("step_time_s")) if metrics else None)


class RunWatcher:
    """One run followed over time: reads only what changed since the last :meth:`refresh`.

    Cost per refresh stays small however long the run: the ledger is read from the offset
    reached; the view is built from the events that are not heartbeat samples (allocations,
    generations, checkpoints, failures: few) plus the newest sample; the summary (goodput,
    failures), which needs every event, is recomputed when such an event arrives and otherwise
    at most every ``summary_interval_s`` (a job of 2,048 nodes samples ~200 heartbeats/s).
    """

    def __init__(self, run_dir: str, *, summary_interval_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.run_dir = run_dir
        self.tail = LedgerTail(os.path.join(run_dir, LEDGER_NAME))
        self.config = read_config(run_dir)
        self.view: RunView | None = None
        self._metrics_size = -1
        self._light: list[dict[str, Any]] = []  # every event but heartbeat samples
        self._beat: dict[str, Any] | None = None  # the newest heartbeat sample
        self._figured: dict[str, Any] | None = None  # the newest one with rank 0's figures or total
        self._summary_at = float("-inf")
        self._summary_interval_s = summary_interval_s
        self._clock = clock

    def refresh(self) -> bool:
        """Re-read the run; True when anything it shows may have changed."""
        seen = len(self.tail.events)
        grew = self.tail.poll()
        news = self.tail.events[seen:]
        for e in news:
            if e.get("event") == HEARTBEAT:
                self._beat = e
                if e.get("metrics") or e.get("total_steps") is not None:
                    self._figured = e
            else:
                self._light.append(e)
        try:
            size = os.path.getsize(os.path.join(self.run_dir, METRICS_NAME))
        except OSError:
            size = -1
        changed = grew or size != self._metrics_size or self.view is None
        self._metrics_size = size
        if not changed:
            return False
        previous = self.view
        samples = [b for b in (self._figured, self._beat) if b is not None]
        light = self._light + [b for i, b in enumerate(samples) if b not in samples[:i]]
        view = build_view(self.run_dir, light, full=False, config=self.config)
        due = (previous is None or previous.report is None
               or any(e.get("event") != HEARTBEAT for e in news)
               or self._clock() - self._summary_at >= self._summary_interval_s)
        if self.tail.events and (due and (grew or previous is None)):
            self._summary_at = self._clock()
            view = with_summary(view, summarize(self.tail.events))
        elif previous is not None:
            view = _with_report(view, previous)
        self.view = view
        return True


def with_summary(view: RunView, report: RunReport) -> RunView:
    return replace(view, failures=dict(report.failures_by_class), goodput=report.goodput,
                   report=report)


def _with_report(view: RunView, previous: RunView) -> RunView:
    return replace(view, failures=previous.failures, goodput=previous.goodput, report=previous.report)


# ------------------------------------------------------------------ what a target names

@dataclass(frozen=True)
class Variant:
    index: int
    overrides: list[str]
    run_dir: str


@dataclass(frozen=True)
class Sweep:
    path: str
    name: str
    job_id: str | None
    variants: list[Variant]
    runner_pid: int | None = None  # the local executor's array runner (slurmkit.sweep.local)

    def job_ref(self, v: Variant) -> str | None:
        """The Slurm id of one array task (``<array job>_<index>``)."""
        return f"{self.job_id}_{v.index}" if self.job_id else None


def read_sweep(path: str) -> Sweep:
    """The sweep directory's ``sweep.json`` (see docs/cli.md, "Sweeps: one job array")."""
    file = os.path.join(path, SWEEP_NAME)
    try:
        raw = parse_json(read_regular(file, SWEEP_BYTES), max_bytes=SWEEP_BYTES)
    except (OSError, UntrustedDataError) as exc:
        raise ConfigError(f"{file} cannot be read: {exc}", "a sweep.json written by slurmkit.submit -m",
                          "pass the sweep directory printed at submit") from exc
    variants = raw.get("variants") if isinstance(raw, dict) else None
    if not isinstance(variants, list):
        raise ConfigError(f"{file} has no list of variants", "sweep.json with a 'variants' list",
                          "pass the sweep directory printed at submit")
    out: list[Variant] = []
    for v in variants:
        if not isinstance(v, dict) or not isinstance(v.get("run_dir"), str):
            continue
        run_dir = v["run_dir"] if os.path.isabs(v["run_dir"]) else os.path.join(path, v["run_dir"])
        index, overrides = v.get("index", len(out)), v.get("overrides") or []
        if isinstance(index, bool) or not isinstance(index, int) or not isinstance(overrides, list):
            continue  # written by hand or by another tool: not a variant this listing can name
        out.append(Variant(index, [str(o) for o in overrides], run_dir))
    job, runner = raw.get("job_id"), raw.get("runner_pid")
    return Sweep(path, str(raw.get("name") or os.path.basename(path)),
                 str(job) if job is not None else None, out,
                 runner if isinstance(runner, int) and not isinstance(runner, bool) else None)


def is_run_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, LEDGER_NAME)) or os.path.isfile(
        os.path.join(path, CONFIG_NAME))


def is_sweep_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, SWEEP_NAME))


def find_dirs(root: str, max_depth: int = 3) -> tuple[list[str], list[str]]:
    """(run directories, sweep directories) below ``root``: ``<root>/<name>/<stamp>[/...]``.

    A sweep's variant run directories count as runs too. Nothing deeper than ``max_depth``
    is visited, so a run root holding other trees costs little to list.
    """
    runs, sweeps = [], []
    stack = [(os.path.abspath(root), 0)]
    while stack:
        path, depth = stack.pop()
        if depth > 0 and is_sweep_dir(path):
            sweeps.append(path)
        elif depth > 0 and is_run_dir(path):
            runs.append(path)
            continue
        if depth >= max_depth:
            continue
        try:
            entries = list(os.scandir(path))
        except OSError:
            continue
        for entry in entries:
            if entry.is_dir(follow_symlinks=False) and not entry.name.startswith("."):
                stack.append((entry.path, depth + 1))
    return runs, sweeps


def default_run_root(env: Mapping[str, str]) -> str:
    """``submit.run_root`` of the composed default config (the root submit writes into)."""
    from slurmkit.config.compose import compose_dict

    from slurmkit.config.schema import absolute_run_root

    try:
        raw = compose_dict([])
        root = _get(raw, "submit.run_root")
    except Exception:  # an unreadable site conf must not stop a listing: fall back to the default
        root = None
    return absolute_run_root(str(root or ""), env)


def resolve(target: str, run_root: str) -> tuple[str, str]:
    """("run" | "sweep", absolute directory) for a run directory, sweep directory or job id."""
    if os.path.isdir(target):
        path = os.path.abspath(target)
        if is_sweep_dir(path):
            return "sweep", path
        if is_run_dir(path):
            return "run", path
        raise ConfigError(f"{target} holds neither {LEDGER_NAME}, {CONFIG_NAME} nor {SWEEP_NAME}",
                          "a run or sweep directory that slurmkit.submit created",
                          "pass the run directory printed at submit, or list runs with slurmkit runs")
    if not target.replace("_", "").isdigit():
        raise ConfigError(f"{target!r} is no directory and no job id",
                          "a run directory, a sweep directory or a Slurm job id",
                          "list recent runs with: slurmkit runs")
    runs, sweeps = find_dirs(run_root)
    for path in sweeps:
        try:
            sweep = read_sweep(path)
        except ConfigError:
            continue
        if sweep.job_id == target:
            return "sweep", path
        for v in sweep.variants:
            if sweep.job_ref(v) == target:
                return "run", v.run_dir
    for path in runs:
        edges = ledger_edges(path)
        if any(str(e.get("job_id")) == target for e in edges
               if e.get("event") in (SUBMITTED, ALLOCATION_START, SUCCESSOR)):
            return "run", path
    raise ConfigError(f"no run under {os.path.abspath(run_root)} belongs to job {target}",
                      "the job's run directory below the run root",
                      "pass the run directory itself, or --root RUN_ROOT where it was submitted")
