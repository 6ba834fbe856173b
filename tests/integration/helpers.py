"""Submitting real jobs from tests: run the real CLI, wait with the real Slurm client."""

from __future__ import annotations

import json
import os
import pwd
import re
import subprocess
import sys
import time
from collections.abc import Callable, Mapping

from slurmkit.slurm.client import SlurmClient
from slurmkit.slurm.errors import SlurmError
from slurmkit.slurm.runner import SubprocessRunner

#: The command of a job that only checks its world: every rank all-reduces its rank (slurmkit.examples).
ALLREDUCE = "job.command=[python,-m,slurmkit.examples.allreduce]"

TERMINAL = ["COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED"]


# SLURMKIT_TEST_SUBMITTER=user (CI's Slurm 24.11 stage): every job a test submits through
# submit_cli is submitted by the local cluster's ordinary user (SLURMKIT_CLUSTER_USER), as at a
# site; the test itself stays root, the admin and the chaos agent (it kills nodes, signals ranks,
# reads every file). Unset: root submits, as on a laptop.
SUBMITTER_ENV = "SLURMKIT_TEST_SUBMITTER"


def submitter(env: Mapping[str, str] | None = None) -> pwd.struct_passwd | None:
    """The ordinary user the tests submit as, or None when they submit as themselves."""
    mode = os.environ.get(SUBMITTER_ENV, "")
    if mode in ("", "self"):
        return None
    if mode != "user":
        raise AssertionError(f"{SUBMITTER_ENV}={mode!r}: Detected: an unknown submitter; "
                             "Requirement: 'user' (the local cluster's ordinary user) or 'self'; "
                             f"Fix: unset {SUBMITTER_ENV} or set it to 'user'")
    if env is None or not env.get("SLURMKIT_CLUSTER_USER"):
        state = os.environ.get("SLURMKIT_CLUSTER_DIR", "/tmp/slurmkit-cluster")
        try:
            env = read_json(os.path.join(state, "env.json"))
        except (OSError, ValueError):
            env = {}
    name = env.get("SLURMKIT_CLUSTER_USER")
    if not name:
        raise AssertionError(f"{SUBMITTER_ENV}=user: Detected: the local cluster names no ordinary user; "
                             "Requirement: SLURMKIT_CLUSTER_USER in its env.json; Fix: tools/local-cluster up")
    pw = pwd.getpwnam(name)
    if pw.pw_uid == 0:
        raise AssertionError(f"{SUBMITTER_ENV}=user: the cluster's user {name} is root")
    return pw


def submitter_uid(env: Mapping[str, str] | None = None) -> int:
    """The uid the tests' jobs run as (their node-local files are under /dev/shm/slurmkit-<uid>)."""
    pw = submitter(env)
    return os.getuid() if pw is None else pw.pw_uid


def user_env(env: Mapping[str, str], pw: pwd.struct_passwd, home: str) -> dict[str, str]:
    """What the user's login shell would hold: PATH, the cluster's SLURM_CONF and its site conf
    directory (SLURMKIT_CONF_DIR, as a site's module or profile.d sets it), the S3 keys it was
    given; its own HOME and USER, nothing else of root's."""
    keep = {k: v for k, v in env.items()
            if k in ("PATH", "SLURM_CONF", "SLURMKIT_CONF_DIR", "LANG", "LC_ALL", "TZ")
            or k.startswith(("AWS_", "SLURMKIT_S3_"))}
    return {**keep, "HOME": home, "USER": pw.pw_name, "LOGNAME": pw.pw_name}


