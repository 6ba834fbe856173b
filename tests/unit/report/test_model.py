"""The interval advice against a direct evaluation of the goodput model on the same figures."""

from __future__ import annotations

import math
import os

import pytest

from slurmkit.errors import ConfigError
from slurmkit.report.model import Figures, advise, daly_s, goodput, young_s
from slurmkit.report.run import load_run

THREE_FAULTS = os.path.join(os.path.dirname(__file__), "..", "..", "data", "report", "three_faults")


def model(tau: float, c: float, m: float, r: float) -> float:
    """Daly 2006: useful tau per expected wall time M e^(R/M) (e^((tau+C)/M) - 1), written out."""
    return tau / (m * math.exp(r / m) * (math.exp((tau + c) / m) - 1.0))


def best_steps(f: Figures, upto: int) -> int:
    return max(range(1, upto + 1), key=lambda k: model(k * f.step_s, f.save_s, f.mtbf_s, f.recovery_s))


CASES = [  # (C, M, R, step): a tiny run's figures up to a large job's
    (0.1, 53.0, 13.0, 0.6),
    (2.0, 3600.0, 60.0, 1.5),
    (30.0, 4 * 3600.0, 300.0, 5.0),
    (8.0, 24 * 3600.0, 120.0, 2.0),
]


@pytest.mark.parametrize(("c", "m", "r", "step"), CASES)
def test_every_option_is_the_model_evaluated_at_its_interval(c, m, r, step) -> None:
    f = Figures(save_s=c, mtbf_s=m, recovery_s=r, step_s=step)
    a = advise(f, current_steps=10, mtbf_source="test")
    assert a.options and [o.interval_steps for o in a.options] == sorted({o.interval_steps for o in a.options})
    for o in a.options:
        assert o.interval_s == o.interval_steps * step
        assert o.goodput == pytest.approx(model(o.interval_s, c, m, r), rel=1e-12)
    assert any(o.label.startswith("current") or "current" in o.label for o in a.options)


@pytest.mark.parametrize(("c", "m", "r", "step"), CASES)
def test_recommended_interval_is_where_the_model_peaks(c, m, r, step) -> None:
    f = Figures(save_s=c, mtbf_s=m, recovery_s=r, step_s=step)
    a = advise(f, current_steps=10, mtbf_source="test")
    # The continuous optimum by a fine search of the model, against Daly's closed form.
    grid = [daly_s(f) * (0.5 + i / 20000) for i in range(20001)]
    peak = max(grid, key=lambda t: model(t, c, m, r))
    assert daly_s(f) == pytest.approx(peak, rel=0.01)
    # In whole steps (what a user sets), the recommendation is the best or next to it, and no
    # compared option beats it by more than the rounding costs.
    k = best_steps(f, 10 * a.recommended_steps + 10)
    assert abs(a.recommended_steps - k) <= 1
    rec = model(a.recommended_steps * step, c, m, r)
    assert rec >= max(o.goodput for o in a.options) - 1e-3
    assert rec > model(10 * a.recommended_steps * step, c, m, r)  # far too rare saves lose


def test_young_is_the_first_order_term() -> None:
    f = Figures(save_s=2.0, mtbf_s=7200.0, recovery_s=0.0, step_s=1.0)
    assert young_s(f) == math.sqrt(2 * 2.0 * 7200.0)
    x = 2.0 / (2 * 7200.0)
    assert daly_s(f) == pytest.approx(young_s(f) * (1 + math.sqrt(x) / 3 + x / 9) - 2.0)
    assert abs(daly_s(f) - young_s(f)) / young_s(f) < 0.01  # C << M: the two agree


def test_save_longer_than_twice_the_mtbf_checkpoints_every_mtbf() -> None:
    f = Figures(save_s=100.0, mtbf_s=40.0, recovery_s=1.0, step_s=1.0)
    assert daly_s(f) == 40.0


def test_goodput_is_zero_without_work_and_figures_are_checked() -> None:
    f = Figures(save_s=1.0, mtbf_s=100.0, recovery_s=1.0, step_s=1.0)
    assert goodput(0.0, f) == 0.0
    with pytest.raises(ConfigError, match="M > 0"):
        Figures(save_s=1.0, mtbf_s=0.0, recovery_s=1.0, step_s=1.0)


def test_advice_on_a_real_run_uses_its_measured_figures() -> None:
    """The real three-fault run (tests/data/report/three_faults, from the local cluster)."""
    d = load_run(THREE_FAULTS)
    assert d.advice is not None
    f = d.advice.figures
    blocked = [s["blocking_s"] for s in d.saves if s["blocking_s"] is not None]
    assert f.save_s == pytest.approx(sum(blocked) / len(blocked))
    held = d.report.wall_s - d.breakdown["queue"]
    assert f.mtbf_s == pytest.approx(held / 3)
    restores = [x.restore_s for x in d.report.failures]
    assert f.recovery_s == pytest.approx(sum(restores) / 3)  # type: ignore[arg-type]
    for o in d.advice.options:
        assert o.goodput == pytest.approx(model(o.interval_s, f.save_s, f.mtbf_s, f.recovery_s), rel=1e-12)
    assert abs(d.advice.recommended_steps - best_steps(f, 200)) <= 1
    assert "current" in " ".join(o.label for o in d.advice.options if o.interval_steps == 10)


def test_mtbf_from_the_command_line_wins() -> None:
    d = load_run(THREE_FAULTS, mtbf_h=2.0)
    assert d.advice is not None and d.advice.figures.mtbf_s == 7200.0
    assert d.advice.mtbf_source.startswith("--mtbf-h 2")
