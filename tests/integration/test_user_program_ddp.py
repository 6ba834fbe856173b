"""A user program's own checkpoints count as progress, on the real local Slurm cluster.

ddp_user_program.py is a plain DDP script (gloo, 2 nodes x 2 ranks) that saves and resumes its
own torch.save checkpoints and reports them with slurmkit.userapi.report_checkpoint. With
``supervisor.max_restarts_without_progress=1`` one of its ranks is SIGKILLed three times, each
time after the program checkpointed again in the new generation: the run must complete (not stop
with 93), every failure restarted, the program resumed from its own checkpoints and ended where
an uninterrupted run of the same program ends (to float rounding). The same program without
report_checkpoint is stopped as a crash loop (93) at the first kill: only the report made the
difference. Read through ``job.progress_pattern`` and ``job.checkpoint_glob`` instead (no
userapi call at all, not even a beat), its own saves count again, its step and loss reach
status, and a rank that hangs without being stopped is found by the clock of rank 0's step
lines (slurmkit.launch.monitor.RankMonitor.on_progress) and restarted.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Callable

import pytest

from slurmkit.ledger.ledger import read_ledger
from slurmkit.ledger.summary import summarize
from slurmkit.runview import build_view
from slurmkit.slurm.client import SlurmClient
from slurmkit.slurm.runner import SubprocessRunner
from slurmkit.train.heartbeat import local_heartbeat_path
from slurmkit.userapi import marker_path
from tests.integration.faults import diagnose, events, finish, mark_fault, rank_pid, submit, wait_while_running
from tests.integration.helpers import printed_steps, slurm_env, submitter_uid

pytestmark = pytest.mark.integration
PROGRAM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ddp_user_program.py")
STEPS, EVERY, DELAY_S = 80, 5, 0.05
KILLS = (3, 1)  # ranks, one per generation: more than max_restarts_without_progress=1


def _args(name: str, mode: str, delay_s: float = DELAY_S, steps: int = STEPS) -> list[str]:
    return ["+exp=tiny", f"job.name={name}", "job.nodes=2", "job.ranks_per_node=2",
            f"job.command=[python,{PROGRAM},'{steps}','{EVERY}','{delay_s}',{mode}]",
            "supervisor.max_restarts_without_progress=1", "supervisor.heartbeat_timeout_s=20",
            "supervisor.heartbeat_ledger_interval_s=2"]


def _read(path: str) -> dict | None:
    try:
        with open(path) as f:
            value = json.load(f)
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _beat(run_dir: str, rank: int, since: float) -> dict | None:
    """The rank's node-local heartbeat (the emulated nodes share this machine's /dev/shm), if
    written by this test's job (a file from an earlier session at the same path is older)."""
    beat = _read(local_heartbeat_path(run_dir, rank, uid=submitter_uid()))
    if beat is None or not isinstance(beat.get("time"), (int, float)) or beat["time"] < since:
        return None
    return beat


def _resumed_steps(run_dir: str) -> list[int]:
    out = []
    for rank in range(4):
        path = os.path.join(run_dir, "logs", f"rank{rank}.log")
        text = open(path, errors="replace").read() if os.path.exists(path) else ""
        out += [int(s) for s in re.findall(r"resumed at step (\d+) from ", text)]
    return out


