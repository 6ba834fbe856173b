"""A real third-party program on the real local Slurm cluster: a PyTorch Lightning ``Trainer``.

lightning_user_program.py (Lightning from PyPI, DDP over gloo, ``SLURMEnvironment(auto_requeue=
False)``, no slurmkit import) runs through ``job.command`` on 2 nodes x 2 ranks. Lightning must
see the world slurmkit describes (world size 4, global ranks 0-3, node rank and local rank of
each, one gloo group of all four). With ``supervisor.max_restarts_without_progress=1``, a rank is
SIGKILLed after the program saved a Lightning checkpoint, five times, in five generations: the saves
reported by slurmkit's Lightning callback (which Lightning loads from slurmkit's entry point;
the program does not name it) are the progress that keeps the run going, each new generation
resumes from the program's own newest checkpoint, and the job completes. What status and the
report show comes from the same callback: the step, the loss and the length of the fit, the steps
each failure lost (as the program's own log shows them) and a goodput within 5 points of the one
computed from the program's logged step times.
"""

from __future__ import annotations

import json
import os
import re
import signal
from collections.abc import Callable

import pytest

from slurmkit.ledger.ledger import read_ledger
from slurmkit.ledger.summary import summarize
from slurmkit.runview import build_view
from slurmkit.userapi import marker_path
from tests.integration.faults import (completed_after_restarts, diagnose, events, mark_fault, submit,
                                      wait_while_running)
from tests.integration.helpers import printed_steps, slurm_env

pytestmark = pytest.mark.integration
PROGRAM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lightning_user_program.py")
OUT = "lightning"  # the program's directory, relative to its working directory (the run directory)
STEPS, EVERY, DELAY_S = 100, 5, 0.1
# ranks, one per generation: five failures, max_restarts_without_progress=1. Not rank 0: the
# callback reports a save from rank 0 after Lightning wrote it, and a rank 0 killed in between
# leaves a save on disk that no report names (the next generation still resumes from it).
KILLS = (3, 1, 2, 1, 3)
CKPT_RE = re.compile(r"step-(\d{6})\.ckpt")


def _require_lightning() -> None:
    try:
        import lightning  # noqa: F401
    except ImportError as exc:
        pytest.fail(f"lightning is not importable ({exc}): this test runs a real Lightning Trainer. "
                    "Install the dev extras: pip install -e '.[dev]' (tools/setup does)")


def _records(run_dir: str) -> list[dict]:
    """Every rank record the program wrote so far (one per rank process)."""
    d = os.path.join(run_dir, OUT, "ranks")
    out = []
    for name in sorted(os.listdir(d)) if os.path.isdir(d) else []:
        if name.endswith(".json"):
            with open(os.path.join(d, name)) as f:
                out.append(json.load(f))
    return out


def _by_generation(run_dir: str) -> dict[int, dict[int, dict]]:
    gens: dict[int, dict[int, dict]] = {}
    for r in _records(run_dir):
        gens.setdefault(int(r["generation"]), {})[int(r["global_rank"])] = r
    return gens


def _checkpoint_steps(run_dir: str) -> list[int]:
    d = os.path.join(run_dir, OUT, "ckpt")
    names = os.listdir(d) if os.path.isdir(d) else []
    return sorted(int(m.group(1)) for m in map(CKPT_RE.fullmatch, names) if m)


def _check_placement(ranks: dict[int, dict], run_dir: str) -> None:
    """Lightning's view of each rank is the one slurmkit describes: 2 nodes x 2 ranks, one group."""
    assert sorted(ranks) == [0, 1, 2, 3], ranks
    for rank, r in ranks.items():
        node_rank, local_rank = divmod(rank, 2)
        assert (r["world_size"], r["node_rank"], r["local_rank"]) == (4, node_rank, local_rank), r
        assert r["group_ranks"] == [0, 1, 2, 3] and r["dist_world_size"] == 4 and r["backend"] == "gloo", r
        assert r["environment"] == "SLURMEnvironment", r
    assert ranks[0]["node"] == ranks[1]["node"] != ranks[2]["node"] == ranks[3]["node"], ranks
    # The records came from the processes the agents started for this generation.
    gen = {r["generation"] for r in ranks.values()}
    started = {rank: pid for e in events(run_dir, "ranks_started") if {str(e["generation"])} == gen
               for rank, pid in zip(e["ranks"], e["pids"], strict=True)}
    assert started == {rank: r["pid"] for rank, r in ranks.items()}, (started, ranks)


