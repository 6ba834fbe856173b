"""slurmkit.userapi: a user program's step and checkpoint reports, against real files."""

from __future__ import annotations

import json
import os
import shutil
import stat
import time

import pytest

from slurmkit import userapi
from slurmkit.ledger.spool import SpoolReader
from slurmkit.supervise.ckpt_progress import UserCheckpointReader
from slurmkit.train.heartbeat import read_heartbeat
from slurmkit.userapi import ReportError, Reporter, marker_path


def agent_env(tmp_path, rank: int = 0, generation: int = 2) -> dict[str, str]:
    """What the node agent gives a rank (the parts the reports read)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir(exist_ok=True)
    return {"RANK": str(rank), "SLURMKIT_RUN_DIR": str(run_dir), "SLURMKIT_GENERATION": str(generation),
            "SLURMKIT_ATTEMPT": "41-0", "SLURMKIT_NODE": "node1",
            "SLURMKIT_HEARTBEAT_FILE": str(tmp_path / "local" / "heartbeat" / f"rank{rank}.json"),
            "SLURMKIT_EVENTS_FILE": str(tmp_path / "local" / "events" / f"41-0.rank{rank}.jsonl")}


def test_report_step_beats_the_agents_heartbeat_file(tmp_path) -> None:
    env = agent_env(tmp_path, rank=3)
    r = Reporter(env)
    before = time.time()
    assert r.step(0) and r.step(7)
    beat = read_heartbeat(env["SLURMKIT_HEARTBEAT_FILE"])
    assert beat is not None
    assert (beat["step"], beat["rank"], beat["generation"], beat["pid"]) == (7, 3, 2, os.getpid())
    assert before - 1 <= beat["time"] <= time.time() + 1
    # Per step nothing goes to the run directory (the shared file system): no marker, no files.
    assert os.listdir(env["SLURMKIT_RUN_DIR"]) == []


def test_outside_slurmkit_both_reports_do_nothing(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    r = Reporter({"RANK": "0", "WORLD_SIZE": "2"})  # torchrun, no agent
    assert r.step(5) is False and r.checkpoint(5, "ckpt.pt") is False
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("bad", [-1, True, 1.5, "3", None])
def test_a_step_that_is_not_a_non_negative_int_is_the_callers_bug(tmp_path, bad: object) -> None:
    r = Reporter(agent_env(tmp_path))
    for call in (r.step, r.checkpoint):
        with pytest.raises(ReportError, match=r"Detected: .*Requirement: a non-negative integer step.*Fix: "):
            call(bad)  # type: ignore[arg-type]
    assert not os.path.exists(marker_path(r.run_dir or ""))


def test_a_malformed_rank_variable_is_refused_with_a_fix(tmp_path) -> None:
    with pytest.raises(ReportError, match=r"Detected: RANK='x'.*Fix: "):
        Reporter({**agent_env(tmp_path), "RANK": "x"})


def test_rank_zero_records_a_checkpoint_in_the_marker_and_the_ledger_spool(tmp_path) -> None:
    env = agent_env(tmp_path)
    r = Reporter(env, clock=lambda: 1234.0)
    assert r.checkpoint(10, tmp_path / "ck" / "step10.pt")
    path = marker_path(env["SLURMKIT_RUN_DIR"])
    st = os.lstat(path)
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o644
    with open(path) as f:
        record = json.load(f)
    assert record == {"step": 10, "path": str(tmp_path / "ck" / "step10.pt"), "rank": 0, "generation": 2,
                      "attempt": "41-0", "node": "node1", "pid": os.getpid(), "time": 1234.0}
    assert os.listdir(os.path.dirname(path)) == ["user_checkpoint.json"]  # no temporary file left
    (event,) = SpoolReader(env["SLURMKIT_EVENTS_FILE"]).read_new()
    assert (event["event"], event["step"], event["tier"], event["uri"], event["source"]) == (
        "ckpt_saved", 10, "user", str(tmp_path / "ck" / "step10.pt"), "rank0")
    # A later checkpoint replaces the marker; node 0's reader sees each one.
    reader = UserCheckpointReader(env["SLURMKIT_RUN_DIR"])
    assert reader() == 10
    assert r.checkpoint(15) and reader() == 15


def test_only_rank_zeros_checkpoint_report_counts(tmp_path) -> None:
    env = agent_env(tmp_path, rank=1)
    assert Reporter(env).checkpoint(10) is False
    assert not os.path.exists(marker_path(env["SLURMKIT_RUN_DIR"]))
    assert not os.path.exists(env["SLURMKIT_EVENTS_FILE"])


def test_a_path_that_is_not_a_short_str_is_refused(tmp_path) -> None:
    r = Reporter(agent_env(tmp_path))
    with pytest.raises(ReportError, match="a str path"):
        r.checkpoint(1, b"/ck/step1.pt")  # type: ignore[arg-type]
    with pytest.raises(ReportError, match="a str path"):
        r.checkpoint(1, "/" + "x" * userapi.MAX_PATH_CHARS)


def test_a_temporary_file_left_by_a_killed_writer_is_replaced(tmp_path, monkeypatch) -> None:
    env = agent_env(tmp_path)
    path = marker_path(env["SLURMKIT_RUN_DIR"])
    os.makedirs(os.path.dirname(path))
    monkeypatch.setattr(userapi.threading, "get_ident", lambda: 77)
    with open(f"{path}.tmp.{os.getpid()}.77", "w") as f:
        f.write("half a rec")
    assert Reporter(env).checkpoint(3)
    assert UserCheckpointReader(env["SLURMKIT_RUN_DIR"])() == 3
    assert os.listdir(os.path.dirname(path)) == ["user_checkpoint.json"]


def test_a_marker_that_cannot_be_written_is_reported_and_never_raised_into_training(tmp_path, capsys) -> None:
    env = agent_env(tmp_path)
    os.rmdir(env["SLURMKIT_RUN_DIR"])
    with open(env["SLURMKIT_RUN_DIR"], "w"):  # the run directory is a file: nothing can be made in it
        pass
    r = Reporter(env)
    assert r.checkpoint(5) is False and r.checkpoint(10) is False
    err = capsys.readouterr().err  # each lost checkpoint said (they are rare, unlike steps)
    assert "slurmkit: cannot record checkpoint step 5" in err and "checkpoint step 10" in err
    assert "node 0 will not count it as progress" in err
    assert not os.path.exists(env["SLURMKIT_EVENTS_FILE"])  # no ledger event for an unrecorded save


def test_a_heartbeat_that_cannot_be_written_is_reported_once(tmp_path, capsys) -> None:
    env = agent_env(tmp_path)
    r = Reporter(env)
    assert r.step(1)
    shutil.rmtree(os.path.dirname(env["SLURMKIT_HEARTBEAT_FILE"]))  # /dev/shm wiped under the rank
    assert r.step(2) is False and r.step(3) is False
    assert capsys.readouterr().err.count("slurmkit: cannot write the heartbeat") == 1


def test_the_module_functions_use_the_process_environment(tmp_path, monkeypatch) -> None:
    env = agent_env(tmp_path)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(userapi, "_default", None)
    assert userapi.report_step(4) and userapi.report_checkpoint(4, "/ck/4.pt")
    assert userapi.default_reporter() is userapi.default_reporter()
    assert read_heartbeat(env["SLURMKIT_HEARTBEAT_FILE"])["step"] == 4  # type: ignore[index]
    assert UserCheckpointReader(env["SLURMKIT_RUN_DIR"])() == 4


def test_the_exit_codes_are_the_contracts() -> None:
    from slurmkit import contract

    assert userapi.EXIT_CHECKPOINTED_ON_SIGNAL == contract.EXIT_CHECKPOINTED_ON_SIGNAL == 95
    assert userapi.EXIT_CONFIG_ERROR == contract.EXIT_CONFIG_ERROR
    assert userapi.CONFIG_ERROR_MARKER == contract.CONFIG_ERROR_MARKER


def test_a_heartbeat_that_cannot_be_set_up_yet_is_tried_again_at_the_next_step(tmp_path, capsys) -> None:
    env = agent_env(tmp_path)
    local = os.path.dirname(os.path.dirname(env["SLURMKIT_HEARTBEAT_FILE"]))
    with open(local, "w"):  # the node-local directory cannot be made yet
        pass
    r = Reporter(env)
    assert r.step(1) is False and r.step(2) is False
    os.unlink(local)
    assert r.step(3)
    assert read_heartbeat(env["SLURMKIT_HEARTBEAT_FILE"])["step"] == 3  # type: ignore[index]
    assert capsys.readouterr().err.count("slurmkit: no heartbeat for this rank") == 1


def test_report_metrics_beats_with_the_figures_and_the_total_on_the_node_only(tmp_path) -> None:
    env = agent_env(tmp_path)
    r = Reporter(env)
    r.total_steps(500)
    assert r.metrics(12, {"loss": 2.5, "tokens_per_s": 1200, "mfu": 0.41, "lr": float("nan")})
    beat = read_heartbeat(env["SLURMKIT_HEARTBEAT_FILE"])
    assert beat is not None and beat["step"] == 12 and beat["total_steps"] == 500
    # a diverged figure is unknown (None), never a NaN the reader cannot parse
    assert beat["metrics"] == {"loss": 2.5, "tokens_per_s": 1200.0, "mfu": 0.41, "lr": None}
    assert r.step(13)  # a plain step beat keeps the total, carries no stale figures
    beat = read_heartbeat(env["SLURMKIT_HEARTBEAT_FILE"])
    assert beat is not None and "metrics" not in beat and beat["total_steps"] == 500
    assert os.listdir(env["SLURMKIT_RUN_DIR"]) == []  # nothing on the shared file system


@pytest.mark.parametrize("values", [{"loss": "2.5"}, {"loss": True}, {"loss": None},
                                    {f"m{i}": 1.0 for i in range(userapi.MAX_METRICS + 1)},
                                    {"x" * 49: 1.0}, {"not a name": 1.0}])
def test_figures_that_are_not_named_numbers_are_the_callers_bug(tmp_path, values) -> None:
    with pytest.raises(ReportError, match="Requirement"):
        Reporter(agent_env(tmp_path)).metrics(1, values)


@pytest.mark.parametrize("bad", [0, -3, True, 2.0, "60"])
def test_a_total_that_is_not_a_positive_int_is_refused(tmp_path, bad: object) -> None:
    with pytest.raises(ReportError, match="set_total_steps"):
        Reporter(agent_env(tmp_path)).total_steps(bad)  # type: ignore[arg-type]


def test_the_module_functions_report_metrics_and_the_total(tmp_path, monkeypatch) -> None:
    env = agent_env(tmp_path)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(userapi, "_default", None)
    userapi.set_total_steps(40)
    assert userapi.report_metrics(3, loss=1.25)
    beat = read_heartbeat(env["SLURMKIT_HEARTBEAT_FILE"])
    assert beat is not None and (beat["step"], beat["metrics"], beat["total_steps"]) == (3, {"loss": 1.25}, 40)


def test_train_start_beats_every_rank_and_hands_rank_zeros_event_to_the_agent(tmp_path) -> None:
    env0, env1 = agent_env(tmp_path), agent_env(tmp_path, rank=1)
    assert Reporter(env0, clock=lambda: 99.0).train_start(12)
    assert not Reporter(env1).train_start(12)  # only rank 0's start is an event
    assert read_heartbeat(env1["SLURMKIT_HEARTBEAT_FILE"])["step"] == 12
    (event,) = SpoolReader(env0["SLURMKIT_EVENTS_FILE"]).read_new()
    assert {k: event[k] for k in ("event", "step", "generation", "node", "by", "t")} == {
        "event": "train_started", "step": 12, "generation": 2, "node": "node1", "by": "userapi", "t": 99.0}
    assert not os.path.exists(env1["SLURMKIT_EVENTS_FILE"])
    with pytest.raises(ReportError):
        Reporter(env0).train_start(-1)


def test_a_phase_beat_keeps_the_step_and_the_last_figures_and_names_the_phase(tmp_path) -> None:
    env = agent_env(tmp_path)
    r = Reporter(env)
    r.total_steps(100)
    assert r.metrics(30, {"loss": 2.5}) and r.phase(30, "validation")
    beat = read_heartbeat(env["SLURMKIT_HEARTBEAT_FILE"])
    assert (beat["step"], beat["phase"], beat["metrics"], beat["total_steps"]) == (30, "validation", {"loss": 2.5}, 100)
    assert r.step(31) and "phase" not in read_heartbeat(env["SLURMKIT_HEARTBEAT_FILE"])


@pytest.mark.parametrize("bad", ["", "two words", "x" * 33, None, 3])
def test_a_phase_that_is_not_a_short_name_is_the_callers_bug(tmp_path, bad: object) -> None:
    with pytest.raises(ReportError, match="report_phase"):
        Reporter(agent_env(tmp_path)).phase(1, bad)  # type: ignore[arg-type]