def test_a_user_program_that_reports_its_checkpoints_survives_more_crashes_than_the_limit(
        cluster_env, tmp_path) -> None:
    env = slurm_env(cluster_env)
    since = time.time()
    job, run_dir = submit(_args("user-ddp", "report"), env, str(tmp_path))
    marker = marker_path(run_dir)
    killed_gen = -1
    for rank in KILLS:
        # The program checkpointed (and reported) in a generation after the last kill, and the
        # rank to kill beats in that generation: its pid is the live one.
        def ready(rank: int = rank, after: int = killed_gen) -> tuple[int, int, int] | None:
            m = _read(marker)
            if m is None or not isinstance(m.get("generation"), int) or m["generation"] <= after:
                return None
            beat = _beat(run_dir, rank, since)
            if beat is None or beat.get("generation") != m["generation"]:
                return None
            return int(m["generation"]), int(m["step"]), int(beat["pid"])
        gen, step, pid = wait_while_running(f"a checkpoint reported after generation {killed_gen} and rank {rank}'s beat",
                               ready, job, run_dir, env)
        mark_fault(run_dir, "sigkill", rank=rank, step=step)
        os.kill(pid, signal.SIGKILL)
        killed_gen = gen
    state = finish(job, env, timeout_s=180, run_dir=run_dir)
    assert state == "COMPLETED", f"job {job} ended {state}\n{diagnose(run_dir, job, env)}"
    failures = events(run_dir, "failure")
    assert [(f["cls"], f["rank"]) for f in failures] == [("rank_crash", r) for r in KILLS], failures
    assert [d["action"] for d in events(run_dir, "decision")] == ["restart"] * len(KILLS)
    assert len({e["generation"] for e in events(run_dir, "ranks_started")}) == len(KILLS) + 1
    end = events(run_dir, "end")[-1]
    assert end["status"] == "completed" and end["exit_code"] == 0, end
    # The reports reached the ledger through rank 0's spool, as the program's own tier.
    saved = [e for e in events(run_dir, "ckpt_saved") if e.get("tier") == "user"]
    assert saved and max(e["step"] for e in saved) == STEPS, saved
    assert all(e["source"] == "rank0" and e["uri"].endswith(f"step_{e['step']:08d}.pt") for e in saved)
    # The program resumed from its own checkpoints, every rank after every kill, and ended
    # where an uninterrupted run of it ends.
    resumed = _resumed_steps(run_dir)
    assert len(resumed) == 4 * len(KILLS) and min(resumed) > 0, resumed
    out = _read(os.path.join(run_dir, "user_final.json"))
    assert out is not None and out["step"] == STEPS and out["resumed_from"] > 0, out
    # Equal to rounding, not bit for bit: gloo sums the ranks' gradients in its own order (and a
    # fresh DDP's first step packs its bucket in another order than one past its rebuild; a
    # resumed 4-rank run measured 1.2e-7 from an uninterrupted one). A resume without the
    # optimizer's momentum misses by 0.1.
    from tests.integration.ddp_user_program import uninterrupted_params

    ref = uninterrupted_params(STEPS, 4)
    worst = max(abs(a - b) for a, b in zip(out["params"], ref, strict=True))
    assert worst < 1e-5, f"the resumed run diverged from the uninterrupted one by {worst}"
    # What status shows: the program's own total (set_total_steps, not +exp=tiny's train.steps)
    # and the loss rank 0 reported at the step of the newest sample that carries it.
    view = build_view(run_dir, list(read_ledger(os.path.join(run_dir, "ledger.jsonl"))), full=True)
    assert view.total_steps == STEPS and view.step is not None, view
    sampled = [e for e in events(run_dir, "heartbeat") if e.get("metrics")]
    assert sampled and all(e["total_steps"] == STEPS for e in sampled), sampled[-3:]
    last = sampled[-1]
    assert view.loss is not None and view.loss == last["metrics"]["loss"], (view.loss, last)
    assert view.loss == _printed_losses(run_dir)[last["generation"], last["steps"]["0"]], (view.loss, last)


