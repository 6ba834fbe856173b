"""Submit latency: `python -m slurmkit.submit +exp=tiny` against plain `sbatch`, side by side.

Both variants submit the same job to the running local Slurm cluster (tools/local-cluster):

* A, slurmkit: ``python -m slurmkit.submit +exp=tiny`` (compose, validate, freeze, render through
  submitit, sbatch), timed from process start to the line with the job id on its stdout.
* B, baseline: ``sbatch --parsable RUN_DIR/job.sbatch``, the same job rendered once beforehand
  with ``submit.emit=sbatch``, timed from process start to the job id on its stdout.

Runs alternate A B A B ... so drift on a shared machine hits both. Every job is cancelled as
soon as its id is known, so the cluster never runs the ~30 s trainer. When the overhead is over
the target, the import-time profile of ``slurmkit.cli.submit`` is printed (what dominates start-up).

    python tools/bench/submit_latency.py [--runs 7] [--cluster-env /tmp/slurmkit-cluster/env.json]

Ends with exactly one line ``RESULT submit_median_s=... sbatch_median_s=... overhead_s=... ratio=...``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)  # run as a script from anywhere: testkit/ is the repository's, not installed

from testkit.slurm_build import cluster_environ  # noqa: E402

TARGET_OVERHEAD_S = 1.5  # on the 2-core development machine
SUBMIT_JOB_RE = re.compile(r"job (\d+) \(slurm\)")
SBATCH_JOB_RE = re.compile(r"^(\d+)(;\S+)?$")
DEFAULT_CLUSTER_DIR = os.environ.get("SLURMKIT_CLUSTER_DIR", "/tmp/slurmkit-cluster")
LINE_TIMEOUT_S = 180.0  # one submission on a loaded 2-core machine can take ~20 s


class BenchError(RuntimeError):
    """A submission failed or printed no job id; the message carries its output."""


def load_env(path: str) -> dict[str, str]:
    """This process's environment plus the cluster's (SLURM_CONF, ...) from ``env.json``."""
    if not os.path.exists(path):
        raise BenchError(f"no cluster environment at {path}: run `tools/local-cluster up` first")
    with open(path) as f:
        cluster = json.load(f)
    env = cluster_environ(cluster)
    env["PYTHONUNBUFFERED"] = "1"  # the job id line reaches the pipe when printed, not at exit
    return env


def time_to_job_id(cmd: list[str], pattern: re.Pattern[str], env: Mapping[str, str], cwd: str,
                   clock: Callable[[], float] = time.monotonic) -> tuple[float, str]:
    """Seconds from starting ``cmd`` to the first stdout line matching ``pattern``, and the id.

    The process is left to finish after the id (it only prints paths then); its exit status
    is checked so a submission that failed after printing is not counted silently.
    """
    with tempfile.TemporaryFile(mode="w+") as errf:
        t0 = clock()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=errf, env=dict(env), cwd=cwd,
                                text=True, bufsize=1)
        assert proc.stdout is not None  # stdout=PIPE
        job_id, elapsed, seen = "", 0.0, []
        for line in proc.stdout:
            seen.append(line)
            m = pattern.search(line.strip())
            if m:
                elapsed, job_id = clock() - t0, m.group(1)
                break
        rest = proc.stdout.read()
        code = proc.wait(timeout=LINE_TIMEOUT_S)
        if not job_id or code != 0:
            errf.seek(0)
            raise BenchError(f"{' '.join(cmd)} exited {code} (job id {job_id or 'none'}):\n"
                             f"{''.join(seen)}{rest}{errf.read()[-3000:]}")
    return elapsed, job_id


def cancel(job_id: str, env: Mapping[str, str]) -> None:
    subprocess.run(["scancel", job_id], env=dict(env), check=False, capture_output=True, timeout=60)


def emit_script(env: Mapping[str, str], run_root: str, cwd: str) -> str:
    """Render the tiny job once as a standalone sbatch script; returns its path."""
    res = subprocess.run([sys.executable, "-m", "slurmkit.submit", "+exp=tiny", "submit.emit=sbatch",
                          f"submit.run_root={run_root}"], env=dict(env), cwd=cwd, capture_output=True,
                         text=True, timeout=LINE_TIMEOUT_S)
    m = re.search(r"wrote (\S+job\.sbatch)", res.stdout)
    if res.returncode != 0 or not m:
        raise BenchError(f"submit.emit=sbatch failed ({res.returncode}):\n{res.stdout}{res.stderr}")
    return m.group(1)


def p90(values: list[float]) -> float:
    """Nearest-rank 90th percentile (the value 90% of the runs do not exceed)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]


