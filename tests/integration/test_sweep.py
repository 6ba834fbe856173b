"""Sweeps on real executors: a 2 x 2 sweep as one Slurm job array on the local cluster, one of
its tasks losing a rank and requeueing itself alone; and the same syntax on the local executor.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from rich.console import Console

from slurmkit.config import load_frozen
from slurmkit.slurm import ACTIVE_STATES
from slurmkit.slurm.client import SlurmClient
from slurmkit.slurm.runner import SubprocessRunner
from slurmkit.supervise.exits.requeue import release_when_pending
from slurmkit.sweep import load_sweep
from tests.integration.faults import events, final, mark_fault, rank_pid, wait_for_step
from tests.integration.helpers import read_ledger, slurm_env, submit_cli, submitter

pytestmark = pytest.mark.integration

# lr x steps; one node per variant so that the four tasks fit the four-node cluster together.
SWEEP = ["-m", "+exp=tiny", "model=micro", "job.nodes=1", "train.lr=1e-3,3e-3", "train.steps=20,40",
         "train.ckpt_interval_steps=10", "train.micro_batch=1", "train.seq_len=32",
         "+job.env.SLURMKIT_STEP_DELAY_S=0.25",
         "supervisor.heartbeat_timeout_s=8"]


def _sweep_dir(stdout: str) -> str:
    for line in stdout.splitlines():
        if line.strip().startswith("sweep directory"):
            return line.split(":", 1)[1].strip()
    raise AssertionError(f"submit printed no sweep directory:\n{stdout}")


def _wait(cond, timeout_s: float, what: str, poll_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def _array_states(client: SlurmClient, job_id: str, reasons: set[str]) -> dict[int, str]:
    """{task: state} once no task of the array is left in the queue; collects pending reasons."""
    queued = client.squeue(job_ids=[job_id])
    if queued:
        reasons.update(r.reason or "" for r in queued if r.state == "PENDING")
        return {}
    rows = [r for r in client.sacct(job_id) if not r.is_step and r.job_id.startswith(f"{job_id}_")]
    states = {int(r.job_id.split("_", 1)[1]): r.state for r in rows}
    # Accounting can lag the queue by a moment: a task squeue no longer lists may still read
    # RUNNING or REQUEUED in sacct (seen once: the requeued task's COMPLETED row came 2 s late).
    return {} if any(s in ACTIVE_STATES for s in states.values()) else states


def test_two_by_two_sweep_is_one_array_and_a_task_recovers_alone(cluster_env, tmp_path) -> None:
    env = slurm_env(cluster_env)
    # max_restarts=0: the killed rank makes its task requeue itself, the path that must name
    # the task (ARRAY_TASK), not the array: the other three tasks must never be requeued.
    res = submit_cli([*SWEEP, "job.name=sweep-it", "supervisor.max_restarts=0",
                      f"submit.run_root={tmp_path}"], env, str(tmp_path))
    assert res.returncode == 0, res.stdout + res.stderr
    sweep_dir = _sweep_dir(res.stdout)
    sweep = load_sweep(sweep_dir)
    job_id = sweep.job_id
    assert job_id and job_id.isdigit() and f"job array {job_id} --array=0-3" in res.stdout
    assert [v.run_dir for v in sweep.variants] == [os.path.join(sweep_dir, str(i)) for i in range(4)]
    client = SlurmClient(SubprocessRunner(env=env))

    # submit's singleton hint, against the real queue: the array's tasks hold the name.
    from slurmkit.cli import submit
    from slurmkit.sweep.plan import plan_sweep

    plan = plan_sweep([a for a in SWEEP if a != "-m"] + ["job.name=sweep-it"], env, submit.resolve_cluster,
                      submit.validate, submit.topology_srun_args)
    hint = tmp_path / "hint.txt"
    with open(hint, "w") as f:
        # whose queue: the user who submitted the array (the hint asks squeue for $USER's jobs)
        pw = submitter(env)
        submit.warn_singleton(plan.spec, {**env, "USER": pw.pw_name} if pw else env, Console(file=f, width=400))
    assert f"{job_id}_" in hint.read_text() and "stays PENDING" in hint.read_text()

    # Slurm keeps the array's own job id for its last task: scontrol with that id alone would
    # requeue every task, which is what this kill must not do.
    target = sweep.variants[3]
    step = wait_for_step(target.run_dir, 1, 12, timeout_s=400)
    assert events(target.run_dir, "allocation_start")[0]["job_id"] == job_id
    mark_fault(target.run_dir, "sigkill", rank=1, step=step)
    os.kill(rank_pid(target.run_dir, 1), signal.SIGKILL)
    # An array task is requeued in place (its script is the array's: no successor job), and
    # Slurm holds a requeued job for its credential lifetime + 1 s (121 s by default) before it
    # is eligible again. The test, as the admin, makes the pending task eligible at once, as
    # test_tiers_advance does after its admin requeue: the hold is Slurm's, not what this test
    # checks, and it was two thirds of the test's time.
    _wait(lambda: events(target.run_dir, "requeue"), 300, "task 3's requeue")
    assert release_when_pending(client, f"{job_id}_3", [], timeout_s=180), f"task {job_id}_3 never pending"

    reasons: set[str] = set()
    states = _wait(lambda: (s := _array_states(client, job_id, reasons)) and len(s) == 4 and s, 900,
                   f"the four tasks of array {job_id} to end")
    assert states == {0: "COMPLETED", 1: "COMPLETED", 2: "COMPLETED", 3: "COMPLETED"}, states
    # --dependency=singleton is on, yet no task ever waited for another task of its own array.
    assert not any("Dependency" in r for r in reasons), reasons

    for i, v in enumerate(sweep.variants):
        cfg = load_frozen(os.path.join(v.run_dir, "config.yaml"))
        assert (cfg.train.lr, cfg.train.steps) == ([1e-3, 1e-3, 3e-3, 3e-3][i], [20, 40, 20, 40][i])
        assert final(v.run_dir)["step"] == cfg.train.steps
        (sub,) = events(v.run_dir, "submitted")
        assert sub["job_id"] == f"{job_id}_{i}" and sub["array_job_id"] == job_id
        if v is target:
            continue
        assert not events(v.run_dir, "failure") and not events(v.run_dir, "requeue")
    # Only the target task was requeued (a requeue of the array's id would show every task
    # REQUEUED here; Slurm's own requeue after a NODE_FAIL shows NODE_FAIL, not REQUEUED).
    requeued = {r.job_id for r in client.sacct(job_id, duplicates=True) if not r.is_step and r.state == "REQUEUED"}
    assert requeued == {f"{job_id}_3"}, requeued

    (failure,) = events(target.run_dir, "failure")
    assert failure["cls"] == "rank_crash" and failure["rank"] == 1, failure
    assert [d["action"] for d in events(target.run_dir, "decision")] == ["requeue"]
    starts = events(target.run_dir, "allocation_start")
    assert len(starts) == 2 and starts[0]["job_id"] == starts[1]["job_id"], starts
    assert starts[1]["restart_count"] == 1
    restored = [e["step"] for e in events(target.run_dir, "ckpt_restored")]
    assert restored and max(restored) >= 10, restored

    # `status` of the sweep: one line per variant, read from this layout.
    res = subprocess.run([sys.executable, "-m", "slurmkit.status", sweep_dir], env=env, cwd=str(tmp_path),
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    rows = [ln for ln in res.stdout.splitlines() if f"{job_id}_" in ln]
    assert len(rows) == 4 and all("COMPLETED" in ln for ln in rows), res.stdout


def test_local_executor_runs_every_variant(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    env["PATH"] = os.path.dirname(sys.executable)  # no sbatch: cluster=auto picks local
    res = submit_cli(["-m", "+exp=tiny", "model=micro", "job.nodes=1", "job.name=sweep-local", "train.steps=4,6",
                      "train.ckpt_interval_steps=2", "submit.array_parallelism=2",
                      f"submit.run_root={tmp_path}"], env, str(tmp_path))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "(local)" in res.stdout
    sweep_dir = _sweep_dir(res.stdout)
    sweep = load_sweep(sweep_dir)
    assert sweep.executor == "local" and len(sweep.variants) == 2
    _wait(lambda: all(events(v.run_dir, "end") for v in sweep.variants), 600,
          "both local variants to end")
    assert [final(v.run_dir)["step"] for v in sweep.variants] == [4, 6]
    for v in sweep.variants:
        (sub,) = events(v.run_dir, "submitted")
        assert sub["executor"] == "local" and sub["array_task_id"] == v.index
        assert [e["status"] for e in events(v.run_dir, "end")] == ["completed"], events(v.run_dir, "end")
    # submit.array_parallelism=2: the second variant ran beside the first, not after it.
    first_end = events(sweep.variants[0].run_dir, "end")[0]["t"]
    assert events(sweep.variants[1].run_dir, "allocation_start")[0]["t"] < first_end
    log = os.path.join(sweep_dir, "local_runner.log")
    _wait(lambda: "sweep done: 2 of 2 variants completed" in open(log).read(), 120,
          "the runner to record both variants")
    assert open(log).read().count("): completed") == 2
    with open(os.path.join(sweep_dir, "sweep.json")) as f:
        doc = json.load(f)
    assert doc["job_id"] is None and isinstance(doc["runner_pid"], int)
