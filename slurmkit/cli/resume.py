"""``python -m slurmkit.resume RUN_DIR [--wait] [--timeout-s S]``: continue a run that ended.

A run stopped by ``slurmkit cancel --checkpoint``, by the supervisor (exit 93), by a failure or
by a lost job goes on under a new job: the same run directory, the same frozen config.yaml and
layout.json (their digests are checked), the same checkpoint store (``store.run_id``). The new
job's ranks restore the newest checkpoint any tier holds, as a requeued job's do; the ledger
goes on with a ``submitted`` event that names the job it resumes, so ``status``, ``logs`` and
the report follow the new job. It goes where the run went: to Slurm for a Slurm run (the site's
capabilities probed again), as local processes for a local one.

Refused, with what to do instead: a run that is still queued or running (``slurmkit cancel``
first, or ``status --watch``), one that completed (nothing to resume: submit a new run with more
``train.steps``), and a directory that is no run.

Exit codes: 0 submitted (with ``--wait``: the job completed), 1 with ``--wait`` when it did not,
2 for a refusal.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Mapping

from rich.console import Console

from slurmkit.config import load_frozen
from slurmkit.errors import ConfigError, SlurmkitError, print_error
from slurmkit.jobstates import JobPoller, JobRef, make_client
from slurmkit.layout import config_digest, read_layout
from slurmkit.ledger.ledger import LEDGER_NAME, Ledger
from slurmkit.runfiles import CONFIG_NAME
from slurmkit.runview import RunWatcher, is_run_dir

#: rank 0's record of a run that trained to its end (slurmkit.train.trainer)
FINAL_NAME = "final.json"


def check_resumable(run_dir: str, poller: JobPoller) -> str | None:
    """The job id the run last ran as; ConfigError when it cannot be resumed."""
    if not is_run_dir(run_dir) or not os.path.isfile(os.path.join(run_dir, CONFIG_NAME)):
        raise ConfigError(f"{run_dir} is no run directory (no {CONFIG_NAME})",
                          "a run directory that slurmkit submit made", "pass the run directory that "
                          "submit printed (slurmkit runs lists them)")
    watcher = RunWatcher(run_dir)
    watcher.refresh()
    v = watcher.view
    assert v is not None  # noqa: S101 - refresh() ran
    if v.phase == "completed" or os.path.exists(os.path.join(run_dir, FINAL_NAME)):
        raise ConfigError(f"the run in {run_dir} completed", "a run that stopped before its last step",
                          "submit a new run (with more train.steps) to train further")
    if v.job_id is not None:
        job = poller.poll([JobRef(v.job_id, v.executor or "slurm")])[JobRef(v.job_id, v.executor or "slurm")]
        if not job.over and job.state != "UNKNOWN":
            raise ConfigError(f"job {v.job_id} of this run is {job.state} ({v.phase})",
                              "a run whose job is over", f"wait for it (slurmkit status --watch {run_dir}) "
                              f"or end it first (slurmkit cancel --checkpoint {run_dir})")
        if job.state == "UNKNOWN" and not v.ended:
            raise ConfigError(f"Slurm cannot tell whether job {v.job_id} still runs, and the run's ledger "
                              f"has not ended ({v.phase})", "a run whose job is over",
                              f"check with squeue -j {v.job_id}; when it is gone, resume again")
    return v.job_id


def main(argv: list[str] | None = None, env: Mapping[str, str] | None = None,
         console: Console | None = None, err: Console | None = None) -> int:
    p = argparse.ArgumentParser(prog="slurmkit resume", description="Continue a run that ended, "
                                "from its newest checkpoint, under a new job.")
    p.add_argument("run_dir")
    p.add_argument("--wait", action="store_true", help="follow it until the job ends (as submit.wait=true)")
    p.add_argument("--timeout-s", type=float, default=0.0, help="with --wait: give up after this long")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    env = os.environ if env is None else env
    console = console or Console(soft_wrap=True)
    err = err or Console(stderr=True, soft_wrap=True)
    from slurmkit.cli import submit as sub

    run_dir = os.path.abspath(args.run_dir)
    try:
        poller = JobPoller(make_client(env))
        previous = check_resumable(run_dir, poller)
        cfg = load_frozen(os.path.join(run_dir, CONFIG_NAME))
        layout = read_layout(run_dir)  # checked against config.yaml's digest
        if cfg.cluster.kind == "auto":  # frozen by an older slurmkit: decide as submit would
            cfg = sub.resolve_cluster(cfg, env)
        slurm = cfg.cluster.kind == "slurm"
        spec = sub.build_jobspec(cfg, run_dir, sub.topology_srun_args(cfg) if slurm else [], layout=layout)
        with open(os.path.join(run_dir, CONFIG_NAME), "rb") as f:
            spec = dataclasses.replace(spec, config_sha256=config_digest(f.read()))
        if slurm:
            submitted = sub.submit_with_site(spec, sub.freeze_site(run_dir, env, err), err, sub.submit_slurm)
        else:
            submitted = sub.submit_local(spec)
    except ConfigError as exc:
        print_error(err, exc, "cannot resume")
        return 2
    except SlurmkitError as exc:
        print_error(err, exc)
        return 1
    Ledger(os.path.join(run_dir, LEDGER_NAME), source="resume").append(
        "submitted", job_id=submitted.job_id, executor=submitted.executor, name=spec.name, nodes=spec.nodes,
        ranks_per_node=spec.ranks_per_node, config_hash=sub.config_hash(cfg), resumes=previous or "")
    console.print(f"[bold green]resumed[/] {spec.name} from its newest checkpoint"
                  + (f" (after job {previous})" if previous else ""), highlight=False)
    sub.print_submitted(console, submitted, spec)
    if not args.wait:
        return 0
    from slurmkit.progress import follow_progress

    try:
        left_s = follow_progress(run_dir, submitted.job_id, submitted.executor, env, console, args.timeout_s)
        code = sub.wait_job(submitted, env, left_s)
    except KeyboardInterrupt:
        sub.print_detached(err, submitted)
        return sub.after_detach(err, submitted)
    (console if code == 0 else err).print(f"job {submitted.job_id} {'completed' if code == 0 else 'did not complete'}")
    return code


if __name__ == "__main__":
    sys.exit(main())
