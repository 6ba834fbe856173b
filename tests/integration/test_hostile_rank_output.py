"""What a rank writes cannot take its node agent down, and another user cannot keep it from
starting, on the real local Slurm cluster (issue 34, items 7 and 8).

hostile_rank_program.py runs on 2 nodes x 1 rank: each rank, between steps, puts garbage into
its heartbeat file (``null``, a number, 100,000-deep nesting, a 5,000-digit step, bytes that are
not UTF-8, a FIFO) and its event spool (the same shapes, a wrong type, a 300 KiB line; the last
rank's spool ends as a FIFO). Before the fix the first ``null`` beat raised TypeError in the
agent (agent_error: a lost node, a requeue without it). Now the job completes: no agent_error,
no failure, no node excluded or requeue; every spool refusal is in the ledger by file and
reason, rank 0's valid event after the garbage still reached it, and the ledger stays readable
by ``python -m slurmkit.supervise`` (the report's figures) and ``slurmkit status``.

Item 8: another user (root here) created ``<node-local root>/slurmkit-<uid>`` before the job, in
a sticky directory open to all, as /dev/shm is. Before the fix every agent of the job failed at
start with a LocalDirError traceback and no ``end`` event. Now the agents take a private
directory of their own (``slurmkit-<uid>-<random>``) and pass it to their ranks; the job completes.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from tests.integration.faults import diagnose, events, finish, submit
from tests.integration.helpers import read_ledger, slurm_env, submitter_uid

pytestmark = pytest.mark.integration
PROGRAM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hostile_rank_program.py")
STEPS, HOLD_S = 12, 1.2  # each garbage beat outlives two of the agent's polls (poll_interval_s 0.5)


def test_a_rank_that_writes_garbage_into_its_heartbeat_and_spool_completes(cluster_env, tmp_path) -> None:
    env = slurm_env(cluster_env)
    job, run_dir = submit(["+exp=tiny", "model=micro", "job.name=hostile-rank", "job.nodes=2", "job.ranks_per_node=1",
                           f"job.command=[python,{PROGRAM},'{STEPS}','{HOLD_S}']",
                           "supervisor.heartbeat_timeout_s=30"], env, str(tmp_path))
    state = finish(job, env, timeout_s=300, run_dir=run_dir)
    why = diagnose(run_dir, job, env)
    assert state == "COMPLETED", f"job {job} ended {state}\n{why}"
    for bad in ("agent_error", "failure", "exclusion", "requeue", "successor", "agent_relaunched"):
        assert events(run_dir, bad) == [], f"{bad}: {events(run_dir, bad)}\n{why}"
    end = events(run_dir, "end")[-1]
    assert end["status"] == "completed" and end["exit_code"] == 0, end
    assert os.path.exists(os.path.join(run_dir, "hostile_done.json")), why
    # Each rank's spool garbage was refused and named, by the agent of its own node.
    refused = events(run_dir, "rank_data_refused")
    files = {e["file"] for e in refused}
    assert {os.path.basename(f).split(".")[-2] for f in files} == {"rank0", "rank1"}, refused
    reasons = " | ".join(e["reason"] for e in refused)
    for shape in ("5000 digits", "nested deeper", "not an object", "not UTF-8", "is not int", "over 262144 bytes",
                  "not a regular file"):
        assert shape in reasons, f"{shape!r} not among the refusals: {reasons}"
    # The valid event rank 0 wrote after its garbage still reached the ledger.
    assert [e["step"] for e in events(run_dir, "ckpt_saved") if e.get("tier") == "user"] == [2]
    # The refused heartbeats are named in the agents' logs (never a traceback).
    logs = _agent_logs(run_dir)
    assert "heartbeat" in logs and "refused" in logs and "Traceback" not in logs, logs[-3000:]
    # The CLIs read the ledger whole.
    for verb in (["-m", "slurmkit.supervise", run_dir], ["-m", "slurmkit", "status", run_dir]):
        res = subprocess.run([sys.executable, *verb], env=dict(env), capture_output=True, text=True, timeout=120)
        assert res.returncode == 0 and "Traceback" not in res.stderr, res.stdout + res.stderr
    assert len(read_ledger(run_dir)) > 0


def _agent_logs(run_dir: str) -> str:
    out = []
    for d, _dirs, files in os.walk(run_dir):
        for name in files:
            if name.endswith((".out", ".err", ".log")) and "rank" not in name:
                with open(os.path.join(d, name), errors="replace") as f:
                    out.append(f.read())
    return "\n".join(out)


def test_a_node_local_directory_another_user_took_first_leaves_the_job_running(cluster_env, tmp_path) -> None:
    env = slurm_env(cluster_env)
    uid = submitter_uid(env)
    # Outside tmp_path: the test hands tmp_path and all in it to the submitting user.
    root = tempfile.mkdtemp(prefix="slurmkit-h4-shm-")
    try:
        os.chmod(root, 0o1777)  # as /dev/shm
        squatted = os.path.join(root, f"slurmkit-{uid}")
        os.mkdir(squatted, 0o755)  # root's, not the job user's (the test runs as root)
        if os.stat(squatted).st_uid == uid:
            pytest.skip("the job runs as this test's own user: nobody else can squat its directory here")
        env["SLURMKIT_NODE_LOCAL_DIR"] = root  # the job inherits the submitter's environment
        job, run_dir = submit(["+exp=tiny", "model=micro", "job.name=squatted-shm", "job.nodes=2", "job.ranks_per_node=1",
                               f"job.command=[python,{PROGRAM},'4','0.2']"], env, str(tmp_path))
        state = finish(job, env, timeout_s=300, run_dir=run_dir)
        why = diagnose(run_dir, job, env)
        assert state == "COMPLETED", f"job {job} ended {state}\n{why}"
        assert events(run_dir, "agent_error") == [] and events(run_dir, "exclusion") == [], why
        dirs = {e["heartbeat_dir"] for e in events(run_dir, "ranks_started")}
        assert dirs and all(d.startswith(f"{squatted}-") for d in dirs), dirs
        assert os.listdir(squatted) == [] and os.stat(squatted).st_uid != uid  # left as it was
        logs = _agent_logs(run_dir)
        assert f"{squatted} is owned by uid" in logs and "Traceback" not in logs, logs[-3000:]
    finally:
        shutil.rmtree(root, ignore_errors=True)
