"""``slurmkit logs``: which file, the last lines, following a file that grows or is replaced,
and log lines that cannot drive the terminal."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest

from slurmkit.cli import logs
from slurmkit.errors import ConfigError
from slurmkit.untrusted import safe_line
from tests.unit.watch_runs import FakeRun


def test_control_characters_are_shown_not_sent() -> None:
    assert safe_line("ok\tfine \x1b[2J\x1b]0;owned\x07\r") == "ok\tfine \\x1b[2J\\x1b]0;owned\\x07\\x0d"


def test_last_lines_reads_backwards(tmp_path: Path) -> None:
    path = tmp_path / "big.log"
    path.write_bytes(b"".join(b"line %d\n" % i for i in range(100_000)))
    with open(path, "rb") as f:
        assert logs.last_lines(f, 3, block=4096) == b"line 99997\nline 99998\nline 99999\n"
        assert f.tell() == path.stat().st_size  # following continues from the end


def test_follow_prints_what_is_appended_and_survives_replacement(tmp_path: Path) -> None:
    path = tmp_path / "rank0.log"
    path.write_text("old 1\nold 2\n")
    out = io.StringIO()
    actions = [
        lambda: path.open("a").write("step 1\n"),
        lambda: path.open("a").write("step 2 \x1b[31mred\n"),
        lambda: (tmp_path / "new").write_text("after rotate\n") and os.replace(tmp_path / "new", path),
        lambda: path.open("a").write("step 3\n"),
    ]
    waits: list[int] = []

    def sleep(_s: float) -> None:
        if len(waits) < len(actions):
            actions[len(waits)]()
        waits.append(1)

    logs.follow(str(path), out, lines=1, follow_file=True, sleep=sleep,
                stop=lambda: len(waits) > len(actions))
    assert out.getvalue().splitlines() == ["old 2", "step 1", "step 2 \\x1b[31mred",
                                           "after rotate", "step 3"]


def test_agent_and_batch_logs_are_found(tmp_path: Path) -> None:
    run = FakeRun(str(tmp_path / "r"))
    run.submitted(job_id="77")
    run.allocation(job_id="77", nodes=("node3", "node4"))
    sub = Path(run.run_dir, "submitit")
    sub.mkdir()
    for name in ("77_0_log.out", "77_node0_log.out", "77_node1_log.out"):
        (sub / name).write_text(name + "\n")
    assert logs.agent_log(run.run_dir, logs.node_index(run.run_dir, "node4")) == str(sub / "77_node1_log.out")
    assert logs.agent_log(run.run_dir, 0) == str(sub / "77_node0_log.out")
    assert logs.batch_log(run.run_dir) == str(sub / "77_0_log.out")
    with pytest.raises(ConfigError, match="not in the run's newest allocation"):
        logs.node_index(run.run_dir, "node9")


def test_local_executor_agent_logs(tmp_path: Path) -> None:
    run = FakeRun(str(tmp_path / "r"))
    sub = Path(run.run_dir, "submitit")
    sub.mkdir()
    (sub / "4321_1_log.out").write_text("agent 1\n")
    assert logs.agent_log(run.run_dir, 1) == str(sub / "4321_1_log.out")
    out = io.StringIO()
    assert logs.main([run.run_dir, "--agent", "1"], out=out) == 0
    assert out.getvalue() == "agent 1\n"


def test_missing_log_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = FakeRun(str(tmp_path / "r"))
    assert logs.main([run.run_dir, "--rank", "3"], out=io.StringIO()) == 2
    err = capsys.readouterr().err
    assert "rank 3's log" in err and "Fix:" in err
    assert logs.main([str(tmp_path)], out=io.StringIO()) == 2


def test_follow_ends_with_the_run_and_prints_its_last_lines(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """`logs -f`, the command submit prints, never exited when the job ended (issue 37)."""
    run = FakeRun(str(tmp_path / "r"))
    run.submitted()
    run.allocation()
    log = Path(logs.rank_log(run.run_dir, 0))
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("step 1 loss 5.0\n")
    sleeps: list[float] = []

    def sleep(s: float) -> None:  # the job goes on writing, then ends
        sleeps.append(s)
        if len(sleeps) == 2:
            with log.open("a") as f:
                f.write("step 2 loss 4.0\n")
        if len(sleeps) == 3:
            with log.open("a") as f:
                f.write("step 3 loss 3.0\n")
            run.finish(3)
        assert len(sleeps) < 50, "following did not end with the run"

    out = io.StringIO()
    assert logs.main([run.run_dir, "-f"], out=out, sleep=sleep) == 0
    assert out.getvalue().splitlines() == ["step 1 loss 5.0", "step 2 loss 4.0", "step 3 loss 3.0"]
    assert "the run ended: completed" in capsys.readouterr().err


def test_a_handover_at_a_signal_is_no_end(tmp_path: Path) -> None:
    run = FakeRun(str(tmp_path / "r"))
    run.submitted()
    run.agent.append("end", status="signalled", signal="USR1", exit_code=0)
    assert not logs.RunEnd(run.run_dir, every=1)()
    run.agent.append("end", status="stopped", exit_code=93, reason="gave up")
    end = logs.RunEnd(run.run_dir, every=1)
    assert end() and end.status == "stopped"
