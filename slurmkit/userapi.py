"""Progress and checkpoints for any program slurmkit runs (``job.command=[...]``), one call each.

    from slurmkit import userapi

    userapi.report_step(step)                   # after every step, on every rank
    userapi.report_checkpoint(step, path=ckpt)  # after the program's own save completed
    userapi.report_metrics(step, loss=l, tokens_per_s=t)  # instead of report_step: with figures
    userapi.set_total_steps(n)                  # once: the run's length, for the bar and status
    userapi.report_train_start(step)            # once per start: the step it resumed from (rank 0)
    userapi.report_phase(step, "validation")    # alive but not stepping: evaluation, a save

A Lightning ``Trainer`` makes these calls itself, without a line changed, through the callback
slurmkit registers with Lightning (:mod:`slurmkit.integrations.lightning`).

``report_step`` and ``report_metrics`` beat the rank's node-local heartbeat (:mod:`slurmkit.train.heartbeat`): a few
system calls on the node's memory, nothing on the shared file system, read by that node's agent
for hangs and the ledger's heartbeat samples; rank 0's figures (at most
:data:`MAX_METRICS` numbers, named like Python identifiers) and the total set by
``set_total_steps`` ride in its beat, and the agent of its node copies them into those samples,
which ``status``, the ``submit.wait`` bar and the report read. ``report_checkpoint`` counts on rank 0 only (the
other ranks' calls return False): it replaces one small marker in the run directory,
:func:`marker_path`, atomically (a temporary file, fsync, rename), once per checkpoint, never
per step. Node 0's crash-loop rule reads it with the checkpoint tiers' ``latest.json``
(:mod:`slurmkit.supervise.ckpt_progress`), so a program that checkpoints on its own is not
stopped as a crash loop after ``supervisor.max_restarts_without_progress`` failures, as long
as it saves something newer between them. The same call hands a ``ckpt_saved`` event
(``tier="user"``) to the node's agent, which writes it into the ledger.

Both are no-ops outside slurmkit (no ``$SLURMKIT_RUN_DIR`` / heartbeat file): the program runs
unchanged under torchrun or alone. A failure to write (a full /dev/shm or file system) is
reported on stderr and never raised into training; a step that is not a non-negative integer is
a bug in the caller and raises :class:`ReportError`.

The exit codes of the contract (:mod:`slurmkit.contract`) are re-exported for such programs:
exit ``EXIT_CHECKPOINTED_ON_SIGNAL`` (95) after saving on SIGUSR1 (the time-limit warning) or
SIGTERM, ``EXIT_CONFIG_ERROR`` (2) after printing ``CONFIG_ERROR_MARKER`` and a message.
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from slurmkit import contract
from slurmkit.atomic import atomic_write
from slurmkit.contract import (
    CONFIG_ERROR_MARKER,
    EXIT_CHECKPOINTED_ON_SIGNAL,
    EXIT_CONFIG_ERROR,
    MARKER_DIR,
    MARKER_MAX_BYTES,
    MARKER_NAME,
    MAX_PHASE,
    PHASE_SAVING,
    marker_path,
)
from slurmkit.errors import ActionableError
from slurmkit.train.heartbeat import Heartbeat

__all__ = ["CONFIG_ERROR_MARKER", "EXIT_CHECKPOINTED_ON_SIGNAL", "EXIT_CONFIG_ERROR", "MARKER_MAX_BYTES",
           "PHASE_SAVING", "ReportError", "Reporter", "marker_path", "report_checkpoint", "report_metrics", "report_phase",
           "report_step", "report_train_start", "set_total_steps"]

MAX_PATH_CHARS = 4096  # PATH_MAX: the path is for people reading the ledger, never opened by slurmkit
USER_TIER = "user"  # the tier name of a program's own checkpoints in the ledger
MAX_METRICS = 16  # figures per beat: the beat stays one small write on the node's memory
MAX_METRIC_NAME = 48


class ReportError(ActionableError):
    """A report the program made that cannot be right (a bug in the caller, not in the run)."""


def check_step(step: object, call: str) -> int:
    """``step`` when it is a non-negative int (bool is not a step), else ReportError."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ReportError(f"{call}({step!r}): a {type(step).__name__}",
                          "a non-negative integer step (optimizer steps completed)",
                          f"call {call}(int(step)) with the count of completed steps")
    return step


def check_metrics(values: Mapping[str, object], call: str) -> dict[str, float | None]:
    """``values`` as the beat carries them: real numbers (bool is not one) under names that are
    Python identifiers; a NaN or infinite figure (a diverged loss) is kept as None, unknown."""
    if len(values) > MAX_METRICS:
        raise ReportError(f"{call} with {len(values)} figures", f"at most {MAX_METRICS}",
                          "report the figures people watch (loss, tokens_per_s, mfu, ...)")
    out: dict[str, float | None] = {}
    for name, value in values.items():
        if not name.isidentifier() or len(name) > MAX_METRIC_NAME:
            raise ReportError(f"{call}: a figure named {name!r:.60}",
                              f"a Python identifier of at most {MAX_METRIC_NAME} characters",
                              "pass it as a keyword argument, e.g. loss=...")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ReportError(f"{call}({name}={value!r:.60}): a {type(value).__name__}",
                              "an int or a float (a tensor's .item())",
                              f"pass {name}=float(...)")
        out[name] = float(value) if math.isfinite(value) else None
    return out


