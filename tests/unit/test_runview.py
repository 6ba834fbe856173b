"""Reading a run directory for the watch verbs: incremental, tail-only, and the same figures
as ``python -m slurmkit.supervise`` (runs written by the project's own Ledger/metrics writers)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from slurmkit.errors import ConfigError
from slurmkit.runview import (
    LedgerTail,
    RunWatcher,
    build_view,
    find_dirs,
    last_json_line,
    ledger_edges,
    phase_of,
    read_sweep,
    resolve,
)
from slurmkit.ledger.ledger import LEDGER_NAME, Ledger, read_ledger
from slurmkit.supervise.__main__ import load
from tests.unit.watch_runs import FakeRun, run_with_one_crash


def test_view_of_a_run_with_a_crash_matches_the_supervise_report(tmp_path: Path) -> None:
    run = run_with_one_crash(str(tmp_path / "r"))
    w = RunWatcher(run.run_dir)
    assert w.refresh()
    v = w.view
    assert v is not None
    report = load(run.run_dir)  # what `python -m slurmkit.supervise RUN_DIR` prints
    assert v.goodput == report.goodput and 0 < v.goodput < 1
    assert v.failures == report.failures_by_class == {"rank_crash": 1}
    last = json.loads(Path(run.run_dir, "metrics.jsonl").read_text().splitlines()[-1])
    assert (v.step, v.loss, v.tokens_per_s, v.mfu) == (30, last["loss"], last["tokens_per_s"], last["mfu"])
    assert v.total_steps == 60 and v.generation == 1 and v.phase == "training" and not v.ended
    assert v.checkpoints == {"nvme": 20, "lustre": 20}
    assert (v.job_id, v.executor, v.nodes) == ("4242", "slurm", ["node1", "node2"])


def test_ledger_tail_reads_only_new_whole_lines(tmp_path: Path) -> None:
    run = FakeRun(str(tmp_path / "r"))
    run.submitted()
    tail = LedgerTail(os.path.join(run.run_dir, LEDGER_NAME))
    assert tail.poll() and [e["event"] for e in tail.events] == ["submitted"]
    assert not tail.poll()  # nothing appended: nothing read
    # A writer killed mid-line leaves a torn line; it is skipped as read_ledger skips it.
    fd = os.open(tail.path, os.O_WRONLY | os.O_APPEND)
    os.write(fd, b'{"t": 1, "event": "allocation_st')
    assert not tail.poll()
    os.write(fd, b'art"}\n')
    os.close(fd)
    assert tail.poll() and tail.events[-1]["event"] == "allocation_start"
    run.allocation()
    assert tail.poll()
    assert tail.events == list(read_ledger(tail.path))


def test_watcher_rereads_the_ledger_only_when_it_grew(tmp_path: Path) -> None:
    run = run_with_one_crash(str(tmp_path / "r"))
    w = RunWatcher(run.run_dir)
    w.refresh()
    first = w.view
    assert not w.refresh() and w.view is first  # nothing changed: the same view, nothing read
    run.step(31, 4.0)  # only metrics moved: step and loss update, the summary is kept
    assert w.refresh()
    assert w.view is not None and (w.view.step, w.view.loss) == (31, 4.0)
    assert w.view.report is first.report  # type: ignore[union-attr]
    run.finish(31)
    assert w.refresh() and w.view.ended and w.view.phase == "completed"
    assert w.view.goodput == load(run.run_dir).goodput


def test_metrics_tail_skips_a_line_being_written(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "loss": 1.0 / s}) for s in range(1, 5001)]
    path.write_text("\n".join(lines) + "\n" + '{"step": 5001, "lo')
    assert last_json_line(str(path)) == {"step": 5000, "loss": 1.0 / 5000}


def test_phases_follow_the_ledger(tmp_path: Path) -> None:
    run = FakeRun(str(tmp_path / "r"))
    path = os.path.join(run.run_dir, LEDGER_NAME)
    seen = []
    for act in (run.submitted, run.allocation, run.start_generation, run.crash):
        act()
        seen.append(phase_of(list(read_ledger(path))))
    run.agent.append("ranks_started", generation=1, node="node1", slot=0, ranks=[0, 1], pids=[1, 2])
    seen.append(phase_of(list(read_ledger(path))))
    run.finish(60)
    seen.append(phase_of(list(read_ledger(path))))
    assert seen == [("submitted", False), ("starting", False), ("training", False),
                    ("recovering", False), ("running", False), ("completed", True)]


def test_listing_reads_the_edges_of_a_long_ledger(tmp_path: Path) -> None:
    run = FakeRun(str(tmp_path / "r"))
    run.submitted()
    run.allocation()
    run.start_generation()
    for s in range(1, 3001):  # ~300 KB of heartbeat samples: more than the tail block
        run.heartbeat_sample(s)
    edges = ledger_edges(run.run_dir)
    assert edges[0]["event"] == "submitted" and len(edges) < 3000
    v = build_view(run.run_dir, edges, full=False)
    assert (v.job_id, v.step, v.goodput) == ("4242", 3000, None)


def _sweep(root: Path, job_id: str | None) -> Path:
    sweep = root / "tiny" / "20260101-000000-sweep"
    variants = []
    for i, lr in enumerate(("1e-3", "3e-3")):
        run = FakeRun(str(sweep / f"v{i}"))
        run.submitted(job_id=f"{job_id}_{i}" if job_id else str(100 + i))
        variants.append({"index": i, "overrides": [f"train.lr={lr}"], "run_dir": run.run_dir})
    (sweep / "sweep.json").write_text(json.dumps(
        {"kind": "sweep", "name": "tiny", "job_id": job_id, "array": "0-1", "variants": variants}))
    return sweep


def test_resolve_run_dir_sweep_and_job_ids(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    single = FakeRun(str(root / "tiny" / "20260101-000000-aaaa"))
    single.submitted(job_id="555")
    sweep = _sweep(root, "777")
    assert resolve(single.run_dir, str(root)) == ("run", single.run_dir)
    assert resolve(str(sweep), str(root)) == ("sweep", str(sweep))
    assert resolve("555", str(root)) == ("run", single.run_dir)
    assert resolve("777", str(root)) == ("sweep", str(sweep))
    assert resolve("777_1", str(root)) == ("run", str(sweep / "v1"))
    runs, sweeps = find_dirs(str(root))
    assert sorted(runs) == sorted([single.run_dir, str(sweep / "v0"), str(sweep / "v1")])
    assert sweeps == [str(sweep)]
    for bad in ("999", "not-a-job", str(tmp_path)):
        with pytest.raises(ConfigError, match="Fix:"):
            resolve(bad, str(root))


def test_a_hostile_sweep_file_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "sweep.json").write_text('{"variants": "rm -rf /"}')
    with pytest.raises(ConfigError, match="no list of variants"):
        read_sweep(str(tmp_path))
    (tmp_path / "sweep.json").write_text('{"variants": [')
    with pytest.raises(ConfigError, match="cannot be read"):
        read_sweep(str(tmp_path))


def test_heartbeat_samples_alone_recompute_the_summary_at_most_every_interval(tmp_path: Path) -> None:
    run = run_with_one_crash(str(tmp_path / "r"))
    now = [0.0]
    w = RunWatcher(run.run_dir, summary_interval_s=30.0, clock=lambda: now[0])
    w.refresh()
    first = w.view
    assert first is not None and first.report is not None
    run.clock.tick(10)
    run.heartbeat_sample(31)  # a sample only: the view moves, the summary waits
    now[0] = 10.0
    assert w.refresh() and w.view is not None and w.view.step == 31
    assert w.view.report is first.report
    now[0] = 31.0
    run.heartbeat_sample(32)
    w.refresh()
    assert w.view.report is not first.report and w.view.goodput == load(run.run_dir).goodput
    second = w.view.report
    run.checkpoint(32)  # any other event: the summary follows at once
    w.refresh()
    assert w.view.report is not second and w.view.checkpoints["nvme"] == 32


def test_rank0_heartbeat_is_read_from_the_node_local_file_and_never_from_the_run_dir(tmp_path: Path) -> None:
    from slurmkit.runview import read_heartbeat_step
    from slurmkit.train.heartbeat import Heartbeat, local_heartbeat_path

    run_dir = str(tmp_path / "run")
    os.makedirs(os.path.join(run_dir, "heartbeat"))
    env = {"SLURMKIT_NODE_LOCAL_DIR": str(tmp_path / "local"), "SLURMKIT_RUN_DIR": run_dir}
    os.makedirs(env["SLURMKIT_NODE_LOCAL_DIR"])
    # the layout before heartbeats left the shared file system: no longer a source
    Path(run_dir, "heartbeat", "rank0.json").write_text('{"rank": 0, "step": 99}')
    assert read_heartbeat_step(run_dir, env) is None
    hb = Heartbeat.from_env(env, 0)
    assert hb is not None
    hb.beat(7)
    assert hb.path == local_heartbeat_path(run_dir, 0, env)
    assert read_heartbeat_step(run_dir, env) == 7
    # untrusted: a link in its place, or a step that is not a step, reads as no beat
    os.replace(hb.path, hb.path + ".real")
    os.symlink(hb.path + ".real", hb.path)
    assert read_heartbeat_step(run_dir, env) is None
    os.unlink(hb.path)
    Path(hb.path).write_text('{"rank": 0, "step": true}')
    assert read_heartbeat_step(run_dir, env) is None


def _user_program_run(tmp_path: Path, command: str) -> str:
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(f"job:\n  name: u\n  command: {command}\ntrain:\n  steps: 60\n")
    return str(run_dir)


def test_a_user_programs_figures_and_total_come_from_node0s_samples_never_the_preset(tmp_path: Path) -> None:
    run_dir = _user_program_run(tmp_path, "[python, /x/train.py]")
    starts = [{"event": "ranks_started", "generation": 0}]
    silent = [*starts, {"event": "heartbeat", "generation": 0, "node": "n2", "steps": {"2": 5}}]
    view = build_view(run_dir, silent, full=False)
    # no report: unknown, not the preset's train.steps (60) nor a 0 loss
    assert (view.step, view.total_steps, view.loss, view.tokens_per_s, view.mfu) == (5, None, None, None, None)
    figured = {"event": "heartbeat", "generation": 0, "node": "n1", "steps": {"0": 7, "1": 7},
               "metrics": {"loss": 2.25, "tokens_per_s": 900.0, "mfu": 0.3}, "total_steps": 200}
    later = {"event": "heartbeat", "generation": 0, "node": "n2", "steps": {"2": 9, "3": 9}}
    view = build_view(run_dir, [*starts, figured, later], full=False)
    assert (view.step, view.total_steps, view.loss, view.tokens_per_s, view.mfu) == (9, 200, 2.25, 900.0, 0.3)
    hostile = {**figured, "metrics": {"loss": "1e309", "mfu": [1]}, "total_steps": "200"}
    view = build_view(run_dir, [*starts, hostile], full=False)
    assert (view.total_steps, view.loss, view.mfu) == (None, None, None)


def test_the_reference_trainers_total_is_its_configured_steps(tmp_path: Path) -> None:
    run_dir = _user_program_run(tmp_path, "[python, -m, slurmkit.train]")
    assert build_view(run_dir, [], full=False).total_steps == 60


def test_the_watcher_keeps_node0s_figures_when_another_nodes_sample_is_newer(tmp_path: Path) -> None:
    run_dir = _user_program_run(tmp_path, "[python, /x/train.py]")
    ledger = Ledger(os.path.join(run_dir, LEDGER_NAME), source="agent")
    ledger.append("ranks_started", generation=0)
    ledger.append("heartbeat", generation=0, node="n1", steps={"0": 4}, metrics={"loss": 3.5}, total_steps=80)
    w = RunWatcher(run_dir)
    assert w.refresh() and w.view is not None and (w.view.loss, w.view.total_steps) == (3.5, 80)
    ledger.append("heartbeat", generation=0, node="n2", steps={"2": 6})
    assert w.refresh() and w.view is not None
    assert (w.view.step, w.view.loss, w.view.total_steps) == (6, 3.5, 80)


def test_a_programs_saves_adopted_into_the_tiers_show_per_tier() -> None:
    from slurmkit.runview import checkpoints_by_tier

    events = [{"event": "ckpt_saved", "tier": "user", "step": 8},
              {"event": "ckpt_adopted", "tier": "lustre", "step": 8},
              {"event": "ckpt_adopted", "tier": "object", "step": 4},
              {"event": "ckpt_failed", "tier": "user", "step": 12, "by": "adopt"}]
    assert checkpoints_by_tier(events) == {"user": 8, "lustre": 8, "object": 4}
