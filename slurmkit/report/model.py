"""The goodput model behind the checkpoint-interval advice, and the Young/Daly intervals.

The model (Daly, "A higher order estimate of the optimum checkpoint interval for restart
dumps", FGCS 2006, eq. 12 with a constant restart cost):

- failures arrive as a Poisson process with mean time between failures ``M`` seconds;
- training writes a checkpoint after every ``tau`` seconds of compute, and each save blocks
  training for ``C`` seconds (the measured ``ckpt_blocking_s``; the background write that
  follows costs nothing here);
- a failure costs ``R`` seconds (detection + restart + restore, measured per failure) plus
  the work done since the last checkpoint, which is computed again; a failure during a
  restart restarts the restart.

Expected wall time to complete one interval of ``tau`` seconds of useful work is
``M * exp(R / M) * (exp((tau + C) / M) - 1)``, so the goodput (useful / wall) is

    G(tau) = tau / (M * exp(R / M) * (exp((tau + C) / M) - 1))

Its maximum is near Daly's higher-order interval
``sqrt(2 C M) * (1 + sqrt(C / 2M) / 3 + (C / 2M) / 9) - C`` (``M`` when ``C >= 2M``), of
which Young's ``sqrt(2 C M)`` is the first-order term. Queue waits (a requeue after a node
loss without a spare) are not in the model: it describes the time a job holds nodes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from slurmkit.errors import ConfigError


@dataclass(frozen=True)
class Figures:
    """What the model needs, all in seconds."""

    save_s: float  # C: training blocked per checkpoint save
    mtbf_s: float  # M: mean time between failures
    recovery_s: float  # R: fault -> training again, per failure
    step_s: float  # one training step (turns intervals in seconds into steps)

    def __post_init__(self) -> None:
        if self.save_s < 0 or self.recovery_s < 0 or self.mtbf_s <= 0 or self.step_s <= 0:
            raise ConfigError(
                f"model figures C={self.save_s} s, M={self.mtbf_s} s, R={self.recovery_s} s, "
                f"step={self.step_s} s", "C >= 0, R >= 0, M > 0 and a step time > 0",
                "pass --mtbf-h with a positive value, or report a run that trained")


def goodput(tau_s: float, f: Figures) -> float:
    """G(tau): the fraction of wall time that is useful work (module docstring)."""
    if tau_s <= 0:
        return 0.0
    m = f.mtbf_s
    return tau_s / (m * math.exp(f.recovery_s / m) * math.expm1((tau_s + f.save_s) / m))


def young_s(f: Figures) -> float:
    """Young (1974): sqrt(2 C M)."""
    return math.sqrt(2.0 * f.save_s * f.mtbf_s)


def daly_s(f: Figures) -> float:
    """Daly (2006), the higher-order optimum of G for C < 2M; M otherwise."""
    c, m = f.save_s, f.mtbf_s
    if c >= 2.0 * m:
        return m
    x = c / (2.0 * m)
    return math.sqrt(2.0 * c * m) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - c


@dataclass(frozen=True)
class Option:
    label: str  # why this interval is in the table ("current", "Daly", "x2", ...)
    interval_steps: int
    interval_s: float  # compute seconds between saves (steps * step time)
    goodput: float  # G at this interval


@dataclass(frozen=True)
class Advice:
    figures: Figures
    mtbf_source: str  # "this run (N failures in H h)" or "--mtbf-h"
    recovery_source: str  # where R came from
    young_s: float
    daly_s: float
    recommended_steps: int  # Daly's interval rounded to whole steps (at least 1)
    options: list[Option]
    # the failures M rests on and the time they fell in (this run's nodes held); None: M was given
    mtbf_failures: int | None = None
    mtbf_held_s: float | None = None


def steps_of(seconds: float, f: Figures) -> int:
    return max(1, round(seconds / f.step_s))


def advise(f: Figures, current_steps: int, mtbf_source: str, recovery_source: str = "", *,
           mtbf_failures: int | None = None, mtbf_held_s: float | None = None) -> Advice:
    """The intervals worth comparing, each with the goodput the model gives it.

    Compared: the run's own interval, Young's, Daly's, and halves and doubles around Daly's,
    each rounded to whole steps and evaluated at that rounded interval (what a user can set).
    """
    young, daly = young_s(f), daly_s(f)
    rec = steps_of(daly, f)
    wanted = [("current", current_steps), ("Young", steps_of(young, f)), ("Daly", rec),
              ("Daly / 4", steps_of(daly / 4, f)), ("Daly / 2", steps_of(daly / 2, f)),
              ("Daly x 2", steps_of(daly * 2, f)), ("Daly x 4", steps_of(daly * 4, f))]
    labels: dict[int, list[str]] = {}
    for label, steps in wanted:
        if steps > 0:
            labels.setdefault(steps, []).append(label)
    options = [Option(", ".join(names), steps, steps * f.step_s, goodput(steps * f.step_s, f))
               for steps, names in sorted(labels.items())]
    return Advice(f, mtbf_source, recovery_source, young, daly, rec, options, mtbf_failures, mtbf_held_s)
