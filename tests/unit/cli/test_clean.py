"""``slurmkit clean``: only runs that ended for good, only the user's own, past --keep and
--older-than-days; a list first, removal with --yes (issue 37: nothing ever removed a run)."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

from rich.console import Console

from slurmkit.cli import clean
from tests.unit.watch_runs import FakeRun


def _run(root: Path, name: str, end: str | None) -> FakeRun:
    run = FakeRun(str(root / "tiny" / name))
    run.submitted()
    run.allocation()
    Path(run.run_dir, "nvme").mkdir()
    Path(run.run_dir, "nvme", "shard.bin").write_bytes(b"x" * 100_000)
    if end:
        run.agent.append("end", status=end, exit_code=0)
    return run


def _clean(argv: list[str], **kw: object) -> tuple[int, str]:
    out = io.StringIO()
    code = clean.main(argv, Console(file=out, width=300), **kw)  # type: ignore[arg-type]
    return code, out.getvalue()


def test_lists_then_removes_only_what_ended_for_good(tmp_path: Path) -> None:
    done = _run(tmp_path, "a-done", "completed")
    failed = _run(tmp_path, "b-failed", "stopped")
    running = _run(tmp_path, "c-running", None)
    handed = _run(tmp_path, "d-handed", "signalled")  # a requeued job goes on with it
    code, out = _clean(["--root", str(tmp_path)])
    assert code == 0 and "would remove 2 run(s)" in out and "--yes" in out
    assert os.path.isdir(done.run_dir) and os.path.isdir(failed.run_dir)  # only listed
    code, out = _clean(["--root", str(tmp_path), "--yes"])
    assert code == 0 and "removed 2 run(s)" in out
    assert not os.path.exists(done.run_dir) and not os.path.exists(failed.run_dir)
    assert os.path.isdir(running.run_dir) and os.path.isdir(handed.run_dir)
    running.agent.append("end", status="completed", exit_code=0)
    handed.agent.append("end", status="cancelled", exit_code=0)
    assert _clean(["--root", str(tmp_path), "--yes"])[0] == 0
    assert not (tmp_path / "tiny").exists() and tmp_path.is_dir()  # the emptied job.name folder too


def test_keep_age_and_owner(tmp_path: Path) -> None:
    runs = [_run(tmp_path, f"r{i}", "completed") for i in range(3)]
    for i, r in enumerate(runs):  # r0 oldest
        t = 1_000_000 + i * 86400
        os.utime(os.path.join(r.run_dir, "ledger.jsonl"), (t, t))
    now = 1_000_000 + 2 * 86400 + 3600
    found = clean.finished_runs(str(tmp_path), os.getuid())
    assert [os.path.basename(f.path) for f in found] == ["r2", "r1", "r0"] and found[0].size >= 100_000
    assert [os.path.basename(f.path) for f in clean.select(found, older_than_s=0, keep=1, now=now)] == ["r1", "r0"]
    assert [os.path.basename(f.path) for f in clean.select(found, older_than_s=1.5 * 86400, keep=0, now=now)] == ["r0"]
    assert clean.finished_runs(str(tmp_path), os.getuid() + 1) == []  # another user's runs stay
    code, out = _clean(["--root", str(tmp_path), "--yes"], uid=os.getuid() + 1)
    assert code == 0 and "nothing to remove" in out and all(os.path.isdir(r.run_dir) for r in runs)


def test_a_sweep_goes_whole_once_every_variant_ended(tmp_path: Path) -> None:
    sweep = tmp_path / "tiny" / "stamp-sweep"
    variants = [_run(sweep, f"v{i}", "completed" if i == 0 else None) for i in range(2)]
    (sweep / "sweep.json").write_text(json.dumps({
        "kind": "sweep", "name": "tiny", "job_id": None, "array": "0-1",
        "variants": [{"index": i, "overrides": [], "run_dir": v.run_dir} for i, v in enumerate(variants)]}))
    assert clean.finished_runs(str(tmp_path), os.getuid()) == []  # v1 still runs: not even v0 goes
    variants[1].agent.append("end", status="failed", exit_code=93)
    found = clean.finished_runs(str(tmp_path), os.getuid())
    assert [(f.kind, f.status) for f in found] == [("sweep", "completed,failed")]
    assert _clean(["--root", str(tmp_path), "--yes"])[0] == 0 and not sweep.exists()


def test_a_missing_root_is_a_clear_error(tmp_path: Path, capsys) -> None:
    assert clean.main(["--root", str(tmp_path / "nope")]) == 2
    assert "Fix:" in capsys.readouterr().err


def test_submit_keeps_the_newest_finished_runs_it_is_told_to(tmp_path: Path) -> None:
    """submit.keep_finished_runs=N: at submit, the user's finished runs of that job.name beyond
    the newest N go; a running one and another job.name's stay."""
    from slurmkit.cli.submit import prune_finished
    from slurmkit.config import compose

    runs = [_run(tmp_path, f"r{i}", "completed") for i in range(3)]
    for i, r in enumerate(runs):
        t = 1_000_000 + i * 100
        os.utime(os.path.join(r.run_dir, "ledger.jsonl"), (t, t))
    running = _run(tmp_path, "r9", None)
    other = FakeRun(str(tmp_path / "other" / "x"))
    other.submitted()
    other.agent.append("end", status="completed", exit_code=0)
    cfg = compose(["+exp=tiny", f"submit.run_root={tmp_path}", "submit.keep_finished_runs=1"])
    out = io.StringIO()
    prune_finished(cfg, Console(file=out, width=300))
    assert [os.path.isdir(r.run_dir) for r in runs] == [False, False, True]
    assert os.path.isdir(running.run_dir) and os.path.isdir(other.run_dir)
    assert "removed 2 finished run(s) of tiny" in out.getvalue()
