"""Straggler scoring (slurmkit.supervise.stragglers): tables of rounds in, named nodes out."""

from __future__ import annotations

import random

import pytest

from slurmkit.supervise.stragglers import NodeWindow, StragglerDetector, score, score_round

NODES = ("n0", "n1", "n2", "n3")
RANKS_PER_NODE = 2


def windows(seq: int, own: dict[str, float], step: int | None = None) -> dict[str, NodeWindow]:
    """One round: every node's ranks at the given own time (seconds)."""
    return {n: NodeWindow(n, 0, seq, step if step is not None else 10 * seq,
                          {i * RANKS_PER_NODE + j: t for j in range(RANKS_PER_NODE)},
                          {"data": 0.01, "compute": t - 0.01, "comm": 0.02, "ckpt": 0.0})
            for i, (n, t) in enumerate(own.items())}


def run(rounds: list[dict[str, float]], *, threshold: float = 0.7, k: int = 3) -> list[tuple[int, str]]:
    """(round index, node) for every node named while the rounds are fed in order."""
    det = StragglerDetector(threshold=threshold, windows=k)
    named = []
    for i, own in enumerate(rounds, start=1):
        named += [(i, x.node) for x in det.observe(windows(i, own))]
    return named


CLEAN = {n: 0.1 for n in NODES}
SLOW_N2 = {**CLEAN, "n2": 0.2}  # score 0.5 against a median of 0.1


@pytest.mark.parametrize("rounds, k, expected", [
    pytest.param([CLEAN] * 10, 3, [], id="clean run names nobody"),
    pytest.param([SLOW_N2] * 5, 3, [(3, "n2")], id="slow node named after exactly k windows"),
    pytest.param([CLEAN] * 2 + [SLOW_N2] * 6, 3, [(5, "n2")], id="slow from the third window on"),
    pytest.param([SLOW_N2] * 5, 1, [(1, "n2")], id="k=1 names at once"),
    pytest.param([SLOW_N2, CLEAN] * 5, 2, [], id="slow every other window never names"),
    pytest.param([SLOW_N2, SLOW_N2, CLEAN, SLOW_N2, SLOW_N2, CLEAN], 3, [],
                 id="two slow then one normal resets the count"),
    pytest.param([CLEAN, {**CLEAN, "n1": 0.5}, CLEAN, CLEAN], 3, [], id="one slow window names nobody"),
    pytest.param([{**CLEAN, "n1": 0.13}] * 6, 3, [], id="30% slower is above 0.7: not named"),
    pytest.param([{**CLEAN, "n1": 0.15, "n3": 0.3}] * 4, 3, [(3, "n3")],
                 id="only the node below the threshold"),
])
def test_naming(rounds, k, expected) -> None:
    assert run(rounds, k=k) == expected


def test_a_node_is_named_once_with_its_figures() -> None:
    det = StragglerDetector(threshold=0.7, windows=2)
    got = [x for i in range(1, 6) for x in det.observe(windows(i, SLOW_N2))]
    assert [x.node for x in got] == ["n2"]
    x = got[0]
    assert x.score == pytest.approx(0.5) and x.own_s == pytest.approx(0.2)
    assert x.job_median_s == pytest.approx(0.1) and x.windows == 2 and x.step == 20
    assert x.rank in (4, 5) and x.sections["compute"] == pytest.approx(0.19)


def test_a_round_waits_for_every_node_to_report_a_new_window() -> None:
    det = StragglerDetector(threshold=0.7, windows=2)
    assert det.observe(windows(1, SLOW_N2)) == []
    stale = {**windows(2, SLOW_N2), "n0": windows(1, SLOW_N2)["n0"]}  # n0 has not moved on
    assert det.observe(stale) == [] and det.rounds == 1
    assert det.observe(stale) == [] and det.rounds == 1  # read again: still the same round
    assert [x.node for x in det.observe(windows(2, SLOW_N2))] == ["n2"] and det.rounds == 2


def test_one_slow_rank_makes_its_node_slow() -> None:
    w = windows(1, CLEAN)
    w["n1"] = NodeWindow("n1", 0, 1, 10, {2: 0.1, 3: 0.25})
    r = score_round(w)
    assert r is not None and r.node_scores["n1"] == pytest.approx(0.4)
    assert r.rank_scores[2] == pytest.approx(1.0) and r.node_scores["n0"] == pytest.approx(1.0)