def test_the_same_program_without_reports_is_stopped_as_a_crash_loop(cluster_env, tmp_path) -> None:
    env = slurm_env(cluster_env)
    since = time.time()
    job, run_dir = submit(_args("user-ddp-silent", "no-report"), env, str(tmp_path))
    ckpt_dir = os.path.join(run_dir, "user_ckpt")

    def saved_twice() -> int | None:  # the program checkpointed on its own, twice, unreported
        names = sorted(n for n in os.listdir(ckpt_dir) if n.endswith(".pt")) if os.path.isdir(ckpt_dir) else []
        beat = _beat(run_dir, 3, since)
        return int(beat["pid"]) if len(names) >= 2 and beat is not None else None
    pid = wait_while_running("two checkpoints of the program", saved_twice, job, run_dir, env)
    mark_fault(run_dir, "sigkill", rank=3)
    os.kill(pid, signal.SIGKILL)
    assert finish(job, env, timeout_s=180, run_dir=run_dir) == "FAILED", diagnose(run_dir, job, env)
    rows = [r for r in SlurmClient(SubprocessRunner(env=env)).sacct(job) if not r.is_step]
    assert rows[-1].exit_code == 93, rows
    end = events(run_dir, "end")[-1]
    assert end["status"] == "stopped" and end["exit_code"] == 93 and "crash loop" in end["reason"], end
    assert not os.path.exists(marker_path(run_dir))
    assert not os.path.exists(os.path.join(run_dir, "user_final.json"))
    # No total was reported: unknown, not the 60 steps of the +exp=tiny preset's train.steps
    view = build_view(run_dir, list(read_ledger(os.path.join(run_dir, "ledger.jsonl"))), full=True)
    assert view.total_steps is None and view.loss is None and view.step is not None, view


def _printed_losses(run_dir: str) -> dict[tuple[int, int], float]:
    """(generation, step) -> the loss rank 0 printed."""
    return {k: loss for k, (loss, _) in printed_steps(run_dir).items()}


LATER_KILLS = (1, 0, 3)  # ranks, in generations 2-4, after the kill and the hang: five faults in all