def wait_gone(job_ids: list[str], env: Mapping[str, str], deadline_s: float = 60.0) -> list[str]:
    """Wait until none of ``job_ids`` is still queued or running; returns those left."""
    end = time.monotonic() + deadline_s
    left = list(job_ids)
    while left and time.monotonic() < end:
        res = subprocess.run(["squeue", "-h", "-o", "%i", "-j", ",".join(left)], env=dict(env),
                             capture_output=True, text=True, timeout=60, check=False)
        left = [j for j in res.stdout.split() if j in left] if res.returncode == 0 else []
        if left:
            time.sleep(0.5)  # polling squeue; the cancelled jobs leave within a few seconds
    return left


def import_profile(env: Mapping[str, str], cwd: str, top: int = 12) -> list[tuple[int, str]]:
    """(cumulative microseconds, module) of the slowest imports of ``slurmkit.cli.submit``."""
    res = subprocess.run([sys.executable, "-X", "importtime", "-c", "import slurmkit.cli.submit"],
                         env=dict(env), cwd=cwd, capture_output=True, text=True, timeout=LINE_TIMEOUT_S)
    rows: list[tuple[int, str]] = []
    for line in res.stderr.splitlines():
        parts = line.split("|")
        if len(parts) == 3 and parts[1].strip().isdigit():
            rows.append((int(parts[1]), parts[2].rstrip()))
    interesting = [r for r in rows if r[1].strip().startswith(("slurmkit", "torch", "hydra",
                                                               "omegaconf", "submitit", "rich", "jinja2"))
                   and r[1].strip().count(".") <= 2]
    return sorted(interesting, reverse=True)[:top]


def run_bench(runs: int, env: Mapping[str, str], tmp: str) -> tuple[list[float], list[float]]:
    """Alternate A (slurmkit.submit) and B (sbatch) ``runs`` times each; seconds per run."""
    script = emit_script(env, os.path.join(tmp, "emitted"), tmp)  # also warms the page cache
    submit_cmd = [sys.executable, "-m", "slurmkit.submit", "+exp=tiny",
                  f"submit.run_root={os.path.join(tmp, 'submitted')}"]
    sbatch_cmd = ["sbatch", "--parsable", script]
    ours: list[float] = []
    base: list[float] = []
    job_ids: list[str] = []
    try:
        for i in range(runs):
            for name, cmd, pattern, out in (("slurmkit", submit_cmd, SUBMIT_JOB_RE, ours),
                                            ("sbatch", sbatch_cmd, SBATCH_JOB_RE, base)):
                elapsed, job_id = time_to_job_id(cmd, pattern, env, tmp)
                cancel(job_id, env)
                job_ids.append(job_id)
                out.append(elapsed)
                print(f"run {i + 1}/{runs} {name:8s} {elapsed:7.3f} s  job {job_id}", flush=True)
    finally:
        for job_id in job_ids:
            cancel(job_id, env)  # idempotent; catches a job whose first scancel raced its start
        left = wait_gone(job_ids, env)
        if left:
            print(f"warning: jobs still queued after cancel: {','.join(left)}", file=sys.stderr)
    return ours, base


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--runs", type=int, default=7, help="submissions per variant (default 7)")
    ap.add_argument("--cluster-env", default=os.path.join(DEFAULT_CLUSTER_DIR, "env.json"),
                    help="the local cluster's env.json (default %(default)s)")
    ap.add_argument("--profile", action="store_true",
                    help="print the import-time profile even when the overhead is under target")
    args = ap.parse_args(argv)
    if args.runs < 1:
        ap.error("--runs must be >= 1")
    env = load_env(args.cluster_env)
    with tempfile.TemporaryDirectory(prefix="submit-latency-") as tmp:
        ours, base = run_bench(args.runs, env, tmp)
        m_ours, m_base = statistics.median(ours), statistics.median(base)
        overhead, ratio = m_ours - m_base, m_ours / m_base
        print(f"\n{'variant':10s} {'median s':>9s} {'p90 s':>9s} {'min s':>9s}  (n={args.runs} each, ABAB)")
        print(f"{'slurmkit':10s} {m_ours:9.3f} {p90(ours):9.3f} {min(ours):9.3f}")
        print(f"{'sbatch':10s} {m_base:9.3f} {p90(base):9.3f} {min(base):9.3f}")
        verdict = "within" if overhead <= TARGET_OVERHEAD_S else "OVER"
        print(f"overhead {overhead:.3f} s ({verdict} the {TARGET_OVERHEAD_S} s target), ratio {ratio:.1f}x")
        if args.profile or overhead > TARGET_OVERHEAD_S:
            print("\nslowest imports of `import slurmkit.cli.submit` (cumulative, python -X importtime):")
            for us, mod in import_profile(env, tmp):
                print(f"  {us / 1e6:7.3f} s  {mod.strip()}")
    print(f"RESULT submit_median_s={m_ours:.4f} sbatch_median_s={m_base:.4f} "
          f"overhead_s={overhead:.4f} ratio={ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
