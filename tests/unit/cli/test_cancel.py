"""``slurmkit cancel``: what it asks Slurm, the request file, and the ledger's last word.

The agents' side (checkpoint, then end CANCELLED without a requeue) runs on the real cluster
in tests/integration/test_watch_slurm.py; here FakeSlurm plays the job.
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
from pathlib import Path

from rich.console import Console

from slurmkit.cli.cancel import Canceller, Target, cancel, stop_local_runner
from slurmkit.jobstates import JobPoller, JobRef
from slurmkit.ledger.ledger import LEDGER_NAME, read_ledger
from slurmkit.slurm.client import SlurmClient
from slurmkit.slurm.retry import RetryPolicy
from slurmkit.supervise.cancel_request import cancel_request_path, read_cancel_request
from testkit.fakeslurm import FakeSlurm
from tests.unit.watch_runs import FakeRun


def _setup(tmp_path: Path, start: bool) -> tuple[FakeSlurm, FakeRun, Target]:
    fake = FakeSlurm()
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\n#SBATCH -N2\n#SBATCH --requeue\nsrun x\n")
    job = fake.run(["sbatch", "--parsable", str(script)]).stdout.strip()
    run = FakeRun(str(tmp_path / "r"))
    run.submitted(job_id=job)
    if start:
        fake.start(job)
        run.allocation(job_id=job)
        run.start_generation()
    return fake, run, Target(run.run_dir, JobRef(job, "slurm"))


def _canceller(fake: FakeSlurm, on_sleep=None) -> Canceller:  # type: ignore[no-untyped-def]
    client = SlurmClient(fake, retry=RetryPolicy(sleep=lambda s: None))
    t = [0.0]

    def sleep(s: float) -> None:
        t[0] += s
        if on_sleep is not None:
            on_sleep()

    return Canceller(client, JobPoller(client), user="alice", clock=lambda: t[0], sleep=sleep)


def _events(run: FakeRun) -> list[dict]:
    return list(read_ledger(os.path.join(run.run_dir, LEDGER_NAME)))


def _console() -> Console:
    return Console(file=io.StringIO())


def _controller() -> subprocess.Popen[str]:
    """A real process standing in for submitit's local controller: it exits 0 on SIGTERM."""
    code = ("import signal, sys\n"
            "signal.signal(signal.SIGTERM, lambda s, f: sys.exit(0))\n"
            "print('ready', flush=True)\n"
            "signal.pause()\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def test_checkpoint_cancel_signals_the_agents_and_leaves_the_end_to_node0(tmp_path: Path) -> None:
    fake, run, target = _setup(tmp_path, start=True)
    seen_request: list[dict | None] = []

    def node0_agent() -> None:  # what the agent does on SIGUSR1 with a cancel request present
        seen_request.append(read_cancel_request(run.run_dir))
        run.agent.append("checkpointed_on_signal", generation=0, signal="cancel", step=12)
        run.agent.append("end", status="cancelled", signal="cancel", exit_code=0)
        fake.run(["scancel", target.ref.job_id])

    final = cancel([target], _canceller(fake, node0_agent), checkpoint=True, timeout_s=60,
                   console=_console())
    assert final[target.ref].state == "CANCELLED"
    assert ["scancel", "--signal=USR1", target.ref.job_id] in fake.calls
    assert fake.jobs[target.ref.job_id].signals == ["USR1"]
    request = seen_request[0]
    assert request is not None and request["by"] == "alice" and request["job_id"] == target.ref.job_id
    assert not os.path.exists(cancel_request_path(run.run_dir))  # gone once the job is over
    kinds = [(e["event"], e.get("source")) for e in _events(run)][-3:]
    assert kinds == [("cancel_requested", "cancel"), ("checkpointed_on_signal", "agent:node1"),
                     ("end", "agent:node1")]  # node 0's end is the last word: no second one


def test_a_pending_job_is_cancelled_at_once(tmp_path: Path) -> None:
    fake, run, target = _setup(tmp_path, start=False)
    final = cancel([target], _canceller(fake), checkpoint=True, timeout_s=60, console=_console())
    assert final[target.ref].state == "CANCELLED"
    assert ["scancel", target.ref.job_id] in fake.calls
    assert not any("--signal=USR1" in c for c in fake.calls)
    assert not os.path.exists(cancel_request_path(run.run_dir))
    ends = [e for e in _events(run) if e["event"] == "end"]
    assert [(e["status"], e["source"], e["job_state"]) for e in ends] == [("cancelled", "cancel", "CANCELLED")]


def test_no_checkpoint_in_time_cancels_anyway(tmp_path: Path) -> None:
    fake, run, target = _setup(tmp_path, start=True)
    final = cancel([target], _canceller(fake), checkpoint=True, timeout_s=5, console=_console())
    assert final[target.ref].state == "CANCELLED"
    events = [e["event"] for e in _events(run)]
    assert events[-3:] == ["cancel_requested", "cancel_forced", "end"]
    assert fake.calls.index(["scancel", "--signal=USR1", target.ref.job_id]) < \
        fake.calls.index(["scancel", target.ref.job_id])


def test_a_finished_job_is_left_alone(tmp_path: Path) -> None:
    fake, run, target = _setup(tmp_path, start=True)
    fake.finish(target.ref.job_id)
    before = len(_events(run))
    final = cancel([target], _canceller(fake), checkpoint=False, timeout_s=5, console=_console())
    assert final[target.ref].state == "COMPLETED"
    assert not any(c[0] == "scancel" for c in fake.calls) and len(_events(run)) == before


def test_local_checkpoint_cancel_sends_sigterm_to_the_controller(tmp_path: Path) -> None:
    proc = _controller()
    run = FakeRun(str(tmp_path / "r"))
    run.submitted(job_id=str(proc.pid), executor="local")
    target = Target(run.run_dir, JobRef(str(proc.pid), "local"))
    sent: list[int] = []

    def kill(pid: int, sig: int) -> None:
        sent.append(sig)
        os.kill(pid, sig)

    def sleep(s: float) -> None:
        proc.poll()  # reap it once it exited, as its parent (submit) would

    canceller = Canceller(None, JobPoller(None), user="bob", kill=kill, sleep=sleep)
    final = cancel([target], canceller, checkpoint=True, timeout_s=600, console=_console())
    assert sent == [signal.SIGTERM] and proc.wait() == 0
    assert final[target.ref].over
    assert [e["event"] for e in _events(run)][-2:] == ["cancel_requested", "end"]


def test_a_local_sweep_runner_is_stopped_only_while_it_is_that_runner(tmp_path: Path) -> None:
    import json

    code = "import sys; sys.stdin.read()"
    runner = subprocess.Popen([sys.executable, "-c", code, "slurmkit.sweep.local"], stdin=subprocess.PIPE)
    other = subprocess.Popen([sys.executable, "-c", code, "something-else"], stdin=subprocess.PIPE)
    try:
        for proc, expected in ((other, False), (runner, True)):
            (tmp_path / "sweep.json").write_text(json.dumps(
                {"kind": "sweep", "name": "s", "job_id": None, "runner_pid": proc.pid, "variants": []}))
            assert stop_local_runner(str(tmp_path)) is expected
        assert runner.wait() == -signal.SIGTERM
        assert other.poll() is None  # a reused pid of another program is left alone
    finally:
        for proc in (runner, other):
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def test_a_handover_that_raced_the_cancel_is_cancelled_too(tmp_path: Path) -> None:
    """Node 0 had submitted a successor job (supervise/exits/successor.py) just before the user's
    cancel reached the old job: the run must not go on in the successor."""
    fake, run, target = _setup(tmp_path, start=True)
    script = tmp_path / "job.sh"
    handed: list[str] = []

    def node0_hands_over() -> None:  # the agent's handover, already under way when cancelled
        if not handed:
            new = fake.run(["sbatch", "--parsable", "--hold", f"--dependency=afterany:{target.ref.job_id}",
                            str(script)]).stdout.strip()
            run.agent.append("successor", job_id=new, predecessor=target.ref.job_id, exclude=["node2"])
            fake.run(["scontrol", "release", new])
            handed.append(new)

    node0_hands_over()
    final = cancel([target], _canceller(fake), checkpoint=False, timeout_s=60, console=_console())
    (new,) = handed
    assert final[target.ref].state == "CANCELLED"
    assert ["scancel", new] in fake.calls and final[JobRef(new, "slurm")].state == "CANCELLED"
    ends = [e for e in _events(run) if e["event"] == "end"]
    assert [(e["status"], e["job_id"]) for e in ends] == [("cancelled", new)]  # one end, the newest job's
    asked = [e["job_id"] for e in _events(run) if e["event"] == "cancel_requested"]
    assert asked == [target.ref.job_id, new]


def test_a_running_job_with_no_step_yet_is_cancelled_outright(tmp_path: Path) -> None:
    """Slurm 23.11+ refuses ``scancel --signal`` before the job's first step: nothing to save."""
    fake, run, target = _setup(tmp_path, start=True)
    fake.fail_next(message=f"scancel: error: Kill job error on job id {target.ref.job_id}: "
                           "Invalid job id specified\n", command="scancel")
    final = cancel([target], _canceller(fake), checkpoint=True, timeout_s=60, console=_console())
    assert final[target.ref].state == "CANCELLED"
    assert fake.calls.index(["scancel", "--signal=USR1", target.ref.job_id]) < \
        fake.calls.index(["scancel", target.ref.job_id])
    assert fake.jobs[target.ref.job_id].signals == []


def test_a_run_that_ended_by_itself_keeps_its_own_end(tmp_path: Path) -> None:
    """A local run that completes while `cancel --checkpoint` waits for it: its `completed`
    stays the ledger's last word (a `cancelled` after it made status say it was cancelled)."""
    proc = _controller()
    run = FakeRun(str(tmp_path / "r"))
    run.submitted(job_id=str(proc.pid), executor="local")
    run.allocation(job_id=str(proc.pid))
    run.start_generation()
    target = Target(run.run_dir, JobRef(str(proc.pid), "local"))

    def sleep(s: float) -> None:  # the run reaches its last step first, then the job ends
        if not [e for e in _events(run) if e["event"] == "end"]:
            run.finish(60)
        proc.poll()

    final = cancel([target], Canceller(None, JobPoller(None), user="bob", sleep=sleep), checkpoint=True,
                   timeout_s=600, console=_console())
    assert final[target.ref].over and proc.wait() == 0
    ends = [e for e in _events(run) if e["event"] == "end"]
    assert [e["status"] for e in ends] == ["completed"], ends
