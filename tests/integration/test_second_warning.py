"""A second time-limit warning after a restart, on the real local cluster (issue 11).

One job of faults.COMMON lives through three allocations:
  1. the time-limit warning while it trains: the ranks save a stop checkpoint and exit 95,
     node 0 requeues the job;
  2. the requeued job resumes from that checkpoint; one rank is SIGKILLed (a rank crash:
     restart inside the allocation, generation 1), and once generation 1 trains a second
     time-limit warning comes: it must again be a checkpoint and a requeue, not a crash, not
     a restart and not exit 93;
  3. the job resumes from the second stop checkpoint and completes, bit for bit equal to the
     uninterrupted run (``reference``: tests/integration/conftest.py).

The warning is what Slurm's --signal=B:USR1@lead sends: SIGUSR1 to the batch shell only
(``scancel --signal=USR1 --batch``), which passes it on to the agents. Sent at a chosen moment
rather than by cutting the time limit (test_recovery_points.py), it costs no minute of waiting.

The ledger says what each allocation did; the assertions fail on the old behaviour, where the
signal kind outlived the warning: a later generation signalled (or refused) at its start, its
ranks dying while importing torch as rank crashes, restarts, and in the end exit 93.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable

import pytest

from tests.integration.faults import (
    COMMON, INTERVAL, STEPS, current_job, diagnose, events, final, finish, heartbeat_step, mark_fault,
    rank_pid, submit, wait_while_running,
)
from tests.integration.helpers import read_ledger, slurm_env

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def env(cluster_env) -> dict[str, str]:
    return slurm_env(cluster_env)


def allocations(run_dir: str) -> list[list[dict]]:
    """The ledger cut at each allocation_start (node 0 writes it first in every allocation)."""
    parts: list[list[dict]] = []
    for e in read_ledger(run_dir):
        if e["event"] == "allocation_start":
            parts.append([])
        if parts:
            parts[-1].append(e)
    return parts


def named(part: list[dict], name: str) -> list[dict]:
    return [e for e in part if e["event"] == name]


def warn(job: str, env: dict[str, str], run_dir: str, step: int) -> None:
    """The time-limit warning as Slurm sends it with --signal=B:USR1@lead: the batch shell only
    (of the job the run is in now: a requeue may have handed it to a successor job)."""
    mark_fault(run_dir, "time_limit_warning", step=step)
    job = current_job(run_dir, job)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=env, check=True,
                   capture_output=True, timeout=60)


def training_past(run_dir: str, rank: int, step: int) -> Callable[[], int | None]:
    """A check for wait_while_running: the rank's beat once it is past ``step``."""
    return lambda: (s if (s := heartbeat_step(run_dir, rank)) > step else None)


