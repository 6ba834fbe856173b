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

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
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


# ---------------------------------------------------------------------- the agent's side
def _agent(tmp_path, monkeypatch):
    """A real NodeAgent for `python -m slurmkit.train` whose standbys are `cat` processes (they
    echo the hand-over line and end at EOF, like a standby that became a rank and finished)."""
    from slurmkit.config import compose
    from slurmkit.launch.agent import NodeAgent
    from slurmkit.launch.context import NodeContext
    from slurmkit.ledger.ledger import Ledger

    spawned: list[standby.Standby] = []

    def spawn(prefix, env, *, local_rank, cwd, parent=None):
        proc = subprocess.Popen(["cat"], env=dict(env), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True, cwd=cwd)
        spawned.append(standby.Standby(local_rank, proc, tuple(prefix), dict(env)))
        return spawned[-1]

    monkeypatch.setattr(standby, "spawn", spawn)
    cfg = compose(["+exp=tiny", "health=off", "topology.enabled=false", "job.command=[python,-m,slurmkit.train]",
                   "supervisor.fork_ranks=false"])  # standbys, not the fork server (test_forkserver.py)
    ctx = NodeContext(node_rank=1, num_nodes=2, node_name="n1", nodes=("n0", "n1"), job_id="77",
                      restart_count=0, master_addr="10.0.0.7", executor="slurm")
    env = {"PATH": os.environ.get("PATH", ""), "SLURMKIT_NODE_LOCAL_DIR": str(tmp_path / "local"),
           "SLURM_JOB_ID": "77"}
    (tmp_path / "local").mkdir()
    (tmp_path / "run").mkdir()
    node = NodeAgent(str(tmp_path / "run"), cfg, ctx, env, Ledger(str(tmp_path / "run" / "ledger.jsonl"),
                                                                  source="agent:n1"))
    return node, spawned


def test_the_agent_hands_its_standbys_their_ranks_and_starts_cold_when_it_cannot(tmp_path, monkeypatch) -> None:
    node, spawned = _agent(tmp_path, monkeypatch)
    node.warm_up()  # as agent_main does: slot 1 of 2 (node rank 1), port unknown yet
    assert [sb.local_rank for sb in spawned] == [0, 1] and set(node.standbys) == {0, 1}
    assert spawned[0].env["RANK"] == "2" and spawned[0].env["PYTHONSAFEPATH"] == "1"
    node.start(gen=0, slot=1, port=29555, master_addr="10.0.0.7")
    assert [p.pid for p in node.procs] == [sb.pid for sb in spawned] and node.standbys == {}
    for p, sb in zip(node.procs, spawned):
        assert p.proc.wait(timeout=30) == 0  # cat: echoed the line, then EOF
        p.reader.join(timeout=10)
        line = json.loads(open(p.log_path).read().splitlines()[0])
        assert line["v"] == 1 and line["set"]["MASTER_PORT"] == "29555" and line["args"] == []
        assert "OMP_NUM_THREADS" not in line["set"]  # same as at spawn: not handed over
    node.ledger.flush()
    (started,) = [json.loads(x) for x in open(tmp_path / "run" / "ledger.jsonl") if '"ranks_started"' in x]
    assert started["warm"] == [True, True] and started["pids"] == [sb.pid for sb in spawned]

    # A standby whose start-up environment differs is discarded and the rank starts cold.
    node.warm_up(gen=1, slot=1)
    stale = node.standbys[0]
    node.env["OMP_NUM_THREADS"] = "7"  # read when Python and torch start: cannot be handed over
    monkeypatch.setattr("slurmkit.launch.agent.spawn_rank", lambda cmd, env, **kw: _cold(cmd, env, **kw))
    node.start(gen=1, slot=1, port=29556, master_addr="10.0.0.7")
    assert stale.proc.returncode is not None  # discarded (killed and reaped)
    assert all(p.pid not in {sb.pid for sb in spawned} for p in node.procs)
    node.ledger.flush()
    last = [json.loads(x) for x in open(tmp_path / "run" / "ledger.jsonl") if '"ranks_started"' in x][-1]
    assert last["generation"] == 1 and last["warm"] == [False, False]
    node.kill_leftovers()


def _cold(cmd, env, **kw):
    from slurmkit.launch.ranks import spawn_rank

    assert cmd[1:4] == ["-P", "-m", "slurmkit.launch.tether"] or cmd[1:3] == ["-m", "slurmkit.launch.tether"], cmd
    return spawn_rank(["true"], env, **kw)  # the tether and the trainer are not what this test is about


def test_a_warning_discards_the_standbys(tmp_path, monkeypatch) -> None:
    node, spawned = _agent(tmp_path, monkeypatch)
    node.warm_up()
    node.signal_kind = "time_limit"  # the allocation is ending: no next generation will need them
    node._keep_standbys(0, {})
    assert node.standbys == {} and all(sb.proc.returncode is not None for sb in spawned)
    node.warm_up()  # and none are started any more
    assert node.standbys == {} and len(spawned) == 2
