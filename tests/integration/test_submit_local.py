"""Local mode on a machine without Slurm: the same submit path, the embedded local executor."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from slurmkit.ledger.ledger import read_ledger
from tests.integration.helpers import ALLREDUCE, parse_submitted, read_json, submit_cli, wait_for

pytestmark = pytest.mark.integration


def test_local_mode_on_a_path_without_slurm(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    env["PATH"] = os.path.dirname(sys.executable)
    res = submit_cli(["+exp=tiny", "job.name=laptop", "submit.wait=true", ALLREDUCE,
                      f"submit.run_root={tmp_path}"], env, str(tmp_path), timeout_s=300)
    assert res.returncode == 0, res.stdout + res.stderr
    job_id, run_dir = parse_submitted(res.stdout)
    assert "(local)" in res.stdout
    out = read_json(os.path.join(run_dir, "allreduce.json"))
    assert out["world_size"] == 4 and out["sum"] == 6.0
    # the report's header reads what was asked for from the ledger (no git repository here)
    (sub,) = [e for e in read_ledger(os.path.join(run_dir, "ledger.jsonl")) if e["event"] == "submitted"]
    assert sub["overrides"] == ["+exp=tiny", "job.name=laptop", "submit.wait=true", ALLREDUCE,
                                f"submit.run_root={tmp_path}"] and "commit" not in sub, sub


def _events(run_dir: str) -> list[str]:
    path = os.path.join(run_dir, "ledger.jsonl")
    if not os.path.exists(path):
        return []
    return [e["event"] for e in read_ledger(path)]


def test_ctrl_c_while_waiting_detaches_and_the_job_runs_on(tmp_path, request) -> None:
    """Ctrl-C at a terminal is SIGINT to its whole foreground process group: the waiting submit
    and, before the fix, submitit's local controller and every agent with it (no `end` record,
    `status` showed the run gone forever). Now the waiting stops, the job runs on, `status` says
    so, and `cancel` ends it with its `end` record."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    env["PATH"] = os.path.dirname(sys.executable) + ":/usr/bin:/bin"
    proc = subprocess.Popen(
        [sys.executable, "-m", "slurmkit.submit", "+exp=tiny", "job.name=detach", "submit.wait=true",
         "job.nodes=1", "job.ranks_per_node=1", "job.command=[sleep,600]", f"submit.run_root={tmp_path}"],
        env=env, cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job
        # as at a terminal, whatever this test runs under (a background job of a script, as
        # CI's streams are, has SIGINT ignored, and its children inherit that)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    run_dir = ""
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # submit prints where the run is, then waits
            if "run directory :" in line:
                run_dir = line.split(":", 1)[1].strip()
                break
        assert run_dir, proc.stderr.read() if proc.stderr else ""
        wait_for(lambda: "ranks_started" in _events(run_dir), timeout_s=120, what="the rank's start")
        os.killpg(proc.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        if run_dir and "end" not in _events(run_dir):  # nothing this test starts outlives it
            request.addfinalizer(lambda: subprocess.run([sys.executable, "-m", "slurmkit.cancel", run_dir],
                                                        env=env, capture_output=True, timeout=180))
    assert proc.returncode == 130, out + err
    assert "detached" in err and f"slurmkit status --watch {run_dir}" in err, err
    status = subprocess.run([sys.executable, "-m", "slurmkit.status", run_dir], env=env, capture_output=True,
                            text=True, timeout=120)
    assert status.returncode == 0 and "RUNNING" in status.stdout, status.stdout + status.stderr
    assert "end" not in _events(run_dir)
    cancel = subprocess.run([sys.executable, "-m", "slurmkit.cancel", run_dir], env=env, capture_output=True,
                            text=True, timeout=180)
    assert cancel.returncode == 0, cancel.stdout + cancel.stderr
    wait_for(lambda: "end" in _events(run_dir), timeout_s=120, what="the job's end record")
