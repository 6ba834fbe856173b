"""The watch verbs as real processes, without Slurm.

- ``logs -f`` follows a rank log that another process keeps appending to.
- ``cancel --checkpoint`` of a local-executor ``+exp=tiny`` job: SIGTERM to submitit's local
  controller reaches the agents, the ranks save the step they reached and node 0 ends the run
  ``cancelled``; every process of the job is gone afterwards.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time

import pytest

from slurmkit.runview import last_json_line
from tests.integration.helpers import parse_submitted, read_ledger
from tests.unit.watch_runs import FakeRun

pytestmark = pytest.mark.integration


def _read_until(proc: subprocess.Popen[str], text: str, timeout_s: float) -> str:
    """Lines of ``proc``'s stdout until one contains ``text``."""
    assert proc.stdout is not None
    seen = ""
    deadline = time.monotonic() + timeout_s
    while text not in seen:
        left = deadline - time.monotonic()
        assert left > 0, f"no {text!r} from the follower; got {seen!r}"
        ready, _, _ = select.select([proc.stdout], [], [], left)
        if ready:
            line = proc.stdout.readline()
            assert line, f"the follower exited; got {seen!r}"
            seen += line
    return seen


def test_logs_follow_a_growing_rank_log(tmp_path) -> None:
    run = FakeRun(str(tmp_path / "r"))
    log = os.path.join(run.run_dir, "logs", "rank2.log")
    with open(log, "w") as f:
        f.write("before 1\nbefore 2\n")
    follower = subprocess.Popen([sys.executable, "-m", "slurmkit.logs", run.run_dir, "--rank", "2",
                                 "-n", "1", "-f"], stdout=subprocess.PIPE, text=True)
    try:
        first = _read_until(follower, "before 2", 120)
        assert "before 1" not in first
        with open(log, "a") as f:  # a writer that keeps going, line by line
            for i in range(5):
                f.write(f"step {i} \x1b[2J\n")
                f.flush()
                assert f"step {i} \\x1b[2J" in _read_until(follower, f"step {i}", 120)
    finally:
        follower.terminate()
        follower.wait(timeout=60)


RESUME_STEPS = 60


def test_local_cancel_with_checkpoint_then_resume(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    env["PATH"] = os.path.dirname(sys.executable) + ":/usr/bin:/bin"
    # Output to a file: the job's processes inherit it and outlive submit (a pipe would wait).
    out_path = tmp_path / "submit.out"
    with open(out_path, "w") as out_file:
        res = subprocess.run([sys.executable, "-m", "slurmkit.submit", "+exp=tiny", "model=micro", "cluster=local",
                              "job.name=localcancel", f"train.steps={RESUME_STEPS}", "train.ckpt_interval_steps=10",
                              "+job.env.SLURMKIT_STEP_DELAY_S=0.2", f"submit.run_root={tmp_path}"],
                             env=env, cwd=str(tmp_path), stdout=out_file, stderr=subprocess.STDOUT,
                             timeout=300)
    assert res.returncode == 0, out_path.read_text()
    job_id, run_dir = parse_submitted(out_path.read_text())
    metrics = os.path.join(run_dir, "metrics.jsonl")
    deadline = time.monotonic() + 600
    while (last_json_line(metrics) or {}).get("step", 0) < 3:
        assert time.monotonic() < deadline, "the local job never reached step 3"
        time.sleep(0.5)
    out = subprocess.run([sys.executable, "-m", "slurmkit.cancel", run_dir, "--checkpoint",
                          "--timeout-s", "300"], env=env, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stdout + out.stderr
    events = read_ledger(run_dir)
    stopped = next(e for e in events if e["event"] == "train_stopped")
    assert 3 <= stopped["step"] < RESUME_STEPS
    assert any(e["event"] == "ckpt_saved" and e["step"] == stopped["step"] for e in events)
    ends = [e for e in events if e["event"] == "end"]
    assert len(ends) == 1 and ends[0]["status"] == "cancelled" and ends[0]["source"].startswith("agent:")
    pids = [p for e in events if e["event"] == "ranks_started" for p in e["pids"]] + [int(job_id)]
    for pid in pids:  # the controller, the agents' ranks: nothing of the job is left running
        assert not os.path.exists(f"/proc/{pid}") or \
            open(f"/proc/{pid}/stat").read().rsplit(")", 1)[-1].split()[0] == "Z"


    # `slurmkit resume`: the same run directory goes on under a new job from that checkpoint
    again = subprocess.run([sys.executable, "-m", "slurmkit.resume", run_dir, "--wait"], env=env, cwd=str(tmp_path),
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout + again.stderr
    events = read_ledger(run_dir)
    (resubmitted,) = [e for e in events if e["event"] == "submitted" and e["source"] == "resume"]
    assert resubmitted["resumes"] == job_id and resubmitted["job_id"] != job_id, resubmitted
    restored = [e for e in events if e["event"] == "ckpt_restored"]
    assert [e["step"] for e in restored][:1] == [stopped["step"]], restored
    assert [e["status"] for e in events if e["event"] == "end"][-1] == "completed"
    with open(os.path.join(run_dir, "final.json")) as f:
        assert json.load(f)["step"] == RESUME_STEPS
    # a completed run is not resumed again
    twice = subprocess.run([sys.executable, "-m", "slurmkit.resume", run_dir], env=env, capture_output=True,
                           text=True, timeout=120)
    assert twice.returncode == 2 and "completed" in twice.stderr, twice.stderr