def _env_int(env: Mapping[str, str], name: str, default: int) -> int:
    text = env.get(name, "").strip()
    if not text:
        return default
    try:
        return int(text)
    except ValueError:
        raise ReportError(f"{name}={text!r}", f"an integer {name}, as the node agent or torchrun sets it",
                          f"start the program through slurmkit (job.command=[...]) or unset {name}") from None


def write_marker(run_dir: str, record: Mapping[str, Any]) -> str:
    """Replace the marker with ``record`` (JSON): the reader sees the old or the new one, never
    a torn one, and the new one survives a crash of this node once this returns."""
    path = marker_path(run_dir)
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    data = json.dumps(dict(record), sort_keys=True).encode()
    if len(data) > MARKER_MAX_BYTES:  # cannot happen for the record report_checkpoint builds
        raise ReportError(f"a checkpoint marker of {len(data)} bytes", f"at most {MARKER_MAX_BYTES} bytes",
                          "pass a shorter path to report_checkpoint")
    # 0644 whatever the umask: the marker is read by node 0's agent (same user). The temporary
    # name is this writer's own (pid, thread): a leftover of a killed writer that had them (pids
    # repeat in a container) is replaced, not left beside the marker.
    atomic_write(path, data, mode=0o644, temp=f"{path}.tmp.{os.getpid()}.{threading.get_ident()}")
    return path


class Reporter:
    """One rank's reports, from its environment (the agent's or torchrun's variables).

    ``report_step`` and ``report_checkpoint`` below use one built from ``os.environ``; build
    your own to pass another environment or clock (tests do)."""

    def __init__(self, env: Mapping[str, str], *, clock: Callable[[], float] = time.time) -> None:
        self.env = dict(env)
        self.rank = _env_int(self.env, contract.RANK, _env_int(self.env, contract.SLURM_PROCID, 0))
        self.generation = _env_int(self.env, contract.GENERATION, 0)
        self.run_dir = self.env.get(contract.RUN_DIR) or None
        self._clock = clock
        self._heartbeat: Heartbeat | None = None
        self._no_heartbeat = False
        self._warned: set[str] = set()
        self._total: int | None = None
        self._figures: dict[str, float | None] | None = None  # the last report_metrics figures

    def _warn_once(self, what: str, exc: BaseException) -> None:
        if what not in self._warned:  # once per kind: a full disk must not flood the rank's log
            self._warned.add(what)
            print(f"slurmkit: {what}: {exc}", file=sys.stderr, flush=True)

    def step(self, step: int) -> bool:
        """Beat the heartbeat with ``step``; False when there is none (not under slurmkit) or the
        beat could not be written."""
        check_step(step, "report_step")
        return self._beat(step, None)

    def metrics(self, step: int, values: Mapping[str, object]) -> bool:
        """Beat with ``step`` and the figures ``values`` of that step; as :meth:`step`."""
        check_step(step, "report_metrics")
        return self._beat(step, check_metrics(values, "report_metrics"))

    def total_steps(self, total: int) -> None:
        """The run's length in steps, carried by every beat from the next one on."""
        if isinstance(total, bool) or not isinstance(total, int) or total <= 0:
            raise ReportError(f"set_total_steps({total!r:.60})", "a positive int",
                              "call set_total_steps(int(n)) with the steps the run trains for")
        self._total = total

    def phase(self, step: int, phase: str) -> bool:
        """Beat with ``step`` (unchanged: no step was completed) from outside the step loop:
        ``phase`` is what the rank does (an identifier, e.g. ``validation`` or :data:`PHASE_SAVING`).
        The node's agent takes each such beat as a sign of life; the last figures ride along."""
        check_step(step, "report_phase")
        if not isinstance(phase, str) or not phase.isidentifier() or len(phase) > MAX_PHASE:
            raise ReportError(f"report_phase(phase={phase!r:.60})",
                              f"a Python identifier of at most {MAX_PHASE} characters",
                              'name what the rank does, e.g. report_phase(step, "validation")')
        return self._beat(step, self._figures, phase=phase)

    def train_start(self, step: int) -> bool:
        """Training (re)starts after ``step`` completed steps (0: from scratch, else the step of
        the checkpoint it resumed): rank 0's call hands a ``train_started`` event to the node's
        agent, which the report's segments, goodput and steps lost are read from; every rank
        beats ``step``. True when rank 0's event was handed over."""
        check_step(step, "report_train_start")
        self._beat(step, None)
        if self.rank != 0 or self.run_dir is None:
            return False
        return self._spool("train_started", step=step, generation=self.generation,
                           node=self.env.get(contract.NODE, ""), by="userapi")

    def _beat(self, step: int, figures: Mapping[str, float | None] | None, phase: str | None = None) -> bool:
        if self._heartbeat is None and not self._no_heartbeat:
            try:
                self._heartbeat = Heartbeat.from_env(self.env, self.rank)
            except (OSError, ActionableError) as exc:  # tried again at the next step
                self._warn_once("no heartbeat for this rank", exc)
                return False
            self._no_heartbeat = self._heartbeat is None  # none configured: not under slurmkit
        if self._heartbeat is None:
            return False
        extra: dict[str, Any] = {}
        if figures is not None:
            extra["metrics"] = dict(figures)
            self._figures = dict(figures)
        if phase is not None:
            extra["phase"] = phase
        if self._total is not None:
            extra["total_steps"] = self._total
        try:
            self._heartbeat.beat(step, **extra)
        except OSError as exc:
            self._warn_once(f"cannot write the heartbeat {self._heartbeat.path}", exc)
            return False
        return True

    def checkpoint(self, step: int, path: str | os.PathLike[str] | None = None) -> bool:
        """Record that the program's checkpoint of ``step`` is complete (at ``path``, for people);
        True when the marker was written (rank 0 under slurmkit)."""
        check_step(step, "report_checkpoint")
        where = None if path is None else os.fspath(path)
        if where is not None and (not isinstance(where, str) or len(where) > MAX_PATH_CHARS):
            raise ReportError(f"report_checkpoint(path={where!r:.80})",
                              f"a str path of at most {MAX_PATH_CHARS} characters, or None",
                              "pass the checkpoint's path as a str")
        if self.rank != 0 or self.run_dir is None:
            return False
        record: dict[str, Any] = {
            "step": step, "path": where, "rank": self.rank, "generation": self.generation,
            "attempt": self.env.get(contract.ATTEMPT, ""), "node": self.env.get(contract.NODE, ""),
            "pid": os.getpid(), "time": round(self._clock(), 6),
        }
        try:
            write_marker(self.run_dir, record)
        except OSError as exc:  # said every time: checkpoints are rare, and each lost one matters
            print(f"slurmkit: cannot record checkpoint step {step} in {marker_path(self.run_dir)} "
                  f"(node 0 will not count it as progress): {exc}", file=sys.stderr, flush=True)
            return False
        self._ledger_event(step, where)
        return True

    def _ledger_event(self, step: int, where: str | None) -> None:
        self._spool("ckpt_saved", step=step, tier=USER_TIER, rank=self.rank, uri=where,
                    node=self.env.get(contract.NODE, ""), generation=self.generation)

    def _spool(self, event: str, **fields: Any) -> bool:
        """Hand ``event`` to the node's agent, which writes it into the ledger; False when there
        is no agent (no spool) or the spool could not be written."""
        spool = self.env.get("SLURMKIT_EVENTS_FILE")
        if not spool:
            return False
        from slurmkit.ledger.spool import SpoolWriter  # only rank 0 of a run under an agent needs it

        try:
            writer = SpoolWriter(spool, source=f"rank{self.rank}", clock=self._clock)
        except OSError as exc:  # the spool's directory could not be made: the marker still counts
            self._warn_once(f"cannot hand the {event} event to the node agent", exc)
            return False
        writer.append(event, **fields)
        return writer.lost == 0