@pytest.mark.parametrize("median, own, expected", [
    (0.1, 0.1, 1.0), (0.1, 0.2, 0.5), (0.1, 0.05, 2.0), (0.1, 0.0, 1.0), (0.0, 0.1, 1.0)])
def test_score(median, own, expected) -> None:
    assert score(median, own) == pytest.approx(expected)


def test_fewer_than_two_ranks_scores_nothing() -> None:
    assert score_round({"n0": NodeWindow("n0", 0, 1, 1, {0: 0.1})}) is None


def test_clean_noisy_run_names_nobody() -> None:
    """500 rounds of 64 nodes, own times with 10% Gaussian noise and a 3x outlier now and then
    (a slow step moves one window's sample, rarely its median)."""
    rng = random.Random(7)
    det = StragglerDetector(threshold=0.7, windows=3)
    nodes = [f"n{i}" for i in range(64)]
    named = []
    for seq in range(1, 501):
        own = {n: max(0.01, rng.gauss(0.1, 0.01)) * (3 if rng.random() < 0.002 else 1) for n in nodes}
        named += det.observe(windows(seq, own))
    assert named == [] and det.rounds == 500


@pytest.mark.parametrize("threshold, k", [(0.0, 3), (1.0, 3), (0.7, 0)])
def test_bad_settings_are_refused(threshold, k) -> None:
    with pytest.raises(ValueError):
        StragglerDetector(threshold=threshold, windows=k)


@pytest.mark.parametrize("fields, fragment", [
    ({"straggler_action": "kill"}, "one of report, replace, off"),
    ({"straggler_threshold": 1.0}, "between 0 and 1"),
    ({"straggler_windows": 0}, "at least 1 window"),
    ({"straggler_window_samples": 2}, "at least 3 samples"),
])
def test_health_straggler_settings_are_checked(fields, fragment) -> None:
    from slurmkit.errors import ConfigError
    from slurmkit.config.health import HealthConfig

    with pytest.raises(ConfigError, match=fragment):
        HealthConfig(**fields)


def test_health_straggler_replace_is_accepted() -> None:
    from slurmkit.config.health import HealthConfig

    assert HealthConfig(straggler_action="replace").straggler_action == "replace"


def test_health_straggler_defaults() -> None:
    from slurmkit.config.health import HealthConfig

    h = HealthConfig()
    assert (h.straggler_action, h.straggler_threshold, h.straggler_windows, h.straggler_window_samples) == (
        "report", 0.7, 3, 10)


GOOD_JSON = {"gen": 1, "seq": 2, "step": 30, "ranks": {"4": 0.2, "5": 0.21},
             "sections": {"data": 0.01, "compute": 0.19, "comm": 0.05, "ckpt": 0.0}}


@pytest.mark.parametrize("raw", [
    None, [], "x", {**GOOD_JSON, "ranks": [0.2]}, {**GOOD_JSON, "sections": None},
    {**GOOD_JSON, "ranks": {"four": 0.2}}, {**GOOD_JSON, "ranks": {"-1": 0.2}},
    {**GOOD_JSON, "ranks": {"4": -0.2}}, {**GOOD_JSON, "ranks": {"4": True}},
    {**GOOD_JSON, "ranks": {"4": "0.2"}}, {**GOOD_JSON, "seq": "2"}, {**GOOD_JSON, "gen": None},
    {**GOOD_JSON, "step": 1.5}, {**GOOD_JSON, "sections": {"compute": -1}},
    {**GOOD_JSON, "ranks": {str(r): 0.1 for r in range(1025)}},
])
def test_a_malformed_window_is_refused(raw) -> None:
    from slurmkit.supervise.stragglers import window_from_json

    with pytest.raises(ValueError):
        window_from_json("n1", raw)


def test_a_window_round_trips_through_json() -> None:
    from slurmkit.supervise.stragglers import window_from_json, window_to_json

    w = window_from_json("n1", GOOD_JSON)
    assert (w.node, w.generation, w.seq, w.step, dict(w.ranks)) == ("n1", 1, 2, 30, {4: 0.2, 5: 0.21})
    assert window_from_json("n1", window_to_json(w)) == w
