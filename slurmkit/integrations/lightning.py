"""A Lightning ``Trainer`` under slurmkit reports its step, loss, length, starts and saves
without a line of the program changed.

Lightning loads callbacks from the entry point group ``lightning.pytorch.callbacks_factory``
(``pytorch_lightning.callbacks_factory`` for the standalone package) into every ``Trainer`` it
builds (``lightning/pytorch/trainer/connectors/callback_connector.py``, 2.x). slurmkit's
pyproject.toml registers :func:`callbacks` and :func:`pl_callbacks` there. In a process that is
not a rank slurmkit started (no ``$SLURMKIT_RUN_DIR`` and heartbeat file), or one whose job says
``job.program=none``, they return no callback: Lightning runs as if slurmkit were not installed.

What the callback does, through :class:`slurmkit.userapi.Reporter` (node-local writes, nothing
on the shared file system per step):

- **Training starts**: the run's length (``max_steps``, else Lightning's estimate of the
  optimizer steps when finite) and, on rank 0, a ``train_started`` event with the global step it
  resumed from, which the report's segments, steps lost and goodput are read from.
- **Every optimizer step** (``on_train_batch_end``): a beat with ``trainer.global_step`` on every
  rank, so the agent times each rank's steps for hangs. Rank 0's beat carries the loss returned by
  ``training_step``, read at most once per :data:`FIGURES_EVERY_S` (reading a GPU tensor waits
  for the device).
- **Validation and saves**: a beat naming the phase (``validation``, at most once per
  :data:`FIGURES_EVERY_S`; ``saving`` when a checkpoint is being built), so a long evaluation or
  save is not taken for a hang (slurmkit.launch.monitor).
- **A finished save** of a ``ModelCheckpoint`` (its newest file and global step, as the
  callback records them after ``trainer.save_checkpoint`` returned on every rank) is reported
  from rank 0 with ``report_checkpoint``, after an ``fsync`` of the file: node 0's crash-loop
  rule counts it as progress. A save through ``AsyncCheckpointIO`` has not finished when the
  callback sees it and is not reported (the agent's folder scan or ``job.checkpoint_glob`` can
  count it).

A report that fails is said once on stderr and never raised into training.
"""

from __future__ import annotations

import importlib
import math
import os
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

from slurmkit import contract
from slurmkit.userapi import PHASE_SAVING, Reporter

FIGURES_EVERY_S = 1.0
VALIDATION = "validation"
#: job.program values under which slurmkit's callback stays out of the Trainer.
OFF_FOR = frozenset({"none"})


def active(env: Mapping[str, str]) -> bool:
    """Whether this process is a rank slurmkit started and its job lets the callback in."""
    return bool(env.get(contract.RUN_DIR) and env.get(contract.HEARTBEAT_FILE)
                and env.get(contract.PROGRAM, "") not in OFF_FOR)


def callbacks() -> list[Any]:
    """The ``lightning.pytorch.callbacks_factory`` entry point: [the callback] or []."""
    return _callbacks("lightning.pytorch")


def pl_callbacks() -> list[Any]:
    """The ``pytorch_lightning.callbacks_factory`` entry point (the standalone package)."""
    return _callbacks("pytorch_lightning")


_CLASSES: dict[str, type] = {}


def _callbacks(package: str, env: Mapping[str, str] | None = None) -> list[Any]:
    env = os.environ if env is None else env
    if not active(env):
        return []
    cls = _CLASSES.get(package)
    if cls is None:
        base = importlib.import_module(package).Callback
        cls = _CLASSES[package] = type("SlurmkitReporting", (_Reporting, base), {"__module__": __name__})
    return [cls(Reporter(env))]


def loss_of(outputs: object) -> float | None:
    """The loss ``training_step`` returned (a tensor, or a mapping with ``loss``) as a float;
    None when there is none or it is not one number."""
    value: Any = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
    if value is None:
        return None
    try:
        if hasattr(value, "detach"):
            if value.numel() != 1:
                return None
            value = value.detach()
        number = float(value)
    except (TypeError, ValueError, RuntimeError):
        return None
    return number if math.isfinite(number) else None