def test_the_program_read_through_a_pattern_and_a_glob_survives_five_faults_without_reports(
        cluster_env, tmp_path) -> None:
    env = slurm_env(cluster_env)
    # 0.25 s steps: the agent lists the program's folder every 5 s, and each fault comes after
    # it recorded a save in that generation, well before the program's 200 steps are done
    args = [*_args("user-ddp-adapted", "silent", delay_s=0.25, steps=200),
            "job.progress_pattern='^generation \\d+ step (?P<step>\\d+) loss (?P<loss>[-+0-9.e]+) at '",
            "job.checkpoint_glob='user_ckpt/step_{step}.pt'"]
    job, run_dir = submit(args, env, str(tmp_path))

    def credited(after: int) -> Callable[[], int | None]:
        """A save of the program's past step ``after`` recorded by its adapter: its step."""
        def check() -> int | None:
            m = _read(marker_path(run_dir))
            ok = m is not None and m.get("by") == "adapter:none" and int(m.get("step", -1)) > after
            return int(m["step"]) if ok and m is not None else None
        return check

    def resumed_in(generation: int) -> Callable[[], int | None]:
        """The step generation ``generation`` trains from, once its first step line came."""
        return lambda: next((int(e["step"]) for e in events(run_dir, "train_started")
                             if e["generation"] == generation), None)
    wait_while_running("a save of the program's recorded by its adapter", credited(0), job, run_dir, env)
    mark_fault(run_dir, "sigkill", rank=3)
    os.kill(rank_pid(run_dir, 3), signal.SIGKILL)
    # generation 1: once it trains and saved again, rank 2 sleeps inside a step (no process
    # stopped, no beat ever)
    again = wait_while_running("generation 1 training", resumed_in(1), job, run_dir, env)
    wait_while_running("a save in generation 1", credited(again), job, run_dir, env)
    mark_fault(run_dir, "hang", rank=2)
    with open(os.path.join(run_dir, "hang_rank2"), "w"):
        pass
    for gen, rank in enumerate(LATER_KILLS, start=2):  # then three kills, each after a save of its generation
        again = wait_while_running(f"generation {gen} training", resumed_in(gen), job, run_dir, env, timeout_s=180)
        wait_while_running(f"a save in generation {gen}", credited(again), job, run_dir, env)
        mark_fault(run_dir, "sigkill", rank=rank)
        os.kill(rank_pid(run_dir, rank), signal.SIGKILL)
    state = finish(job, env, timeout_s=240, run_dir=run_dir)
    story = diagnose(run_dir, job, env)
    assert state == "COMPLETED", f"job {job} ended {state}\n{story}"
    assert os.path.exists(os.path.join(run_dir, "hang_rank2.taken")), story  # the rank did hang
    # max_restarts_without_progress=1 and no report: the saves the glob found were the progress
    failures = events(run_dir, "failure")
    assert [(f["cls"], f["rank"], f["generation"]) for f in failures] == \
        [("rank_crash", 3, 0), ("hang", 2, 1)] + [("rank_crash", r, g) for g, r in enumerate(LATER_KILLS, start=2)], story
    # the hang was named by the stacks (rank 2 outside any collective) and timed by rank 0's
    # printed steps, nothing else beating: generation 1 was stopped heartbeat_timeout_s (20 s, more
    # than three of its gaps between lines) after rank 0's last line, long before the program's
    # own 60 s gloo timeout would have ended it as a crash
    assert "not inside a collective" in failures[1]["evidence"], failures[1]
    printed = printed_steps(run_dir)
    last_line_t = max(t for (g, _), (_, t) in printed.items() if g == 1)
    (stopping,) = [e for e in events(run_dir, "state") if e["new"] == "stopping" and e["why"] == "generation 1"]
    assert 20.0 <= stopping["t"] - last_line_t < 40.0, (stopping, last_line_t)
    assert [d["action"] for d in events(run_dir, "decision")] == ["restart"] * 5, story
    saved_events = [e for e in events(run_dir, "ckpt_saved") if e.get("tier") == "user"]
    assert all(e["uri"].endswith(f"step_{e['step']:08d}.pt") for e in saved_events), saved_events
    marker = _read(marker_path(run_dir))
    assert marker is not None and marker["by"] == "adapter:none" and \
        marker["step"] == max(e["step"] for e in saved_events)
    # the report, as for the reference trainer: per failure, the steps lost are what the log
    # shows (the last step rank 0 printed in that generation less the step the next resumed
    # from), and the goodput is within 5 points of the one computed from the logged step times
    report = summarize(read_ledger(os.path.join(run_dir, "ledger.jsonl")))
    last_of = {g: max(s for gg, s in printed if gg == g) for g, _ in printed}
    first_of = {g: min(s for gg, s in printed if gg == g) for g, _ in printed}
    with open(os.path.join(run_dir, "logs", "rank0.log"), errors="replace") as f:
        resumed = [0] + [int(x) for x in re.findall(r"^rank 0 \(local 0\): resumed at step (\d+) from ", f.read(), re.M)]
    n = 6
    assert sorted(last_of) == list(range(n)) and len(resumed) >= n, (last_of, resumed, story)
    assert [f.steps_lost for f in report.failures] == [last_of[g] - resumed[g + 1] for g in range(n - 1)], \
        (report.failures, last_of, resumed)
    kept = [min(last_of[g], resumed[g + 1]) if g < n - 1 else last_of[g] for g in range(n)]
    productive = sum(printed.get((g, kept[g]), printed[g, first_of[g]])[1] - printed[g, first_of[g]][1]
                     for g in range(n))
    assert report.goodput is not None and abs(report.goodput - productive / report.wall_s) <= 0.05, \
        (report.goodput, productive, report.wall_s)
    # status: the step and loss rank 0 printed, from the agent's samples; no total (none said)
    view = build_view(run_dir, list(read_ledger(os.path.join(run_dir, "ledger.jsonl"))), full=True)
    sampled = [e for e in events(run_dir, "heartbeat") if e.get("metrics")]
    assert sampled and view.total_steps is None, (view, sampled[-3:])
    last = sampled[-1]
    assert view.loss == last["metrics"]["loss"] == _printed_losses(run_dir)[last["generation"], last["steps"]["0"]]
