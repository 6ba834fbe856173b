"""The campaign planner: a seed always gives the same plan, plans keep their constraints, and
the seeds cover the whole implemented menu."""

from __future__ import annotations

import os

import pytest

from testkit.chaos.campaign import parser
from testkit.chaos.menu import AFTER_SAVE, DURING_RESTART, IMPLEMENTED, MENU, item, pairs
from testkit.chaos.plan import (
    NODE_BUDGET_KINDS,
    SUSPECT_KINDS,
    TAKES_A_SAVE,
    RunPlan,
    armed_spec,
    draw_plan,
    marker_name,
    replay_command,
)
from slurmkit.train.faults import FaultInjector, parse_faults

SEEDS = range(100)


def test_a_seed_gives_the_same_plan_every_time() -> None:
    for seed in (0, 1, 7, 123456):
        assert draw_plan(seed).to_json() == draw_plan(seed).to_json()
    assert len({draw_plan(s).to_json() for s in range(30)}) == 30


def test_plan_round_trips_through_json() -> None:
    plan = draw_plan(5, extra=("train.lr=0.001",))
    assert RunPlan.from_json(plan.to_json()) == plan


@pytest.mark.parametrize("seed", SEEDS)
def test_plans_keep_their_constraints(seed: int) -> None:
    _check_constraints(draw_plan(seed, steps=32, interval=4))


def test_the_50_seed_campaigns_plans_keep_their_constraints() -> None:
    # seed 50 of that campaign (28 steps) planned two NCCL aborts on slot 0 and two node
    # losses: three exclusions for a 2-node job on 4 nodes, and a stop with 93
    for seed in range(1, 51):
        _check_constraints(draw_plan(seed, steps=28, interval=4))


def _check_constraints(plan: RunPlan) -> None:
    assert 3 <= len(plan.faults) <= 6
    # a kill inside a save uses the save it hits as well, a time-limit warning its stop checkpoint
    assert sum(f.saves + (f.moment == AFTER_SAVE and f.kind in TAKES_A_SAVE) for f in plan.faults) <= 32 // 4 - 1
    node_faults = sum(f.kind in NODE_BUDGET_KINDS for f in plan.faults)
    # a second NCCL abort or hang on a train slot excludes its node too (the repeat rule)
    slots = [f.target // plan.ranks_per_node for f in plan.faults if f.kind in SUSPECT_KINDS]
    repeats = len(slots) - len(set(slots))
    assert node_faults + repeats <= (1 if plan.spare_nodes else 2), plan
    for i, f in enumerate(plan.faults):
        assert (f.kind, f.moment) in pairs()
        if f.moment == AFTER_SAVE:
            assert f.saves >= 1 and 1 <= f.offset < plan.interval
        else:
            prev = plan.faults[i - 1] if i else None
            assert prev is not None and prev.moment != DURING_RESTART and item(prev.kind).restarts
        if item(f.kind).target == "rank":
            assert 0 <= f.target < plan.world
        if f.kind == "two_at_once":
            assert f.second // plan.ranks_per_node != f.target // plan.ranks_per_node


def test_the_seeds_cover_every_implemented_pair_of_the_menu() -> None:
    seen = {(f.kind, f.moment) for s in range(40) for f in draw_plan(s).faults}
    assert seen == set(pairs())
    assert {m.name for m in IMPLEMENTED} == {k for k, _ in seen}
    assert any(draw_plan(s).spare_nodes for s in range(40))


def test_the_whole_menu_of_the_issue_is_driven() -> None:
    """Issue 14's menu: a kill inside a save, an S3 outage during a promotion and a full NVMe
    tier are driven for real now; nothing is left on the menu undone."""
    assert all(m.implemented for m in MENU)
    for name in ("rank_sigkill_during_save", "s3_down_during_promotion", "nvme_full"):
        assert (name, AFTER_SAVE) in pairs()
    assert not item("nvme_full").restarts and not item("s3_down_during_promotion").restarts


def test_no_fault_is_planned_inside_the_restart_of_a_fault_that_restarts_nothing() -> None:
    for s in range(200):
        faults = draw_plan(s).faults
        for prev, f in zip(faults, faults[1:]):
            if prev.kind in ("nvme_full", "s3_down_during_promotion"):
                assert f.moment == AFTER_SAVE, (s, prev, f)


def test_items_not_built_say_why() -> None:
    missing = [m for m in MENU if not m.implemented]
    assert all(m.why_not and not m.moments for m in missing)
    assert not any(k in {m.name for m in missing} for k, _ in pairs())


def test_too_few_checkpoints_for_the_faults_is_refused() -> None:
    with pytest.raises(ValueError, match="raise steps to 28"):
        draw_plan(1, steps=20, interval=4)


def test_replay_command_draws_the_same_plan() -> None:
    plan = draw_plan(17, steps=40, interval=5, extra=("train.lr=0.001",))
    argv = replay_command(plan).split()
    assert argv[0] == "tools/chaos"
    a = parser().parse_args(argv[1:])
    again = draw_plan(a.seed, steps=a.steps, interval=a.interval, min_faults=a.min_faults,
                      max_faults=a.max_faults, extra=tuple(a.override))
    assert again == plan


def test_armed_nccl_faults_are_disarmed_by_their_markers_and_armed_by_removing_one(tmp_path) -> None:
    """The real trainer's injector: a marker present means the once-fault already fired."""
    plan = next(p for p in map(draw_plan, SEEDS) if any(f.kind == "nccl_abort" for f in p.faults))
    rank = next(f.target for f in plan.faults if f.kind == "nccl_abort")
    faults = parse_faults(armed_spec(plan))
    assert {f.step for f in faults if f.rank == rank} == set(range(1, plan.steps + 1))
    marker_dir = str(tmp_path)
    for f in faults:
        open(os.path.join(marker_dir, marker_name(f.rank, f.step)), "w").close()
    inj = FaultInjector(faults, rank=rank, marker_dir=marker_dir)
    for step in range(1, plan.steps + 1):
        inj.before_step(step)  # every fault disarmed: no abort
    os.unlink(os.path.join(marker_dir, marker_name(rank, 9)))
    armed = [f for f in inj.faults if f.step == 9]
    assert [inj._claim(f) for f in armed] == [True]  # would fire before step 9 ...
    assert os.path.exists(os.path.join(marker_dir, marker_name(rank, 9)))  # ... and marks itself


def test_a_plan_without_nccl_faults_arms_nothing() -> None:
    plan = next(p for p in map(draw_plan, SEEDS) if not any(f.kind == "nccl_abort" for f in p.faults))
    assert armed_spec(plan) == ""
