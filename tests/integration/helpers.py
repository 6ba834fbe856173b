"""Submitting real jobs from tests: run the real CLI, wait with the real Slurm client."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Mapping

from slurmkit.slurm.client import SlurmClient
from slurmkit.slurm.errors import SlurmError
from slurmkit.slurm.runner import SubprocessRunner

TERMINAL = ["COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED"]


def submit_cli(args: list[str], env: Mapping[str, str], cwd: str,
               timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "slurmkit.submit", *args], env=dict(env), cwd=cwd,
                          capture_output=True, text=True, timeout=timeout_s)


def parse_submitted(stdout: str) -> tuple[str, str]:
    """(job id, run dir) from submit's output."""
    job = re.search(r"job (\S+) \((slurm|local)\)", stdout)
    run_dir = re.search(r"run directory : (\S+)", stdout)
    if not job or not run_dir:
        raise AssertionError(f"submit printed no job id / run dir:\n{stdout}")
    return job.group(1), run_dir.group(1)


def slurm_env(cluster_env: Mapping[str, str]) -> dict[str, str]:
    return {**os.environ, **cluster_env}


def wait_terminal(job_id: str, env: Mapping[str, str], timeout_s: float = 300,
                  run_dir: str | None = None) -> str:
    """The terminal state of ``job_id``; with ``run_dir``, of the last job of the run (a job that
    handed the run over to a successor job is followed to it: slurmkit.supervise.successor)."""
    from slurmkit.supervise.successor import successor_of

    client = SlurmClient(SubprocessRunner(env=env))
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            state = client.wait_for_state(job_id, TERMINAL, max(deadline - time.monotonic(), 1.0), poll_s=0.5,
                                          source="sacct")
        except SlurmError:  # timed out, or ended in a state the list lacks: report what it is now
            return client.job_state(job_id, source="sacct")
        nxt = successor_of(run_dir, job_id) if run_dir is not None else None
        if nxt is None:
            return state
        job_id = nxt


def read_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def read_ledger(run_dir: str) -> list[dict]:
    from slurmkit.supervise.ledger import read_ledger as _read

    return list(_read(os.path.join(run_dir, "ledger.jsonl")))


FREEZER = "/sys/fs/cgroup/freezer"


def job_cgroup_tasks(job_id: str) -> dict[str, list[str]]:
    """Under proctrack/cgroup: every process still in a cgroup of ``job_id`` on any emulated
    node (``<freezer>/slurm_<node>/uid_<uid>/job_<id>/.../tasks``), by cgroup path."""
    import glob

    out: dict[str, list[str]] = {}
    for tasks in glob.glob(os.path.join(FREEZER, "slurm*", "uid_*", f"job_{job_id}", "**", "tasks"), recursive=True):
        try:
            with open(tasks) as f:
                pids = f.read().split()
        except OSError:  # removed while read: empty
            continue
        if pids:
            out[os.path.dirname(tasks)] = pids
    return out


def proctrack(env: Mapping[str, str]) -> str:
    """The cluster's ProctrackType plugin without its prefix (``cgroup``, ``linuxproc``)."""
    res = subprocess.run(["scontrol", "show", "config"], env=dict(env), capture_output=True, text=True, timeout=60)
    for line in res.stdout.splitlines():
        if line.startswith("ProctrackType"):
            return line.split("=", 1)[1].strip().removeprefix("proctrack/")
    return "unknown"