_default: Reporter | None = None
_default_lock = threading.Lock()


def default_reporter() -> Reporter:
    """The process's reporter, built from ``os.environ`` at the first report."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Reporter(os.environ)
        return _default


def report_step(step: int) -> bool:
    """After each training step, on every rank: ``step`` steps are complete (the heartbeat)."""
    return default_reporter().step(step)


def report_checkpoint(step: int, path: str | os.PathLike[str] | None = None) -> bool:
    """After the program's own checkpoint of ``step`` is completely written (rank 0's call
    counts): node 0 counts it as progress. Call it once the save is durable, not before."""
    return default_reporter().checkpoint(step, path)


def report_metrics(step: int, **values: float) -> bool:
    """After a step, on any rank (rank 0's figures are the ones shown): ``step`` steps are
    complete and these are its figures, e.g. ``report_metrics(step, loss=l, tokens_per_s=t)``.
    It beats the heartbeat as ``report_step`` does: call one of the two per step."""
    return default_reporter().metrics(step, values)


def set_total_steps(total: int) -> None:
    """Once, before or during training: the number of steps the run trains for (the bar's end
    and status's ``step N/total``; unknown until it is called)."""
    default_reporter().total_steps(total)


def report_phase(step: int, phase: str) -> bool:
    """While the rank is busy outside its steps (``"validation"``, ``"saving"``: see
    :data:`PHASE_SAVING`), at least every minute: it is alive, ``step`` steps are complete."""
    return default_reporter().phase(step, phase)


def report_train_start(step: int) -> bool:
    """Once each time training starts, on every rank, after any restore: ``step`` steps were
    already complete (the resumed checkpoint's step, 0 from scratch). Rank 0's call lets the
    report count the steps each failure lost and the run's goodput."""
    return default_reporter().train_start(step)
