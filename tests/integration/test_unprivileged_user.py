"""A run submitted by an ordinary user, as at a site (issue 12), on the real local cluster.

tools/local-cluster creates a system account (SLURMKIT_CLUSTER_USER) and lets it reach this
Python and the project; slurm.conf and munged's socket are in the cluster's public directory.
The user submits with its own environment from a directory of its own; Slurm runs the job as
that user, tracked in the job's cgroup where the cluster runs proctrack/cgroup. A node of the
run is lost: node 0's agent, as the user, hands the run to a successor job without the node
(scontrol update of its own job, sbatch --hold, scontrol release: what a user may do), and the
run completes bit for bit equal to the uninterrupted one. Nothing runs as root on the way.
This is also the suite's one test of a node lost without a spare on a run of several nodes (the
successor's timing, Slurm's accounting of the old job, the jobs' cgroups left empty).
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import pytest

from slurmkit.slurm.client import SlurmClient
from slurmkit.slurm.runner import SubprocessRunner
from slurmkit.supervise.exits.successor import successor_chain
from testkit.chaos import procs
from tests.integration.faults import (
    COMMON, INTERVAL, diagnose, events, final, finish, kill_node, mark_fault, restore_node, wait_for_step,
)
from tests.integration.helpers import job_cgroup_tasks, parse_submitted, proctrack, slurm_env, user_env

pytestmark = [pytest.mark.integration, pytest.mark.slurm_version]  # CI: on 22.05 and 24.11


@pytest.fixture(scope="module")
def env(cluster_env) -> dict[str, str]:
    return slurm_env(cluster_env)


@pytest.fixture
def user(cluster_env, env) -> Iterator[tuple[pwd.struct_passwd, str]]:
    """The cluster's ordinary user and a directory of its own (mode 700) to submit from; its
    jobs are cancelled afterwards whatever the test did."""
    name = cluster_env.get("SLURMKIT_CLUSTER_USER")
    assert name, "the local cluster names no ordinary user: run `tools/local-cluster up` again"
    pw = pwd.getpwnam(name)
    assert pw.pw_uid != 0
    home = tempfile.mkdtemp(prefix="slurmkit-user-", dir="/tmp")
    os.chown(home, pw.pw_uid, pw.pw_gid)
    try:
        yield pw, home
    finally:
        subprocess.run(["scancel", "-u", name], env=env, capture_output=True, timeout=30)
        deadline = time.monotonic() + 120
        while subprocess.run(["squeue", "-h", "-u", name, "-o", "%i"], env=env, capture_output=True,
                             text=True, timeout=30).stdout.strip() and time.monotonic() < deadline:
            time.sleep(0.5)
        shutil.rmtree(home, ignore_errors=True)


def as_user(pw: pwd.struct_passwd, home: str, env: dict[str, str], args: list[str]) -> subprocess.CompletedProcess[str]:
    own = user_env(env, pw, home)
    return subprocess.run(["runuser", "-u", pw.pw_name, "--", "env", "-i", *(f"{k}={v}" for k, v in own.items()),
                           sys.executable, "-m", "slurmkit.submit", *args],
                          cwd=home, capture_output=True, text=True, timeout=120)


def test_an_ordinary_users_run_loses_a_node_and_completes_in_a_successor_job(env, reference, user) -> None:
    pw, home = user
    res = as_user(pw, home, env, [*COMMON, "job.name=u-requeue", f"submit.run_root={home}"])
    assert res.returncode == 0, res.stdout + res.stderr
    job, run_dir = parse_submitted(res.stdout)
    assert os.stat(run_dir).st_uid == pw.pw_uid and not os.stat(run_dir).st_mode & 0o007

    step = wait_for_step(run_dir, 3, 13, uid=pw.pw_uid)  # its beats: /dev/shm/slurmkit-<its uid>
    (start,) = events(run_dir, "allocation_start")
    lost = str(start["train_nodes"][1])
    mark_fault(run_dir, "node_loss", node=lost, step=step)
    try:
        kill_node(env, lost)
        state = finish(job, env, timeout_s=600, run_dir=run_dir)
    finally:
        restore_node(env, lost)
    story = diagnose(run_dir, job, env)
    assert state == "COMPLETED", f"job {job} ended {state}\n{story}"
    assert final(run_dir)["param_sha256"] == reference, story
    restored = [e["step"] for e in events(run_dir, "ckpt_restored")]
    assert restored and max(restored) >= step - INTERVAL, (restored, step)

    # The user's agent made the handover itself: a successor job without the lost node, started
    # at once (not after Slurm's ~120 s requeue hold), decided as a node loss.
    assert events(run_dir, "failure")[0]["cls"] == "node_loss", story
    (requeue,) = events(run_dir, "requeue")
    assert requeue["exclude"] == [lost], story
    (handover,) = events(run_dir, "successor")
    assert handover["predecessor"] == job and handover["exclude"] == [lost], story
    assert not events(run_dir, "successor_refused") and not events(run_dir, "requeue_refused"), story
    chain = successor_chain(run_dir, job)
    assert chain == [job, handover["job_id"]], (chain, story)
    starts = events(run_dir, "allocation_start")
    assert len(starts) == 2 and lost not in starts[1]["nodes"], story
    assert starts[1]["job_id"] == handover["job_id"] != job and starts[1]["predecessor"] == job, story
    assert starts[1]["t"] - requeue["t"] < 60, starts[1]["t"] - requeue["t"]
    (prev,) = events(run_dir, "previous_attempt")
    assert prev["attempt"] == f"{job}-0" and prev["handled_by"] == "slurmkit", prev

    # Both jobs were the user's, in Slurm's accounting; every file of the run is the user's.
    client = SlurmClient(SubprocessRunner(env=env))
    # The old job ended (NODE_FAIL: the lost node was still in it) and Slurm did not requeue it
    # itself (Requeue=0 before the handover): one allocation of it in accounting, not two.
    assert client.job_state(job, source="sacct") in ("COMPLETED", "NODE_FAIL")
    assert len([r for r in client.sacct(job, duplicates=True) if r.job_id == job]) == 1
    for j in chain:
        out = subprocess.run(["sacct", "-n", "-X", "-P", "-j", j, "-o", "User"], env=env,
                             capture_output=True, text=True, timeout=60).stdout.split()
        assert out == [pw.pw_name], (j, out)
    foreign = [os.path.join(d, n) for d, _, names in os.walk(run_dir) for n in names
               if os.lstat(os.path.join(d, n)).st_uid != pw.pw_uid]
    assert not foreign, foreign
    assert [e["status"] for e in events(run_dir, "end")] == ["completed"], story

    # Nothing either job started outlives it; under cgroup, Slurm's own view agrees.
    left = [f"{p.pid}: {' '.join(p.cmdline)}" for j in chain for p in procs.scan(run_dir, j)]
    assert not left, left
    if proctrack(env) == "cgroup":
        deadline = time.monotonic() + 60
        while (held := {k: v for j in chain for k, v in job_cgroup_tasks(j).items()}) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not held, held
    assert client.job_state(chain[-1], source="sacct") == "COMPLETED"