def hand_to_user(path: str, pw: pwd.struct_passwd) -> None:
    """Give ``path`` (a test's own temporary directory) and what is in it to the user, and let the
    user pass through the directories above it that are closed to others (pytest's are 0700):
    an ACL entry for that one user, nothing opened to everyone."""
    for d, dirs, files in os.walk(path):
        for n in [d, *(os.path.join(d, f) for f in dirs + files)]:
            os.lchown(n, pw.pw_uid, pw.pw_gid)
    d = os.path.dirname(os.path.realpath(path))
    while d != "/":
        if not os.stat(d).st_mode & 0o001:
            subprocess.run(["setfacl", "-m", f"u:{pw.pw_name}:x", d], check=True, capture_output=True, timeout=30)
        d = os.path.dirname(d)


def submit_cli(args: list[str], env: Mapping[str, str], cwd: str,
               timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    """``python -m slurmkit.submit ARGS`` from ``cwd``: as this process, or as the cluster's
    ordinary user (SUBMITTER_ENV), who then owns ``cwd``, with a login shell's environment and
    the SLURMKIT_* variables the test set."""
    return run_as_submitter([sys.executable, "-m", "slurmkit.submit", *args], env, cwd, timeout_s)


def run_as_submitter(cmd: list[str], env: Mapping[str, str], cwd: str,
                     timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    """``cmd`` from ``cwd`` as whoever submits this session's jobs (see ``submit_cli``): a test
    that edits a rendered script and calls ``sbatch`` itself submits as the same user."""
    pw = submitter(env)
    if pw is None:
        return subprocess.run(cmd, env=dict(env), cwd=cwd, capture_output=True, text=True, timeout=timeout_s)
    hand_to_user(cwd, pw)
    # What the test sets for slurmkit (a cache directory, a fault to inject) goes along.
    own = {**user_env(env, pw, cwd), **{k: v for k, v in env.items() if k.startswith("SLURMKIT_")}}
    return subprocess.run(["runuser", "-u", pw.pw_name, "--", "env", "-i", *(f"{k}={v}" for k, v in own.items()),
                           *cmd], cwd=cwd, capture_output=True, text=True, timeout=timeout_s)


def wait_for(cond: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 0.2) -> None:
    """Wait on a condition (never a fixed sleep); fail saying what never came."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(poll_s)


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
    handed the run over to a successor job is followed to it: slurmkit.supervise.exits.successor)."""
    from slurmkit.supervise.exits.successor import successor_of

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
    from slurmkit.ledger.ledger import read_ledger as _read

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


#: What the store tests' rank processes import: loaded once by the forkserver below.
WORKER_MODULES = ["torch", "torch.distributed", "torch.distributed.checkpoint", "torch._dynamo",
                  "slurmkit.store", "tests.integration.store_workers", "tests.integration.buddy_workers",
                  "tests.integration.promotion_workers", "tests.integration.store_hostile_workers"]


def start_workers(fn, args: tuple, nprocs: int) -> None:
    """``nprocs`` real rank processes running ``fn(rank, *args)`` (torch.distributed over gloo),
    joined; a worker's exception fails the caller with its traceback. They are forked from one
    forkserver per pytest process that imported torch, DCP and the workers' modules once: a
    spawned worker paid 5-7 s of CPU importing them, each, about forty times a CI run. Each
    worker is still a process of its own (its own gloo group, its own file descriptors); it
    inherits the forkserver's environment, so what a worker needs is passed in ``args``."""
    import multiprocessing

    import torch.multiprocessing as mp

    multiprocessing.set_forkserver_preload(WORKER_MODULES)  # before the forkserver's first start
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")


def printed_steps(run_dir: str) -> dict[tuple[int, int], tuple[float, float]]:
    """(generation, step) -> (loss, time) from the lines ``generation G step N loss L at T`` that
    the user programs of these tests print on rank 0: their own log of their progress."""
    out = {}
    with open(os.path.join(run_dir, "logs", "rank0.log"), errors="replace") as f:
        for m in re.finditer(r"^generation (\d+) step (\d+) loss (\S+) at (\S+)$", f.read(), re.M):
            out[int(m.group(1)), int(m.group(2))] = (float(m.group(3)), float(m.group(4)))
    return out
