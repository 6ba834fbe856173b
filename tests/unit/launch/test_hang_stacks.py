"""A hang's root named by the ranks' stacks: real ranks in a real gloo group under a real NodeAgent.

Rank 1 sleeps in data loading (or is SIGSTOPped there) while rank 0 waits in an all-reduce.
Every rank's last beat is the same step, and rank 1's beats come later than rank 0's: by beats
alone (the code before stacks) rank 0 is blamed. The agent's stacks name rank 1: py-spy for a
user program, faulthandler (SIGUSR2) for the reference trainer.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurmkit.config import compose
from slurmkit.launch.agent import NodeAgent
from slurmkit.launch.context import NodeContext
from slurmkit.launch.stackdump import (RankStack, RankTarget, TraceSummary, capture, catches, find_pyspy, parse_trace,
                                       read_traces, report, trigger_nccl_dumps, trigger_trace_dumps, wait_nccl_dumps,
                                       with_trace)
from slurmkit.failures.classes import FailureClass
from slurmkit.failures.classify import Evidence, root_cause
from slurmkit.ledger.ledger import Ledger
from slurmkit.failures.stacks import StackPlace, read_stack
from slurmkit.train.faults import DATA_STALL_LINE
from slurmkit.train.signals import STACK_SIGNAL
from slurmkit.cli.submit import freeze
from slurmkit.launch.localranks import free_port

# A hang is called after heartbeat_timeout_s (2-6 s) of wall clock: a rank starved of CPU on a
# loaded machine looks hung too, so CI runs these beside the cluster tests, not at nice 10.
pytestmark = pytest.mark.realtime
RANK_PROGRAM = str(Path(__file__).resolve().parent / "hang_rank.py")


def _agent(tmp_path: Path, *over: str) -> NodeAgent:
    cfg = compose(["+exp=tiny", "health=off", "topology.enabled=false", "job.nodes=1", *over])
    ctx = NodeContext(node_rank=0, num_nodes=1, node_name="n0", nodes=("n0",), job_id="4242",
                      restart_count=0, master_addr="127.0.0.1", executor="local")
    for d in ("local", "run"):
        (tmp_path / d).mkdir(exist_ok=True)
    freeze(cfg, str(tmp_path / "run"))  # the trainer reads the frozen config, as under submit
    env = {"SLURMKIT_NODE_LOCAL_DIR": str(tmp_path / "local"), "PATH": "/usr/bin:/bin",
           "PYTHONPATH": ":".join(p for p in sys.path if p)}
    return NodeAgent(str(tmp_path / "run"), cfg, ctx, env,
                     Ledger(str(tmp_path / "run" / "ledger.jsonl"), source="agent:n0"))


def _until_hang(node: NodeAgent, bound_s: float = 180) -> Evidence:
    end = time.monotonic() + bound_s
    while (ev := node.poll(0)) is None:
        assert all(c is None for c in node.exit_codes()), [open(p.log_path).read() for p in node.procs]
        assert time.monotonic() < end, f"no hang found in {bound_s} s"
        time.sleep(0.05)  # the agent's poll interval
    assert ev.cls == FailureClass.HANG, ev
    return ev


def _until_line(node: NodeAgent, rank: int, text: str, bound_s: float = 180) -> None:
    proc = next(p for p in node.procs if p.rank == rank)
    end = time.monotonic() + bound_s
    while not (os.path.exists(proc.log_path) and text in open(proc.log_path).read()):
        assert proc.poll() is None, open(proc.log_path).read()
        assert time.monotonic() < end, f"rank {rank} never printed {text!r}"
        time.sleep(0.02)


def _hang_stacks(tmp_path: Path) -> dict[int, dict]:
    with open(tmp_path / "run" / "ledger.jsonl") as f:
        events = [json.loads(line) for line in f]
    (record,) = [e for e in events if e["event"] == "hang_stacks"]
    return {r["rank"]: r for r in record["ranks"]}


@pytest.mark.parametrize("stopped", [False, True], ids=["asleep", "sigstopped"])
def test_a_user_programs_rank_stuck_in_data_loading_is_the_root(tmp_path: Path, stopped: bool) -> None:
    assert find_pyspy({"PATH": "/usr/bin:/bin"}) is not None, "py-spy is in the dev extras"
    node = _agent(tmp_path, "supervisor.heartbeat_timeout_s=2", f"job.command=[python,{RANK_PROGRAM}]")
    node.start(gen=0, slot=0, port=free_port(), master_addr="127.0.0.1")
    try:
        if stopped:
            _until_line(node, 1, "loading")
            os.kill(node.procs[1].pid, signal.SIGSTOP)
        _until_hang(node)
        stacks = node.capture_stacks(0)
    finally:
        evidence = node.stop()
        node.ledger.close()
    if not stopped:  # what the earliest beat says (the code before stacks): the waiting rank
        by_beats = root_cause(evidence)
        assert by_beats is not None and by_beats.rank == 0, by_beats
    failure = root_cause(stacks + evidence)
    assert failure is not None and failure.cls == FailureClass.HANG
    assert failure.rank == 1 and failure.in_collective is False, failure
    assert "load_batch" in failure.stack and "load_batch" in failure.evidence, failure
    assert ("stopped" in failure.stack) == stopped
    ranks = _hang_stacks(tmp_path)
    assert ranks[1]["place"] == ("stopped" if stopped else "outside") and ranks[1]["source"] == "py-spy"
    assert any("load_batch" in line for line in ranks[1]["lines"]) and len(ranks[1]["lines"]) <= 40
    assert ranks[0]["place"] == "collective" and ranks[0]["wait"].startswith("all_reduce")
    # No signal reached the user program from the capture (SIGUSR2 would have ended it, -12).
    assert all(c in (-15, -9) for c in node.exit_codes()), node.exit_codes()


def test_the_reference_trainer_dumps_its_stack_on_sigusr2_even_when_stopped(tmp_path: Path) -> None:
    node = _agent(tmp_path, "supervisor.heartbeat_timeout_s=6", "train.steps=50", "train.micro_batch=1",
                  "train.seq_len=32", "train.ckpt_interval_steps=0",
                  "+job.env.SLURMKIT_FAULT=data_stall:1:4")
    node.start(gen=0, slot=0, port=free_port(), master_addr="127.0.0.1")
    try:
        _until_line(node, 1, DATA_STALL_LINE)
        os.kill(node.procs[1].pid, signal.SIGSTOP)
        _until_hang(node)
        stacks = node.capture_stacks(0)
    finally:
        evidence = node.stop()
        node.ledger.close()
    failure = root_cause(stacks + evidence)
    assert failure is not None and failure.rank == 1 and "stalled_data_loading" in failure.stack, failure
    ranks = _hang_stacks(tmp_path)
    assert ranks[1]["source"] == ranks[0]["source"] == "faulthandler", ranks
    assert ranks[1]["place"] == "stopped" and ranks[0]["place"] == "collective", ranks
    # The flight recorder (gloo, served by the trainer's own FIFO): rank 0 issued a collective
    # (the gradient hook's all-to-all) that rank 1, stopped before it, never issued.
    waiting, stopped = ranks[0]["trace"], ranks[1]["trace"]
    assert waiting["enqueued"] == waiting["completed"] + 1 and waiting["op"].startswith("gloo:"), ranks
    assert stopped["enqueued"] == stopped["completed"] == waiting["completed"], ranks
    # Not killed by SIGUSR2: the ranks ran until the agent stopped them (SIGTERM/SIGKILL).
    assert all(c in (-15, -9) for c in node.exit_codes()), node.exit_codes()


def test_only_a_process_with_a_handler_counts_as_catching_the_stack_signal(tmp_path: Path) -> None:
    code = ("import faulthandler, signal, sys; faulthandler.register(signal.SIGUSR2, file=sys.stderr) "
            "if sys.argv[1] == 'yes' else None; print('ready', flush=True); sys.stdin.read()")
    procs = {w: subprocess.Popen([sys.executable, "-c", code, w], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
             for w in ("yes", "no")}
    try:
        for p in procs.values():
            assert p.stdout is not None and p.stdout.readline() == b"ready\n"
        assert catches(procs["yes"].pid, STACK_SIGNAL) and not catches(procs["no"].pid, STACK_SIGNAL)
        assert not catches(procs["yes"].pid, signal.SIGUSR1)
    finally:
        for p in procs.values():
            p.kill()
            p.wait()
    assert not catches(procs["no"].pid, STACK_SIGNAL)  # gone: nothing to signal


def test_the_flight_recorder_pipe_is_written_only_when_it_is_a_fifo_with_a_reader(tmp_path: Path) -> None:
    fifo, plain = tmp_path / "rank_0.pipe", tmp_path / "rank_1.pipe"
    os.mkfifo(fifo)
    plain.write_text("")  # not a FIFO: a file someone left there is never written to
    targets = [RankTarget(0, 1, "", str(fifo)), RankTarget(1, 1, "", str(plain)),
               RankTarget(2, 1, "", str(tmp_path / "rank_2.pipe"))]
    assert trigger_nccl_dumps(targets[:1]) == []  # a FIFO nobody reads (ENXIO): skipped
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # as ProcessGroupNCCL's DumpPipe opens it
    try:
        assert [t.rank for t in trigger_nccl_dumps(targets)] == [0]
        assert os.read(reader, 128) == b"1"
    finally:
        os.close(reader)
    assert plain.read_text() == ""


def test_the_agent_waits_for_the_flight_recorder_dumps_where_torchtitan_writes_them(tmp_path: Path) -> None:
    # torchtitan sets TORCH_FR_DUMP_TEMP_FILE itself, over the agent's, to its own folder
    titan = _agent(tmp_path, "job.command=[python,-m,torchtitan.train,--dump-folder,out]")
    run = tmp_path / "run"
    pipe, stems = titan._nccl_stems()
    assert stems == [f"{run}/out/comm_traces/rank_", f"{run}/out/comm_trace/rank_"]
    assert pipe.startswith(str(tmp_path / "local"))  # the NCCL FIFO stays the agent's: torchtitan sets none
    # another program keeps the agent's own stem
    (tmp_path / "ref").mkdir()
    assert _agent(tmp_path / "ref")._nccl_stems()[1] == [f"{tmp_path}/ref/run/nccl_trace/rank_"]
    # rank 0's dump appears under torchtitan's 0.1.0 folder; rank 1 never writes one
    (run / "out" / "comm_trace").mkdir(parents=True)
    (run / "out" / "comm_trace" / "rank_0").write_bytes(b"fr")
    triggered = [RankTarget(0, 1, "", ""), RankTarget(1, 1, "", "")]
    assert wait_nccl_dumps(triggered, stems, timeout_s=0.3) == [f"{run}/out/comm_trace/rank_0"]
    assert wait_nccl_dumps(triggered, [], timeout_s=0.3) == []


def test_without_py_spy_a_user_program_gets_no_signal_and_the_record_says_so(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import sys; print('ready', flush=True); sys.stdin.read()"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
        target = RankTarget(0, proc.pid, str(tmp_path / "rank0.txt"), "")
        (got,) = capture([target], trainer=False, pyspy=None, proc_state=lambda pid: "S")
        assert got.source == "none" and "py-spy is not installed" in got.text and not got.stopped
        appended: list[tuple[str, dict]] = []
        verdicts = report([got], node="n0", generation=3, append=lambda e, **f: appended.append((e, f)))
        assert verdicts == []  # unknown: nothing for node 0 to weigh
        ((event, fields),) = appended
        assert event == "hang_stacks" and fields["ranks"][0]["place"] == "unknown"
        assert proc.poll() is None  # still running: nothing was sent to it
    finally:
        proc.kill()
        proc.wait()


def _trace(enqueued: object, completed: object, **extra: object) -> bytes:
    return json.dumps({"version": "2.10", "pg_status": {"0": {"last_enqueued_collective": enqueued,
                                                               "last_completed_collective": completed,
                                                               "last_started_collective": "-1"}},
                       "entries": [{"profiling_name": "nccl:all_reduce", "state": "scheduled"}], **extra}).encode()


def test_a_trace_is_read_as_json_with_every_field_checked() -> None:
    got = parse_trace(_trace("7", "6"))
    assert (got.enqueued, got.completed, got.op, got.state, got.pending) == (7, 6, "nccl:all_reduce", "scheduled", True)
    assert not parse_trace(_trace(6, 6)).pending
    import pickle
    for bad, why in ((b"\x80\x04N.", "not JSON"), (pickle.dumps({"pg_status": {}}), "not JSON"),
                     (b"[1]", "no pg_status"), (b'{"pg_status": {}}', "names no process group"),
                     (_trace("x", "1"), "process group 0"), (_trace(True, 1), "sequence number"),
                     (_trace([1], 1), "sequence number"), (b'{"pg_status": {"0": {}}, "entries": 3}', "not a list")):
        with pytest.raises(ValueError, match=why):
            parse_trace(bad)


def test_the_flight_recorder_turns_a_rank_outside_a_collective_into_one_waiting_for_its_peers() -> None:
    # The H200 case: the waiting rank's collective is queued on the device and its stack is in
    # the step's device wait, outside any collective call; only the recorder knows it waits.
    outside = read_stack('Thread 0x1 (most recent call first):\n  File "t.py", line 3 in train_step\n', stopped=False)
    assert outside.place == StackPlace.OUTSIDE
    pending, idle = TraceSummary(12, 11, "nccl:all_reduce", "started", 40), TraceSummary(11, 11, "nccl:all_reduce", "completed", 40)
    fixed = with_trace(outside, pending)
    assert fixed.place == StackPlace.COLLECTIVE and "#12 not completed" in fixed.wait
    assert with_trace(outside, idle) == outside and with_trace(outside, "no trace within 5 s") == outside
    stopped = read_stack("", stopped=True)
    assert with_trace(stopped, pending).place == StackPlace.STOPPED  # a stopped rank stays the suspect
    appended: list[tuple[str, dict]] = []
    stacks = [RankStack(0, 10, False, "faulthandler", 'Thread 0x1 (most recent call first):\n  File "t.py", line 3 in train_step\n'),
              RankStack(1, 11, False, "faulthandler", 'Thread 0x1 (most recent call first):\n  File "t.py", line 9 in load\n')]
    verdicts = report(stacks, node="n0", generation=1, append=lambda e, **f: appended.append((e, f)),
                      traces={0: pending, 1: idle})
    assert [(v.rank, v.place) for v in verdicts] == [(1, StackPlace.OUTSIDE), (0, StackPlace.COLLECTIVE)]
    ((_, fields),) = appended
    assert fields["ranks"][0]["trace"]["enqueued"] == 12 and fields["ranks"][1]["trace"]["enqueued"] == 11


def test_a_trace_is_asked_only_of_a_served_fifo_and_a_stale_or_bad_one_is_not_read(tmp_path: Path) -> None:
    fifo = tmp_path / "g0.rank0.pipe"
    os.mkfifo(fifo)
    served = RankTarget(0, 1, "", "", str(fifo), str(tmp_path / "g0.rank0.json"))
    unserved = RankTarget(1, 1, "", "", str(tmp_path / "g0.rank1.pipe"), str(tmp_path / "g0.rank1.json"))
    Path(served.trace_file).write_bytes(_trace(1, 1))  # a stale trace: removed before asking
    Path(unserved.trace_file).write_bytes(_trace(1, 1))
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        assert trigger_trace_dumps([served, unserved]) == [served] and os.read(reader, 8) == b"1"
    finally:
        os.close(reader)
    assert not os.path.exists(served.trace_file)
    assert read_traces([served], timeout_s=0.2) == {0: "no trace within 0.2 s"}
    Path(served.trace_file).write_bytes(b"\x80\x04N.")  # a pickle: never unpickled
    (why,) = read_traces([served], timeout_s=0.2).values()
    assert isinstance(why, str) and "not JSON" in why