def length_of(trainer: Any) -> int | None:
    """The optimizer steps the fit runs for: ``max_steps`` when set, else Lightning's estimate
    when it is finite; None when neither is known."""
    max_steps = getattr(trainer, "max_steps", -1)
    if isinstance(max_steps, int) and max_steps > 0:
        return max_steps
    try:
        estimate = trainer.estimated_stepping_batches
    except Exception:  # noqa: BLE001 - an estimate Lightning cannot make is an unknown length
        return None
    if isinstance(estimate, (int, float)) and math.isfinite(estimate) and estimate > 0:
        return int(estimate)
    return None


def newest_save(trainer: Any) -> tuple[int, str] | None:
    """The newest save any of the trainer's ``ModelCheckpoint`` callbacks finished: (global step,
    path); None when none saved (or the attributes are not there in this Lightning)."""
    best: tuple[int, str] | None = None
    for cb in getattr(trainer, "checkpoint_callbacks", None) or []:
        step, path = getattr(cb, "_last_global_step_saved", None), getattr(cb, "_last_checkpoint_saved", None)
        if isinstance(step, int) and not isinstance(step, bool) and step > 0 and isinstance(path, str) and path:
            if best is None or step > best[0]:
                best = (step, path)
    return best


def _asynchronous(trainer: Any) -> bool:
    io = getattr(getattr(trainer, "strategy", None), "checkpoint_io", None)
    return any("Async" in type(c).__name__ for c in (io, getattr(io, "checkpoint_io", None)) if c is not None)


def _fsync_file(path: str) -> None:
    """Make a checkpoint file durable before it is counted (Lightning's torch.save does not)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return  # a directory of shards, a link (save_last="link"), or already replaced
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class _Reporting:
    """The hooks; mixed into the installed Lightning's ``Callback`` by :func:`_callbacks`."""

    def __init__(self, reporter: Reporter, clock: Callable[[], float] = time.monotonic) -> None:
        self.reporter = reporter
        self._clock = clock
        self._figures_at = -math.inf
        self._phase_at = -math.inf
        self._figures: dict[str, float | None] = {}
        self._reported = -1  # the newest save step reported (or resumed from)
        self._failed = False

    def _guard(self, what: str, call: Callable[[], object]) -> None:
        try:
            call()
        except Exception as exc:  # noqa: BLE001 - a report must never end the training
            if not self._failed:
                self._failed = True
                print(f"slurmkit: the Lightning callback could not report ({what}): {exc!r}",
                      file=sys.stderr, flush=True)

    # ---- Lightning's hooks
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        def start() -> None:
            total = length_of(trainer)
            if total is not None:
                self.reporter.total_steps(total)
            self._reported = trainer.global_step  # what it resumed from is not a new save
            self.reporter.train_start(trainer.global_step)
        self._guard("train start", start)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        def step() -> None:
            if trainer.is_global_zero and self._clock() - self._figures_at >= FIGURES_EVERY_S:
                self._figures_at = self._clock()
                loss = loss_of(outputs)
                self._figures = {} if loss is None else {"loss": loss}
            if self._figures and trainer.is_global_zero:
                self.reporter.metrics(trainer.global_step, self._figures)
            else:
                self.reporter.step(trainer.global_step)
            self._count_saves(trainer)
        self._guard("step", step)

    def on_validation_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        if self._clock() - self._phase_at >= FIGURES_EVERY_S:
            self._phase_at = self._clock()
            self._guard("validation", lambda: self.reporter.phase(trainer.global_step, VALIDATION))

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self._phase_at = self._clock()
        self._guard("validation", lambda: self.reporter.phase(trainer.global_step, VALIDATION))

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        self._guard("save", lambda: self.reporter.phase(trainer.global_step, PHASE_SAVING))

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self._guard("save", lambda: self._count_saves(trainer))

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        self._guard("save", lambda: self._count_saves(trainer))

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._guard("save", lambda: self._count_saves(trainer))

    # ---- saves
    def _count_saves(self, trainer: Any) -> None:
        """Report a save finished since the last look (rank 0; the others' calls count nothing)."""
        if not trainer.is_global_zero:
            return
        newest = newest_save(trainer)
        if newest is None or newest[0] <= self._reported or _asynchronous(trainer):
            return
        step, path = newest
        self._reported = step
        _fsync_file(path)
        self.reporter.checkpoint(step, path)