def test_a_lightning_trainer_sees_its_world_survives_kills_past_the_limit_and_is_accounted(
        cluster_env, tmp_path) -> None:
    _require_lightning()
    env = slurm_env(cluster_env)
    job, run_dir = submit(["+exp=tiny", "job.name=lightning", "job.nodes=2", "job.ranks_per_node=2",
                           f"job.command=[python,{PROGRAM},'{STEPS}','{EVERY}','{DELAY_S}',{OUT}]",
                           "supervisor.max_restarts_without_progress=1", "supervisor.heartbeat_ledger_interval_s=2"],
                          env, str(tmp_path))

    def checkpointed_in(generation: int) -> Callable[[], tuple[dict[int, dict], int] | None]:
        """The generation's four rank records and a save the callback reported in it."""
        def check() -> tuple[dict[int, dict], int] | None:
            gens = _by_generation(run_dir)
            if max(gens, default=generation) > generation:  # a restart the test did not cause
                raise AssertionError(f"generations {sorted(gens)}\n{diagnose(run_dir, job, env)}")
            ranks = gens.get(generation, {})
            try:
                with open(marker_path(run_dir)) as f:
                    marker = json.load(f)
            except (OSError, ValueError):
                return None
            if len(ranks) < 4 or marker.get("generation") != generation:
                return None
            return ranks, int(marker["step"])
        return check
    generations: dict[int, dict[int, dict]] = {}
    for gen, rank in enumerate(KILLS):
        # Generous: the job may queue behind other sessions' jobs on the shared cluster.
        ranks, _ = wait_while_running(f"generation {gen}'s ranks and a save reported in it",
                                         checkpointed_in(gen), job, run_dir, env, timeout_s=300)
        generations[gen] = ranks
        mark_fault(run_dir, "sigkill", rank=rank)  # the step reached is the agents' to tell
        os.kill(ranks[rank]["pid"], signal.SIGKILL)

    story = completed_after_restarts(job, env, run_dir, KILLS, timeout_s=240)

    gens = _by_generation(run_dir)
    n = len(KILLS) + 1
    assert sorted(gens) == list(range(n)), {g: sorted(r) for g, r in gens.items()}
    for g, ranks in gens.items():
        _check_placement(ranks, run_dir)
    assert all(r["start_step"] == 0 and r["resumed_from"] is None for r in gens[0].values()), gens[0]
    # Every rank of each later generation resumed from the same Lightning checkpoint, the
    # program's newest, and started from its step, not from 0.
    starts = {0: 0}
    for g in range(1, n):
        resumed = {r["resumed_from"] for r in gens[g].values()}
        assert len(resumed) == 1 and None not in resumed, gens[g]
        (path,) = resumed
        m = CKPT_RE.fullmatch(os.path.basename(path))
        assert m and os.path.dirname(path) == os.path.join(run_dir, OUT, "ckpt"), path
        starts[g] = int(m.group(1))
        assert {r["start_step"] for r in gens[g].values()} == {starts[g]}, gens[g]
    assert [starts[g] for g in range(n)] == sorted(set(starts.values())) and starts[n - 1] < STEPS, starts
    with open(os.path.join(run_dir, OUT, "final.json")) as f:
        final = json.load(f)
    assert final["global_step"] == STEPS and final["world_size"] == 4, final

    # The callback's reports: the saves (rank 0, the program's tier) and the starts.
    saved = [e for e in events(run_dir, "ckpt_saved") if e.get("tier") == "user"]
    assert {e["step"] for e in saved} == set(_checkpoint_steps(run_dir)), (saved, _checkpoint_steps(run_dir))
    assert all(e["source"] == "rank0" and e["uri"].endswith(f"step-{e['step']:06d}.ckpt") for e in saved), saved
    assert [(e["generation"], e["step"]) for e in events(run_dir, "train_started")] == \
        [(g, starts[g]) for g in range(n)], events(run_dir, "train_started")
    # The report: the steps each failure lost are what the program's log shows (the last step
    # rank 0 printed in that generation less the step the next resumed from), and the goodput
    # is within 5 points of the one computed from the logged step times.
    printed = printed_steps(run_dir)
    last_of = {g: max(s for gg, s in printed if gg == g) for g, _ in printed}
    first_of = {g: min(s for gg, s in printed if gg == g) for g, _ in printed}
    assert sorted(last_of) == list(range(n)), (sorted(last_of), story)
    report = summarize(read_ledger(os.path.join(run_dir, "ledger.jsonl")))
    assert [f.steps_lost for f in report.failures] == [last_of[g] - starts[g + 1] for g in range(n - 1)], \
        (report.failures, last_of, starts)
    kept = [min(last_of[g], starts[g + 1]) for g in range(n - 1)] + [last_of[n - 1]]
    productive = sum(printed.get((g, kept[g]), printed[g, first_of[g]])[1] - printed[g, first_of[g]][1]
                     for g in range(n))
    assert report.goodput is not None and abs(report.goodput - productive / report.wall_s) <= 0.05, \
        (report.goodput, productive, report.wall_s)
    # status: the fit's length (max_steps, not +exp=tiny's train.steps), the step, and a loss
    # rank 0 printed: the callback reads the loss at most once a second (a GPU's would wait for
    # the device), so the newest sample's loss is that of one of the steps of its last second.
    view = build_view(run_dir, list(read_ledger(os.path.join(run_dir, "ledger.jsonl"))), full=True)
    assert view.total_steps == STEPS and view.step == STEPS, view
    sampled = [e for e in events(run_dir, "heartbeat") if e.get("metrics")]
    assert sampled and all(e["total_steps"] == STEPS for e in sampled), sampled[-3:]
    last = sampled[-1]
    assert view.loss is not None and view.loss == last["metrics"]["loss"], (view.loss, last)
    g, at = last["generation"], last["steps"]["0"]
    recent = [loss for (gg, step), (loss, t) in printed.items()
              if gg == g and step <= at and t >= printed[g, at][1] - 1.5]
    assert any(abs(view.loss - loss) < 1e-5 for loss in recent), (view.loss, last, recent)
