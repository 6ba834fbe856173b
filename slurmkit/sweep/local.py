"""The local executor's job array: run a sweep's variants as local jobs, K at a time.

Without Slurm there is no array scheduler, so a small runner does its job: it starts each
variant through submitit's LocalExecutor (exactly as a single local run starts), at most
``parallelism`` at once, and records each start in that variant's ledger. ``submit`` starts it
detached, so the command returns at once as it does with Slurm; with ``submit.wait`` it runs in
the foreground. Variants share one machine, so the default is one at a time.

`python -m slurmkit.sweep.local SWEEP_DIR PARALLELISM`
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor

from slurmkit.config import config_hash, load_frozen
from slurmkit.ledger.ledger import LEDGER_NAME, Ledger
from slurmkit.render.jobspec import build_jobspec
from slurmkit.runfiles import CONFIG_NAME, RUNNER_LOG
from slurmkit.sweepdir import Variant, load_sweep

log = logging.getLogger(__name__)



def run_variant(v: Variant, submit_local: Callable[..., object]) -> bool:
    """Start one variant as a local job and wait for it; True when it completed."""
    cfg = load_frozen(os.path.join(v.run_dir, CONFIG_NAME))
    spec = build_jobspec(cfg, v.run_dir, [])
    submitted = submit_local(spec)
    job = submitted.job  # type: ignore[attr-defined]
    Ledger(os.path.join(v.run_dir, LEDGER_NAME), source="submit").append(
        "submitted", job_id=str(job.job_id), executor="local", name=spec.name, nodes=spec.nodes,
        ranks_per_node=spec.ranks_per_node, config_hash=config_hash(cfg), sweep_dir=os.path.dirname(v.run_dir),
        array_task_id=v.index, overrides=v.overrides)
    try:
        job.wait()
    except Exception:  # submitit re-raises the job's failure; its state tells the outcome
        pass
    ok = job.state == "FINISHED" and job.exception() is None
    log.info("variant %d (%s): %s", v.index, " ".join(v.overrides), "completed" if ok else "failed")
    return ok


def run_local_sweep(sweep_dir: str, parallelism: int) -> int:
    """Run every variant; 0 when all completed."""
    from slurmkit.launch.local import submit_local

    variants = load_sweep(sweep_dir).variants
    workers = max(1, min(parallelism or 1, len(variants)))

    def one(v: Variant) -> bool:
        try:
            return run_variant(v, submit_local)
        except Exception:  # one broken variant must not stop the others: report it, go on
            log.exception("variant %d (%s) could not run", v.index, " ".join(v.overrides))
            return False

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="variant") as pool:
        results = list(pool.map(one, variants))
    log.info("sweep done: %d of %d variants completed", sum(results), len(results))
    return 0 if all(results) else 1


def start_detached(sweep_dir: str, parallelism: int, env: Mapping[str, str]) -> int:
    """Start the runner in its own session (it outlives ``submit``); returns its pid."""
    log_path = os.path.join(sweep_dir, RUNNER_LOG)
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "slurmkit.sweep.local", sweep_dir, str(parallelism)],
            env=dict(env), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, close_fds=True)
    return proc.pid


def main(argv: list[str]) -> int:
    if len(argv) != 2 or not argv[1].isdigit():
        print("usage: python -m slurmkit.sweep.local SWEEP_DIR PARALLELISM", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s sweep %(levelname)s %(message)s")
    return run_local_sweep(argv[0], int(argv[1]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