def test_a_second_warning_after_a_restart_checkpoints_and_requeues_again(env, reference, tmp_path) -> None:
    # No hang is part of this story: the heartbeat timeout is 30 s, not COMMON's 8 s, so that
    # a step slowed by a loaded CI machine is not taken for one (a hang's restart or requeue
    # would be one decision more); supervisor settings change no parameter of ``reference``.
    args = [a for a in COMMON if not a.startswith("supervisor.heartbeat_timeout_s=")]
    job, run_dir = submit([*args, "supervisor.heartbeat_timeout_s=30", "job.name=second-warning"],
                          env, str(tmp_path))

    def wait(what: str, check: Callable[[], int | None], timeout_s: float = 300) -> int:
        return wait_while_running(what, check, job, run_dir, env, timeout_s)

    # Allocation 1: the first warning while rank 0 trains.
    step = wait("training in allocation 1", training_past(run_dir, 0, 2))
    warn(job, env, run_dir, step)
    wait("the first requeue", lambda: len(events(run_dir, "requeue")) or None)

    # Allocation 2: resumed from the stop checkpoint; one rank killed once it trains on.
    resumed = wait("the resume in allocation 2",
                   lambda: (e[-1]["step"] if len(allocations(run_dir)) == 2
                            and (e := named(allocations(run_dir)[1], "train_resumed")) else None))
    step = wait("training in allocation 2", training_past(run_dir, 3, resumed + 2))
    mark_fault(run_dir, "sigkill", rank=3, step=step)
    os.kill(rank_pid(run_dir, 3), signal.SIGKILL)

    # Generation 1 of allocation 2 resumes and trains; then the second warning.
    again = wait("generation 1 resumed in allocation 2",
                 lambda: (e[-1]["step"] if (e := [r for r in named(allocations(run_dir)[-1], "train_resumed")
                                                  if r.get("generation") == 1]) else None))
    step = wait("generation 1 training", training_past(run_dir, 0, again + 1))
    assert not events(run_dir, "end"), diagnose(run_dir, job, env)
    warn(job, env, run_dir, step)

    state = finish(job, env, timeout_s=600, run_dir=run_dir)
    story = diagnose(run_dir, job, env)
    assert state == "COMPLETED", f"job {job} ended {state}\n{story}"
    assert final(run_dir)["step"] == STEPS and final(run_dir)["param_sha256"] == reference, story

    first, second, third = parts = allocations(run_dir)  # exactly three allocations
    # each requeue: the same job again (restart count + 1) or, where the cluster tracks job
    # processes in cgroups, a successor job that names this one (supervise/exits/successor.py)
    for before, after in zip(parts, parts[1:]):
        a, b = before[0], after[0]
        assert (b["job_id"], b["restart_count"]) == (a["job_id"], a["restart_count"] + 1) or \
            (b.get("predecessor") == a["job_id"] and b["restart_count"] == 0), (a, b, story)
    # Generations: one in the first and last allocation, two (the restart) in the second;
    # none started after a warning (its ranks would be signalled while importing torch).
    gens = [sorted({e["generation"] for e in named(p, "ranks_started")}) for p in parts]
    assert gens == [[0], [0, 1], [0]], (gens, story)
    for p in parts:
        for g in {e["generation"] for e in named(p, "ranks_started")}:
            ranks = sorted(r for e in named(p, "ranks_started") if e["generation"] == g for r in e["ranks"])
            assert ranks == [0, 1, 2, 3], (g, ranks, story)

    # The one failure is the SIGKILL: rank 3's crash in allocation 2, generation 0; the
    # warnings are no failure (no time_limit/preemption class, no crash, no 93).
    failures = events(run_dir, "failure")
    assert [(f["cls"], f["rank"], f["generation"]) for f in failures] == [("rank_crash", 3, 0)], story
    assert named(second, "failure") == failures, story
    assert [(d["action"], d["generation"]) for d in events(run_dir, "decision")] == [("restart", 0)], story
    assert not events(run_dir, "requeue_refused"), story
    # the successor hands over again: its own batch script is there (without it the second
    # requeue fell back to the in-place one and sat out Slurm's 121 s requeue hold)
    assert not events(run_dir, "successor_refused"), story
    ends = events(run_dir, "end")
    assert [e["status"] for e in ends] == ["completed"] and ends[0].get("exit_code", 0) == 0, story

    # Each warning: a stop checkpoint of the time limit and a requeue, once per allocation,
    # the second in the restarted generation.
    saved = [named(p, "checkpointed_on_signal") for p in parts]
    assert [[(s["signal"], s["generation"]) for s in x] for x in saved] == [
        [("time_limit", 0)], [("time_limit", 1)], []], story
    requeues = [named(p, "requeue") for p in parts]
    assert [len(r) for r in requeues] == [1, 1, 0], story
    assert all("time limit" in r[0]["reason"] and not r[0]["exclude"] for r in requeues[:2]), story
    stopped = [named(p, "train_stopped") for p in parts]
    assert [[s["generation"] for s in x] for x in stopped] == [[0], [1], []], story
    stop1, stop2 = stopped[0][0]["step"], stopped[1][0]["step"]
    assert [saved[0][0]["step"], saved[1][0]["step"]] == [stop1, stop2], story
    assert 0 < stop1 < stop2 < STEPS, story

    # Resumes: allocation 2 from the first stop checkpoint; its generation 1 from a save no
    # older than one interval before the kill and not before that stop; allocation 3 from the
    # second stop checkpoint. Nothing trains again from scratch.
    (kill,) = [k for k in named(second, "fault_injected") if k["kind"] == "sigkill"]
    resumes = [[(r["generation"], r["step"]) for r in named(p, "train_resumed")] for p in parts]
    assert resumes[0] == [] and resumes[1][0] == (0, stop1) and resumes[2] == [(0, stop2)], (resumes, story)
    (gen1,) = [s for g, s in resumes[1] if g == 1]
    assert stop1 <= gen1 <= kill["step"] and gen1 >= kill["step"] - INTERVAL, (gen1, kill, story)
    assert not named(first, "train_resumed") and not named(third, "failure"), story
