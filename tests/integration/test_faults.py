"""Fault injection on the real local cluster: real signals, real aborts, real slurmd deaths.

Each run must finish training, lose at most one checkpoint interval, and end with parameters
bit-for-bit equal to the same run without faults (``reference``: tests/integration/conftest.py).
A node lost with a spare, and the time-limit warning, are in test_recovery_points.py (with the
tiered store, where they also prove every save a recovery point); node 0 lost is in
test_node0_loss.py; a node lost without a spare (a successor job without it) is
test_unprivileged_user.py's run, where the ordinary user submits it.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.integration.faults import (
    COMMON, INTERVAL, diagnose, events, final, finish, mark_fault, rank_pid, submit, wait_for_step,
)
from testkit.chaos import procs
from slurmkit.train.faults import DATA_STALL_LINE
from slurmkit.slurm.client import SlurmClient
from slurmkit.slurm.runner import SubprocessRunner
from tests.integration.browser import assert_report_in_chromium
from tests.integration.helpers import slurm_env

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def env(cluster_env) -> dict[str, str]:
    return slurm_env(cluster_env)


def assert_recovered(run_dir: str, job: str, env, reference: str, fault_step: int) -> None:
    state = finish(job, env, run_dir=run_dir)
    assert state == "COMPLETED", f"job {job} ended {state}\n{diagnose(run_dir, job, env)}"
    assert final(run_dir)["param_sha256"] == reference, "resumed run diverged from the uninterrupted one"
    restored = [e["step"] for e in events(run_dir, "ckpt_restored")]
    assert restored, "no resume recorded in the ledger"
    assert max(restored) >= fault_step - INTERVAL, (restored, fault_step)


def test_a_rank_sigkill_an_nccl_abort_and_a_sigstop_each_restart_in_the_allocation(env, reference, tmp_path) -> None:
    """Three faults of the rank family in one job, one generation each: a SIGKILLed rank
    (rank_crash), an NCCL error line and abort from inside the trainer (nccl_error) and a
    SIGSTOPped rank (hang). Each is classified, restarted in the allocation from the last
    checkpoint, and the run still ends bit-exact with the uninterrupted one; its report, opened
    in headless Chromium, shows the three."""
    # The next generation's standbys start as soon as the ranks beat (default: after 60 s).
    job, run_dir = submit([*COMMON, "job.name=f-ranks", "supervisor.warm_standby_after_s=0",
                           "+job.env.SLURMKIT_FAULT=nccl_abort:2:25:once"], env, str(tmp_path))
    step = wait_for_step(run_dir, 3, 13)
    mark_fault(run_dir, "sigkill", rank=3, step=step)
    os.kill(rank_pid(run_dir, 3), signal.SIGKILL)
    # Generation 1 resumes at 10 and rank 2 aborts at 25 (SLURMKIT_FAULT); generation 2 resumes
    # at 20, and rank 1 is stopped past its save at 30. Rank 1 reaches 33 only in generation 2.
    stopped_at = wait_for_step(run_dir, 1, 33)
    assert len(events(run_dir, "failure")) == 2, diagnose(run_dir, job, env)
    mark_fault(run_dir, "sigstop", rank=1, step=stopped_at)
    os.kill(rank_pid(run_dir, 1), signal.SIGSTOP)
    assert_recovered(run_dir, job, env, reference, stopped_at)
    kill, nccl, hang = events(run_dir, "failure")
    assert (kill["cls"], kill["rank"]) == ("rank_crash", 3), kill
    assert (nccl["cls"], nccl["rank"]) == ("nccl_error", 2) and "NCCL error" in nccl["evidence"], nccl
    assert (hang["cls"], hang["rank"]) == ("hang", 1) and "stopped" in hang["evidence"], hang
    assert [d["action"] for d in events(run_dir, "decision")] == ["restart"] * 3
    # From the newest save each time: 10, 20, then 30 (or 20 when rank 1's copy of step 30 was
    # still being written to its node's tier when it was stopped three steps later).
    restored = [e["step"] for e in events(run_dir, "ckpt_restored") if e.get("rank") == 0]
    assert restored[:2] == [10, 20] and len(restored) == 3 and restored[2] in (20, 30), restored
    # Every generation's ranks were forked by each node's fork server (slurmkit.launch.forkserver),
    # which imported the trainer once while the agents met: no rank paid the import again.
    started = events(run_dir, "ranks_started")
    assert sorted(e["generation"] for e in started) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert all(e["warm"] == [True, True] for e in started), started
    restarted = {r: pid for e in started if e["generation"] == 1 for r, pid in zip(e["ranks"], e["pids"])}
    assert 3 in restarted and restarted[3] != rank_pid_of_generation(run_dir, 3, 0)
    # Nothing of the job is left: the fork servers ended with their agents, and so did the
    # stopped rank.
    left = [f"{p.pid}: {' '.join(p.cmdline)}" for p in procs.scan(run_dir, job)]
    assert not left, left
    # The run's report, rendered by a real browser, lists the three failures (tests/integration/browser.py).
    assert_report_in_chromium(run_dir, env, tmp_path)


def rank_pid_of_generation(run_dir: str, rank: int, gen: int) -> int:
    (e,) = [e for e in events(run_dir, "ranks_started") if e["generation"] == gen and rank in e["ranks"]]
    return int(e["pids"][e["ranks"].index(rank)])


def _wait_for_line(path: str, text: str, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while not (os.path.exists(path) and text in open(path, errors="replace").read()):
        assert time.monotonic() < deadline, f"no {text!r} in {path} after {timeout_s} s"
        time.sleep(0.1)


def test_a_sigstopped_rank_in_a_data_stall_is_the_root_of_the_hang_with_its_stack(env, tmp_path) -> None:
    # Rank 1 sleeps in data loading before step 6 and is then SIGSTOPped; ranks 0, 2 and 3 wait
    # in step 6's gradient all-reduce. Every last beat is step 5: the stacks name the root.
    # Not compared with ``reference``: what is asserted is the verdict, and 16 steps keep it short.
    job, run_dir = submit([*COMMON, "job.name=f-stall", "train.steps=16",
                           "+job.env.SLURMKIT_FAULT=data_stall:1:6:once"], env, str(tmp_path))
    _wait_for_line(os.path.join(run_dir, "logs", "rank1.log"), DATA_STALL_LINE)
    mark_fault(run_dir, "sigstop", rank=1, step=6)
    os.kill(rank_pid(run_dir, 1), signal.SIGSTOP)
    state = finish(job, env, run_dir=run_dir)
    assert state == "COMPLETED", f"job {job} ended {state}\n{diagnose(run_dir, job, env)}"
    (failure,) = events(run_dir, "failure")
    assert failure["cls"] == "hang" and failure["rank"] == 1, failure
    assert failure["in_collective"] is False and "stalled_data_loading" in failure["stack"], failure
    ranks = {r["rank"]: r for e in events(run_dir, "hang_stacks") for r in e["ranks"]}
    assert sorted(ranks) == [0, 1, 2, 3], ranks  # each node's agent wrote its own ranks' stacks
    assert ranks[1]["place"] == "stopped" and ranks[1]["source"] == "faulthandler"
    assert any("stalled_data_loading" in line for line in ranks[1]["lines"]) and len(ranks[1]["lines"]) <= 40
    assert all(ranks[r]["place"] == "collective" for r in (0, 2, 3)), ranks
    # Each rank's flight recorder (gloo, through the trainer's own FIFO) agrees, on both nodes:
    # ranks 0, 2 and 3 issued a collective that is not completed; rank 1 never issued it.
    traces = {r: ranks[r]["trace"] for r in ranks}
    assert all(traces[r]["enqueued"] > traces[r]["completed"] for r in (0, 2, 3)), traces
    assert all(traces[1]["enqueued"] == traces[1]["completed"] < traces[r]["enqueued"] for r in (0, 2, 3)), traces
    assert [d["action"] for d in events(run_dir, "decision")] == ["restart"]


def test_raise_at_the_same_step_stops_with_93_and_no_requeue(env, tmp_path) -> None:
    job, run_dir = submit([*COMMON, "job.name=f-loop", "+job.env.SLURMKIT_FAULT=raise:1:15",
                           "supervisor.max_restarts_without_progress=2"], env, str(tmp_path))
    assert finish(job, env, run_dir=run_dir) == "FAILED"
    rows = [r for r in SlurmClient(SubprocessRunner(env=env)).sacct(job) if not r.is_step]
    assert rows[-1].exit_code == 93, rows
    assert SlurmClient(SubprocessRunner(env=env)).job(job).restart_cnt == 0
    end = events(run_dir, "end")[-1]
    assert end["status"] == "stopped" and end["exit_code"] == 93 and "crash loop" in end["reason"]
    assert all(f["cls"] == "user_error" and f["rank"] == 1 for f in events(run_dir, "failure"))
    assert not os.path.exists(os.path.join(run_dir, "final.json"))
