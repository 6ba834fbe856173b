"""`python -m slurmkit.submit -m +exp=NAME key=a,b ...`: a sweep as one Slurm job array.

Order matters for "nothing half-way": every variant is validated first (slurmkit/sweep/plan.py);
then the sweep directory, every variant's frozen config and sweep.json are written; then the one
array job is submitted. If sbatch refuses it, the sweep directory is removed again.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from rich.console import Console
from rich.markup import escape

from slurmkit.config import SlurmkitConfig, config_hash
from slurmkit.errors import SubmissionError
from slurmkit.ledger.ledger import LEDGER_NAME, Ledger
from slurmkit.render import JobSpec, render_standalone
from slurmkit.runfiles import LOGS_DIR, RUNNER_LOG, SCRIPT_NAME
from slurmkit.submit_checks import check_run_root, missing_dirs, remove_created
from slurmkit.sweep.plan import PLACEHOLDER_DIR, SweepPlan, plan_sweep
from slurmkit.sweepdir import Sweep, Variant, new_sweep_dir, variant_dir, write_sweep



@dataclass(frozen=True)
class SingleRun:
    """The steps of one run's submission that a sweep takes for each variant: slurmkit.cli.submit's
    own, which it passes in (submit imports the sweep package, never the reverse)."""

    resolve_cluster: Callable[[SlurmkitConfig, Mapping[str, str]], SlurmkitConfig]
    validate: Callable[[SlurmkitConfig], None]
    topology_srun_args: Callable[[SlurmkitConfig], list[str]]
    warn_singleton: Callable[[JobSpec, Mapping[str, str], Console], None]
    freeze: Callable[[SlurmkitConfig, str], None]  # a variant's config.yaml and layout.json
    # job.command's relative files made absolute, after checking they are there (submit_checks)
    resolve_command: Callable[[SlurmkitConfig], SlurmkitConfig]


def create(plan: SweepPlan, executor: str, freeze: Callable[[SlurmkitConfig, str], None]) -> Sweep:
    """The sweep directory with one frozen run directory per variant and sweep.json (job_id null)."""
    cfg = plan.cfg
    sweep_dir = new_sweep_dir(cfg.submit.run_root, cfg.job.name)
    try:
        variants = []
        for v in plan.variants:
            run_dir = variant_dir(sweep_dir, v.index)
            freeze(v.cfg, run_dir)
            variants.append(Variant(v.index, v.distinct, run_dir))
        sweep = Sweep(sweep_dir=sweep_dir, name=cfg.job.name, array=f"0-{len(variants) - 1}",
                      executor=executor, common_overrides=plan.common, variants=variants)
        write_sweep(sweep)
    except BaseException:
        shutil.rmtree(sweep_dir, ignore_errors=True)
        raise
    return sweep


def submit_array(plan: SweepPlan, sweep: Sweep, env: Mapping[str, str]) -> str:
    """Write the array's batch script and sbatch it; returns the array job id."""
    from slurmkit.slurm.client import slurm_client

    path = os.path.join(sweep.sweep_dir, SCRIPT_NAME)
    with open(path, "w") as f:
        f.write(render_standalone(plan.placed(sweep.sweep_dir), path))
    try:
        return slurm_client(env).submit(path)
    except SubmissionError as exc:
        raise SubmissionError(
            f"Detected: sbatch refused the sweep's job array: {exc}. Requirement: a partition, account, "
            "qos and resources this cluster accepts, and an array no larger than MaxArraySize. "
            "Fix: check `sinfo -s` and `scontrol show config | grep MaxArraySize`, then adjust the "
            "sweep; nothing was submitted.") from exc


def record_submitted(plan: SweepPlan, sweep: Sweep, job_id: str) -> None:
    sweep.job_id = job_id
    write_sweep(sweep)
    for pv, v in zip(plan.variants, sweep.variants):
        Ledger(os.path.join(v.run_dir, LEDGER_NAME), source="submit").append(
            "submitted", job_id=f"{job_id}_{v.index}", executor="slurm", name=plan.spec.name,
            nodes=plan.spec.nodes, ranks_per_node=plan.spec.ranks_per_node,
            config_hash=config_hash(pv.cfg), array_job_id=job_id, array_task_id=v.index,
            sweep_dir=sweep.sweep_dir, overrides=v.overrides)


def print_sweep(console: Console, sweep: Sweep, plan: SweepPlan, executor: str) -> None:
    spec = plan.spec
    what = f"job array [bold]{sweep.job_id}[/] --array={spec.array}" if executor == "slurm" else \
        f"{len(sweep.variants)} local jobs, {plan.cfg.submit.array_parallelism or 1} at a time"
    console.print(f"[bold green]submitted[/] sweep {escape(spec.name)} of {len(sweep.variants)} "
                  f"variants: {what} ({executor})")
    console.print(f"  sweep directory : {escape(sweep.sweep_dir)}")
    if sweep.common_overrides:
        console.print(f"  common          : {escape(' '.join(sweep.common_overrides))}")
    for v in sweep.variants:
        task = f"{sweep.job_id}_{v.index}" if executor == "slurm" else f"#{v.index}"
        console.print(f"  {task:<15} : {escape(' '.join(v.overrides) or '(no override)')}  ->  "
                      f"{escape(v.run_dir)}")
    if executor == "slurm":
        console.print(f"  follow          : squeue -j {sweep.job_id}; sacct -j {sweep.job_id}; "
                      f"tail -f {escape(os.path.join(sweep.sweep_dir, '0', LOGS_DIR, 'rank0.log'))}")
    else:
        console.print(f"  follow          : tail -f {escape(os.path.join(sweep.sweep_dir, RUNNER_LOG))}")


