"""``slurmkit status``: the figures shown, one Slurm query per refresh, backoff when idle, and
untrusted text never read as rich markup."""

from __future__ import annotations

import io
import json
from pathlib import Path

from rich.console import Console

from slurmkit.cli import status
from slurmkit.jobstates import JobPoller
from slurmkit.slurm.client import SlurmClient
from slurmkit.slurm.retry import RetryPolicy
from slurmkit.supervise.__main__ import load
from testkit.fakeslurm import FakeSlurm
from tests.unit.watch_runs import FakeRun, run_with_one_crash


def _console() -> Console:
    return Console(file=io.StringIO(), width=200, force_terminal=False)


def _out(c: Console) -> str:
    return c.file.getvalue()  # type: ignore[attr-defined]


def test_status_of_a_run_shows_its_figures(tmp_path: Path) -> None:
    run = run_with_one_crash(str(tmp_path / "r"))
    c = _console()
    assert status.main([run.run_dir], env={"PATH": ""}, console=c) == 0
    out = _out(c)
    last = json.loads(Path(run.run_dir, "metrics.jsonl").read_text().splitlines()[-1])
    for text in ("30/60", f"{last['loss']:.4f}", f"{last['tokens_per_s']:,.0f}",
                 f"{last['mfu']:.1%}", "nvme 20, lustre 20", "rank_crash 1",
                 f"{load(run.run_dir).goodput:.1%}", "4242 (slurm)", "node1, node2"):
        assert text in out, (text, out)


def test_untrusted_text_is_not_markup(tmp_path: Path) -> None:
    run = FakeRun(str(tmp_path / "r"))
    run.submitted()
    # YAML's double-quoted escapes: \e is ESC, \a is BEL (a terminal title sequence).
    Path(run.run_dir, "config.yaml").write_text(
        'job:\n  name: "[red]boom[/red] \\e]0;title\\a"\ntrain:\n  steps: 5\n')
    run.agent.append("failure", generation=0, cls="[bold]odd[/bold]", rank=0, node="n",
                     evidence="x", time_of_fault=run.clock())
    c = _console()
    status.main([run.run_dir], env={"PATH": ""}, console=c)
    out = _out(c)
    assert "[red]boom[/red]" in out and "[bold]odd[/bold] 1" in out
    assert "\x1b" not in out and "\x07" not in out


def test_watch_asks_slurm_once_per_refresh_and_backs_off_when_idle(tmp_path: Path) -> None:
    run = run_with_one_crash(str(tmp_path / "r"))
    fake = FakeSlurm()
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\n#SBATCH -N2\nsrun x\n")
    job = fake.run(["sbatch", "--parsable", str(script)]).stdout.strip()
    fake.start(job)
    run.submit.append("submitted", job_id=job, executor="slurm", name="tiny", nodes=2,
                      ranks_per_node=2, config_hash="abc")
    board = status.StatusBoard("run", run.run_dir)
    poller = JobPoller(SlurmClient(fake, retry=RetryPolicy(sleep=lambda s: None)))
    waits: list[float] = []
    # What happens during each wait: progress, three idle waits, progress, the end.
    script_of_waits = [lambda: run.step(31, 4.4), None, None, None, lambda: run.step(32, 4.3),
                       lambda: (run.finish(32), fake.finish(job))]

    def sleep(seconds: float) -> None:
        waits.append(seconds)
        act = script_of_waits[len(waits) - 1]
        if act is not None:
            act()

    c = _console()
    refreshes = status.watch(board, poller, c, interval_s=1.0, max_interval_s=8.0, sleep=sleep)
    assert refreshes == 6
    assert waits == [1.0, 1.0, 2.0, 4.0, 8.0, 1.0]
    squeues = [call for call in fake.calls if call[0] == "squeue"]
    assert len(squeues) == refreshes + 1  # the first draw and one per refresh, never more
    assert [call[0] for call in fake.calls].count("sacct") == 1  # once, when it left the queue
    out = _out(c)
    assert "32/60" in out and "COMPLETED / completed" in out


