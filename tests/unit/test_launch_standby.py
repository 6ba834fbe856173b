"""Warm standby ranks (slurmkit.launch.standby): the hand-over rules, and real standby processes
that import the trainer, keep a stop signal, take their rank from one line and run the trainer
with it, or leave quietly when the agent's pipe closes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from slurmkit.contract import CONFIG_ERROR_MARKER, EXIT_CONFIG_ERROR
from slurmkit.launch import standby

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": REPO, "RANK": "0", "WORLD_SIZE": "4",
        "SLURMKIT_GENERATION": "1", "OMP_NUM_THREADS": "1"}


def comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def wait_until(what: str, cond, deadline_s: float = 120.0):
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        got = cond()
        if got:
            return got
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def finish(sb: standby.Standby, timeout_s: float = 120.0) -> tuple[int, str]:
    code = sb.proc.wait(timeout=timeout_s)  # its output is a few lines: the pipe holds them
    assert sb.proc.stdout is not None
    return code, sb.proc.stdout.read().decode(errors="replace")


def test_only_the_identity_of_a_rank_may_differ() -> None:
    started = {**BASE, "MASTER_PORT": "0"}
    assert standby.mismatch(started, {**started, "RANK": "3", "MASTER_PORT": "29500", "SLURM_PROCID": "3",
                                      "SLURMKIT_HEARTBEAT_FILE": "/dev/shm/x"}) == []
    assert standby.mismatch(started, {**started, "OMP_NUM_THREADS": "8"}) == ["OMP_NUM_THREADS"]
    assert standby.mismatch(started, {**started, "LD_PRELOAD": "/x.so"}) == ["LD_PRELOAD"]
    gone = dict(started)
    del gone["PYTHONPATH"]
    assert standby.mismatch(started, gone) == ["PYTHONPATH"]


def test_the_hand_over_line_carries_only_what_changed() -> None:
    started = {**BASE, "MASTER_PORT": "0", "SLURMKIT_OLD": "x"}
    wanted = {**BASE, "MASTER_PORT": "29500", "RANK": "2"}
    got = json.loads(standby.message(started, wanted, ["--x"]))
    assert got == {"v": 1, "set": {"MASTER_PORT": "29500", "RANK": "2"}, "unset": ["SLURMKIT_OLD"], "args": ["--x"]}


@pytest.mark.parametrize("line", [b"not json\n", b'{"v": 2, "set": {}, "unset": [], "args": []}\n',
                                  b'{"v": 1, "set": {"A=B": "1"}, "unset": [], "args": []}\n',
                                  b'{"v": 1, "set": {"A": 1}, "unset": [], "args": []}\n',
                                  b'{"v": 1, "set": {}, "unset": "A", "args": []}\n',
                                  b"x" * (standby.MAX_MESSAGE_BYTES + 10) + b"\n"])
def test_a_bad_hand_over_line_is_refused(line: bytes, tmp_path) -> None:
    path = tmp_path / "line"
    path.write_bytes(line)
    with open(path, "rb") as f, pytest.raises(ValueError):
        standby.read_message(f)


def test_only_the_reference_trainer_runs_from_a_standby() -> None:
    assert standby.trainer_args([sys.executable, "-m", "slurmkit.train", "--a"]) == ["--a"]
    assert standby.trainer_args([sys.executable, "train.py"]) is None
    assert standby.trainer_args(["/other/python", "-m", "slurmkit.train"]) is None


def test_why_not_names_what_stands_in_the_way(tmp_path) -> None:
    sb = standby.spawn([], BASE, local_rank=0, cwd=str(tmp_path))
    try:
        assert standby.why_not(sb, [], {**BASE, "RANK": "1"}, []) is None
        assert "pinning" in str(standby.why_not(sb, ["numactl", "-m0"], BASE, []))
        assert "OMP_NUM_THREADS" in str(standby.why_not(sb, [], {**BASE, "OMP_NUM_THREADS": "4"}, []))
        big = {**BASE, "SLURMKIT_BIG": "x" * standby.MAX_MESSAGE_BYTES}
        assert "too large" in str(standby.why_not(sb, [], big, []))
    finally:
        sb.discard()
    assert sb.proc.returncode == -signal.SIGKILL
    assert "exited" in str(standby.why_not(sb, [], BASE, []))


def test_real_standbys_wait_keep_a_warning_take_their_rank_and_leave_on_eof(tmp_path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("- not a mapping\n")  # a YAML list: the trainer refuses it, naming the file
    adopted = standby.spawn([], BASE, local_rank=0, cwd=str(tmp_path))
    idle = standby.spawn([], BASE, local_rank=1, cwd=str(tmp_path))
    garbage = standby.spawn([], BASE, local_rank=2, cwd=str(tmp_path))
    try:
        # Handed its rank at once, while it may still be importing: the line waits in the pipe;
        # the trainer then runs with the environment it names (its config, its rank).
        wanted = {**BASE, "RANK": "5", "SLURMKIT_CONFIG": str(config), "SLURMKIT_GENERATION": "2"}
        assert standby.hand_over(adopted, wanted, [])
        code, out = finish(adopted)
        assert code == EXIT_CONFIG_ERROR, out
        assert f"{CONFIG_ERROR_MARKER}Detected: {config} is not a mapping" in out, out

        # A waiting standby keeps a time-limit warning (it is not killed by it) ...
        wait_until("the idle standby to wait", lambda: comm(idle.pid) == "skstandby")
        os.kill(idle.pid, signal.SIGUSR1)
        # ... and leaves with 0 when the agent's pipe closes.
        assert idle.proc.stdin is not None
        idle.proc.stdin.close()
        code, out = finish(idle)
        assert code == 0, out

        assert garbage.proc.stdin is not None
        garbage.proc.stdin.write(b"{not json\n")
        garbage.proc.stdin.close()
        code, out = finish(garbage)
        assert code == 1 and "slurmkit standby:" in out, out
    finally:
        for sb in (adopted, idle, garbage):
            sb.discard()


def test_a_standby_names_itself_in_proc_comm() -> None:
    code = ("import sys; sys.path.insert(0, %r); from slurmkit.launch.standby import _set_name; "
            "_set_name('skrank12345'); print(open('/proc/self/comm').read().strip())" % REPO)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "skrank12345"


def test_a_discarded_standby_ends_with_its_process_group(tmp_path) -> None:
    sb = standby.spawn([], BASE, local_rank=0, cwd=str(tmp_path))
    assert os.getpgid(sb.pid) == sb.pid  # its own session and group: discard() ends the group
    sb.discard()
    assert sb.proc.returncode is not None
    with pytest.raises(ProcessLookupError):
        os.killpg(sb.pid, 0)
