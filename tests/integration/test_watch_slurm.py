"""The watch verbs against real jobs on the real local Slurm cluster.

- ``status --watch`` runs in a real terminal (tmux) next to a live ``+exp=tiny`` job: the
  screen shows the step advancing, then the job's end; ``runs`` and ``logs`` read the same run.
- ``cancel --checkpoint``: the ranks save a final checkpoint at the step they reached, node 0
  ends the run ``cancelled`` and Slurm records CANCELLED, with no requeue; then ``resume``
  submits a new job that restores that checkpoint and completes the run.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import shutil
import subprocess
import sys
import time

import pytest

from slurmkit.runview import last_json_line
from slurmkit.slurm.client import SlurmClient
from slurmkit.slurm.runner import SubprocessRunner
from tests.integration.helpers import (parse_submitted, read_ledger, run_as_submitter, slurm_env, submit_cli,
                                       wait_terminal)

pytestmark = pytest.mark.integration
# A busy test machine can starve an agent for seconds: no node-loss verdicts here.
SLOW_TINY = ["+exp=tiny", "model=micro", "+job.env.SLURMKIT_STEP_DELAY_S=0.3", "train.steps=40",
             "supervisor.node_timeout_s=20"]
STEP = re.compile(r"step\s+│\s+(\d+)/40")


def _submit(env: dict[str, str], tmp_path, name: str) -> tuple[str, str]:
    res = submit_cli([*SLOW_TINY, f"job.name={name}", f"submit.run_root={tmp_path}"], env, str(tmp_path))
    assert res.returncode == 0, res.stdout + res.stderr
    return parse_submitted(res.stdout)


def _until(what: str, check, timeout_s: float, poll_s: float = 0.5):  # type: ignore[no-untyped-def]
    """Wait for ``check()`` to return something true (the job may queue behind other tests)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out waiting for {what}")


class Tmux:
    """A tmux server of its own (own socket, started with the test's environment)."""

    def __init__(self, env: dict[str, str]) -> None:
        self.tmux = shutil.which("tmux")
        assert self.tmux, "tmux is missing: tools/local-cluster up installs it (apt-get install tmux)"
        self.socket = f"slurmkit-test-{secrets.token_hex(4)}"
        self.env = env

    def run(self, *args: str) -> str:
        res = subprocess.run([self.tmux, "-L", self.socket, *args], env=self.env, capture_output=True,
                             text=True, timeout=30)
        assert res.returncode == 0, res.stderr
        return res.stdout

    def start(self, command: str) -> None:
        self.run("new-session", "-d", "-s", "watch", "-x", "160", "-y", "48", command)

    def screen(self) -> str:
        return self.run("capture-pane", "-p", "-t", "watch")

    def close(self) -> None:
        subprocess.run([self.tmux, "-L", self.socket, "kill-server"], env=self.env,
                       capture_output=True, timeout=30)