def test_sweep_shows_one_line_per_variant(tmp_path: Path) -> None:
    sweep = tmp_path / "tiny" / "stamp-sweep"
    variants = []
    for i in range(2):
        run = FakeRun(str(sweep / f"v{i}"))
        run.submitted(job_id=str(300 + i), executor="local")
        run.allocation(job_id=str(300 + i))
        run.start_generation()
        for s in range(1, 6 + 4 * i):
            run.step(s, 5.0 - i)
        variants.append({"index": i, "overrides": [f"train.lr={i + 1}e-3"], "run_dir": run.run_dir})
    (sweep / "sweep.json").write_text(json.dumps({"kind": "sweep", "name": "tiny", "job_id": None,
                                                  "array": "0-1", "variants": variants}))
    c = _console()
    # 1: both variants' local processes are gone without an `end` record
    assert status.main([str(sweep)], env={"PATH": ""}, console=c) == 1
    lines = [ln for ln in _out(c).splitlines() if "train.lr=" in ln]
    assert len(lines) == 2
    assert "train.lr=1e-3" in lines[0] and "5/60" in lines[0] and "5.0000" in lines[0]
    assert "train.lr=2e-3" in lines[1] and "9/60" in lines[1] and "4.0000" in lines[1]
    # local ids that are no live process, without an end record: Slurm's word, not "GONE"
    assert all("FAILED (no end record) / training" in ln for ln in lines)


def _code(run_dir: str) -> int:
    return status.main([run_dir], env={"PATH": ""}, console=_console())


def test_the_exit_code_says_whether_a_run_failed(tmp_path: Path) -> None:
    """0 running or ended well, 1 failed: a script (or CI) can act on `slurmkit status RUN`."""
    running = run_with_one_crash(str(tmp_path / "running"))
    assert _code(running.run_dir) == 0
    done = run_with_one_crash(str(tmp_path / "done"))
    done.finish(60)
    assert _code(done.run_dir) == 0
    for i, (status_, code) in enumerate([("stopped", 1), ("failed", 1), ("cancelled", 0), ("signalled", 0)]):
        run = FakeRun(str(tmp_path / f"e{i}"))
        run.submitted()
        run.allocation()
        run.agent.append("end", status=status_, exit_code=93 if code else 0, reason="test")
        assert _code(run.run_dir) == code, status_
    # a local job whose processes are gone without an `end` record (killed with its terminal)
    gone = FakeRun(str(tmp_path / "gone"))
    gone.submitted(job_id="999999999", executor="local")
    assert _code(gone.run_dir) == 1
    assert status.main([str(tmp_path / "nothing")], env={"PATH": ""}, console=_console()) == 2


def test_elapsed_time_limit_and_eta(tmp_path: Path) -> None:
    """Elapsed since submit, the time limit, and the steps left at the last step's pace."""
    run = run_with_one_crash(str(tmp_path / "r"))  # step 30 of 60, 0.5 s steps
    v = status.RunWatcher(run.run_dir)
    v.refresh()
    view = v.view
    assert view is not None and view.step == 30 and view.step_time_s == 0.5
    assert status.eta_text(view) == "15s at the last step's pace"  # 30 steps x 0.5 s
    assert status.elapsed_text(view, run.clock() + 60) == status.duration_text(
        run.clock() + 60 - view.submitted_at)  # type: ignore[operator]
    run.finish(60)
    v.refresh()
    done = v.view
    assert done is not None and done.ended and status.eta_text(done) == "-"
    # once ended, elapsed stops at the end record, however late status is asked
    assert status.elapsed_text(done, run.clock() + 10_000) == status.elapsed_text(done, run.clock())
    assert [status.duration_text(s) for s in (12, 250, 11_100, None)] == ["12s", "4m 10s", "3h 05m", "-"]
    c = _console()
    status.main([run.run_dir], env={"PATH": ""}, console=c)
    out = _out(c)
    assert "elapsed" in out and "ETA" in out and "time limit" in out