def wait_array(job_id: str, count: int, env: Mapping[str, str], timeout_s: float,
               poll_s: float = 2.0) -> dict[int, str]:
    """Block until every task of the array has ended; {task index: final state}.

    One squeue call per poll while the array is queued or running, then sacct (which lags the
    controller by a moment) until each task has a terminal row.
    """
    from slurmkit.slurm.client import slurm_client
    from slurmkit.slurm.records import TERMINAL_STATES

    client = slurm_client(env)
    deadline = time.monotonic() + (timeout_s or 10 ** 9)
    states: dict[int, str] = {}
    while time.monotonic() < deadline:
        if not client.squeue(job_ids=[job_id]):
            for row in client.sacct(job_id):
                head, _, task = row.job_id.partition("_")
                if not row.is_step and head == job_id and task.isdigit():
                    states[int(task)] = row.state
            if len(states) == count and all(s in TERMINAL_STATES for s in states.values()):
                return states
        time.sleep(poll_s)
    return states


def run_sweep(argv: list[str], env: Mapping[str, str], console: Console, err: Console, single: SingleRun) -> int:
    plan = plan_sweep(argv, env, single.resolve_cluster, single.validate, single.topology_srun_args,
                      resolve_command=single.resolve_command)
    cfg, executor = plan.cfg, plan.cfg.cluster.kind
    if cfg.submit.dry_run:
        console.print(f"# sweep of {len(plan.variants)} variants as one job array "
                      f"(--array={plan.spec.array}); {PLACEHOLDER_DIR} is the sweep directory, "
                      f"variant i runs in {PLACEHOLDER_DIR}/i:", markup=False, highlight=False)
        for v in plan.variants:
            console.print(f"#   {v.index}: {' '.join(v.distinct) or '(no override)'}", markup=False,
                          highlight=False)
        sys.stdout.write(render_standalone(plan.spec, os.path.join(PLACEHOLDER_DIR, SCRIPT_NAME)))
        return 0
    if executor == "slurm" and cfg.submit.emit != "sbatch":
        single.warn_singleton(plan.spec, env, console)
    check_run_root(cfg.submit.run_root)
    # Parents this sweep creates (run_root, run_root/<job.name>): removed again, while empty,
    # when the sweep is refused, like a single run's (slurmkit/submit_checks.py).
    parents = missing_dirs(os.path.join(cfg.submit.run_root, cfg.job.name))
    try:
        sweep = create(plan, executor, single.freeze)
    except BaseException:
        remove_created(parents, None)
        raise
    if cfg.submit.emit == "sbatch":
        path = os.path.join(sweep.sweep_dir, SCRIPT_NAME)
        with open(path, "w") as f:
            f.write(render_standalone(plan.placed(sweep.sweep_dir), path))
        console.print(f"wrote {escape(path)} (a job array of {len(sweep.variants)} variants)\n"
                      f"submit it with: sbatch {escape(path)}")
        return 0
    if executor == "local":
        return run_local(plan, sweep, env, console)
    try:
        job_id = submit_array(plan, sweep, env)
    except BaseException:
        shutil.rmtree(sweep.sweep_dir, ignore_errors=True)  # nothing half-way: no sweep without a job
        remove_created(parents, sweep.sweep_dir)
        raise
    record_submitted(plan, sweep, job_id)
    print_sweep(console, sweep, plan, executor)
    if not cfg.submit.wait:
        return 0
    states = wait_array(job_id, len(sweep.variants), env, cfg.submit.timeout_s)
    for done in sweep.variants:
        state = states.get(done.index, "UNKNOWN")
        (console if state == "COMPLETED" else err).print(
            f"{job_id}_{done.index} {state}: {escape(' '.join(done.overrides))}")
    return 0 if len(states) == len(sweep.variants) and set(states.values()) == {"COMPLETED"} else 1


def run_local(plan: SweepPlan, sweep: Sweep, env: Mapping[str, str], console: Console) -> int:
    from slurmkit.sweep.local import run_local_sweep, start_detached

    parallelism = plan.cfg.submit.array_parallelism
    if plan.cfg.submit.wait:
        print_sweep(console, sweep, plan, "local")
        return run_local_sweep(sweep.sweep_dir, parallelism)
    sweep.runner_pid = start_detached(sweep.sweep_dir, parallelism, env)  # job_id stays null: no array
    write_sweep(sweep)
    print_sweep(console, sweep, plan, "local")
    return 0