def test_status_watch_in_a_terminal_shows_the_step_advancing(cluster_env, tmp_path) -> None:
    env = slurm_env(cluster_env)
    job_id, run_dir = _submit(env, tmp_path, "watched")
    tmux = Tmux(env)
    watch = shlex.join([sys.executable, "-m", "slurmkit.status", job_id, "--root", str(tmp_path),
                        "--watch", "--interval-s", "0.5", "--max-interval-s", "2"])
    # The shell keeps the pane open after the watch ends, so its last screen can be read.
    tmux.start(f"cd {shlex.quote(os.getcwd())} && {watch}; echo watch-exited-$?; exec sleep 3600")
    try:
        seen: list[int] = []

        def advanced() -> bool:
            m = STEP.search(tmux.screen())
            if m and (not seen or int(m.group(1)) != seen[-1]):
                seen.append(int(m.group(1)))
            return len(seen) >= 3 and seen[-1] > seen[0]

        _until("the watched step to advance", advanced, 600)
        assert seen == sorted(seen), seen  # the screen only ever shows the step growing

        def ended() -> str:
            screen = tmux.screen()
            return screen if "watch-exited-" in screen else ""

        final = _until("the watch to end", ended, 600)
    finally:
        tmux.close()
    assert wait_terminal(job_id, env) == "COMPLETED"
    assert "watch-exited-0" in final and "40/40" in final and "COMPLETED / completed" in final, final
    assert "goodput so far" in final, final
    tiers = {e["tier"] for e in read_ledger(run_dir) if e["event"] == "ckpt_saved" and e["step"] == 40}
    assert tiers and all(f"{tier} 40" in final for tier in tiers), (tiers, final)

    runs = subprocess.run([sys.executable, "-m", "slurmkit.runs", "--root", str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert runs.returncode == 0 and job_id in runs.stdout and "completed" in runs.stdout, runs.stdout
    agent = subprocess.run([sys.executable, "-m", "slurmkit.logs", run_dir, "--agent", "1", "-n", "200"],
                           env=env, capture_output=True, text=True, timeout=120)
    assert agent.returncode == 0 and "supervisor" in agent.stdout, agent.stdout + agent.stderr


def test_cancel_with_checkpoint_saves_then_ends_cancelled_without_requeue_and_resume_goes_on(cluster_env, tmp_path) -> None:
    env = slurm_env(cluster_env)
    job_id, run_dir = _submit(env, tmp_path, "cancelled")
    metrics = os.path.join(run_dir, "metrics.jsonl")
    _until("training to reach step 5", lambda: (last_json_line(metrics) or {}).get("step", 0) >= 5, 600)
    res = subprocess.run([sys.executable, "-m", "slurmkit.cancel", run_dir, "--checkpoint",
                          "--timeout-s", "240"], env=env, capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "final checkpoint requested" in res.stdout and f"job {job_id}: CANCELLED" in res.stdout
    events = read_ledger(run_dir)
    kinds = [e["event"] for e in events]
    stopped = next(e for e in events if e["event"] == "train_stopped")
    assert 5 <= stopped["step"] < 40
    assert f"final checkpoint at step {stopped['step']}" in res.stdout
    # The final checkpoint is of the step the ranks stopped at, saved after the request.
    asked = kinds.index("cancel_requested")
    assert any(e["event"] == "ckpt_saved" and e["step"] == stopped["step"] for e in events[asked:])
    signalled = next(e for e in events if e["event"] == "checkpointed_on_signal")
    assert signalled["signal"] == "cancel" and signalled["step"] == stopped["step"]
    end = [e for e in events if e["event"] == "end"]
    assert len(end) == 1 and end[0]["status"] == "cancelled" and end[0]["source"].startswith("agent:")
    assert "requeue" not in kinds and kinds.count("allocation_start") == 1
    assert not os.path.exists(os.path.join(run_dir, "cancel_request.json"))
    client = SlurmClient(SubprocessRunner(env=env))
    assert wait_terminal(job_id, env) == "CANCELLED"
    runs = [r for r in client.sacct(job_id, duplicates=True) if not r.is_step]
    assert [r.state for r in runs] == ["CANCELLED"], runs  # one run of the job: never requeued

    # `slurmkit resume`, by the user who submitted: a new Slurm job in the same run directory
    # goes on from that checkpoint to the end (issue 37: no documented way back in before).
    again = run_as_submitter([sys.executable, "-m", "slurmkit.resume", run_dir, "--wait", "--timeout-s", "600"],
                             env, str(tmp_path), timeout_s=700)
    assert again.returncode == 0, again.stdout + again.stderr
    events = read_ledger(run_dir)
    (resumed,) = [e for e in events if e["event"] == "submitted" and e["source"] == "resume"]
    assert resumed["resumes"] == job_id and resumed["job_id"] != job_id, resumed
    assert [e["step"] for e in events if e["event"] == "ckpt_restored"][:1] == [stopped["step"]], events[-12:]
    assert [e["status"] for e in events if e["event"] == "end"][-1] == "completed"
    assert wait_terminal(resumed["job_id"], env) == "COMPLETED"
    with open(os.path.join(run_dir, "final.json")) as f:
        assert json.load(f)["step"] == 40
