"""Hostile input, issue 34 items 7 and 8: what a rank writes, and a node-local directory that
another user took first.

Item 7: every reader of data a rank (or anything of the user's) wrote (heartbeat, event spool,
flight-recorder trace, ledger, metrics) takes any bytes: the record is refused and named, the
node agent's calls and the CLIs' readers return. Item 8: a squatted ``<root>/slurmkit-<uid>``
leaves the agent a private directory of its own instead of a traceback at start. Each case
fails on the code before the fix (a TypeError, ValueError or RecursionError out of the reader;
a LocalDirError out of private_dir).
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from slurmkit.launch.stackdump import RankTarget, read_traces
from slurmkit.ledger.ledger import Ledger, read_ledger
from slurmkit.ledger.spool import SpoolReader
from slurmkit.ledger.summary import summarize
from slurmkit.report.run import load_run
from slurmkit.runview import LedgerTail, build_view, read_config
from slurmkit.launch.monitor import RankMonitor
from slurmkit.train.heartbeat import node_local_dir, private_dir, read_heartbeat

DEEP = b"[" * 100_000 + b"]" * 100_000  # json's C scanner recurses: RecursionError
HUGE = b"9" * 5000  # over Python's 4,300-digit limit: a bare ValueError, not a JSONDecodeError
GOOD_END = b'{"t": 20.0, "event": "end", "status": "completed", "exit_code": 0}\n'
GOOD_START = b'{"t": 10.0, "event": "train_started", "step": 0, "generation": 0}\n'


# ------------------------------------------------------------------ item 7: the agent's readers

def _monitor_survives(beat: bytes) -> Callable[[Path, pytest.LogCaptureFixture], None]:
    def case(tmp: Path, caplog: pytest.LogCaptureFixture) -> None:
        path = tmp / "rank0.json"
        path.write_bytes(beat)
        mon = RankMonitor("n1", 0, heartbeat_timeout_s=60.0, startup_timeout_s=20.0,
                          wall=lambda: 1000.0, mono=lambda: 1.0, proc_state=lambda pid: "S")
        mon.add_rank(0, os.getpid(), str(path))
        with caplog.at_level(logging.WARNING):
            assert mon.poll() == {} and mon.poll() == {}  # no beat, no exception, twice
        named = [r.getMessage() for r in caplog.records if str(path) in r.getMessage()]
        assert len(named) == 1 and "refused" in named[0]  # said once, not on every poll
        assert mon.triggered is None
    return case


def _spool_survives(line: bytes, reason: str) -> Callable[[Path, pytest.LogCaptureFixture], None]:
    def case(tmp: Path, caplog: pytest.LogCaptureFixture) -> None:
        spool = tmp / "events" / "rank0.jsonl"
        spool.parent.mkdir()
        spool.write_bytes(line + b"\n" + GOOD_START)
        ledger = Ledger(str(tmp / "ledger.jsonl"), source="agent:n1", report=lambda m: None)
        ledger.attach(SpoolReader(str(spool)))
        ledger.append("end", status="completed", exit_code=0)  # pulls the spool first: no raise
        ledger.close(retries=())
        events = list(read_ledger(str(tmp / "ledger.jsonl")))
        assert [e["event"] for e in events] == ["train_started", "rank_data_refused", "end"]
        assert events[1]["file"] == str(spool) and reason in events[1]["reason"]
    return case


def _trace_refused(data: bytes, reason: str) -> Callable[[Path, pytest.LogCaptureFixture], None]:
    def case(tmp: Path, caplog: pytest.LogCaptureFixture) -> None:
        target = RankTarget(0, os.getpid(), str(tmp / "stack"), "", str(tmp / "pipe"), str(tmp / "trace.json"))
        Path(target.trace_file).write_bytes(data)
        (why,) = read_traces([target], timeout_s=0.1).values()
        assert isinstance(why, str) and target.trace_file in why and reason in why
    return case


# ------------------------------------------------------------------ item 7: the CLIs' readers

def _ledger_survives(line: bytes) -> Callable[[Path, pytest.LogCaptureFixture], None]:
    """status (LedgerTail), report and supervise (read_ledger + summarize) over one hostile line."""
    def case(tmp: Path, caplog: pytest.LogCaptureFixture) -> None:
        path = tmp / "ledger.jsonl"
        path.write_bytes(GOOD_START + line + b"\n" + GOOD_END)
        with caplog.at_level(logging.WARNING):
            events = list(read_ledger(str(path)))
            tail = LedgerTail(str(path))
            tail.poll()
        assert [e["event"] for e in events] == ["train_started", "end"] == [e["event"] for e in tail.events]
        assert summarize(events).status == "completed"
        assert any(f"{path} line 2 skipped" in r.getMessage() for r in caplog.records)
    return case


def _report_survives_metrics(tmp: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp / "ledger.jsonl").write_bytes(GOOD_START + GOOD_END)
    (tmp / "metrics.jsonl").write_bytes(b'{"step": ' + HUGE + b'}\n{"step": 1, "loss": 2.5}\n')
    data = load_run(str(tmp))
    assert [m["step"] for m in data.metrics] == [1]
    assert any("metrics.jsonl skipped" in n and "5000 digits" in n for n in data.notes)


def _viewer_heartbeat_survives(tmp: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp / "rank0.json"
    path.write_bytes(b'{"step": ' + DEEP + b"}")
    assert read_heartbeat(str(path)) is None  # status's heartbeat step on rank 0's node


def _viewer_config_survives(tmp: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp / "config.yaml").write_bytes(b"[" * 100_000)  # yaml's composer recurses: RecursionError
    (tmp / "ledger.jsonl").write_bytes(GOOD_START + GOOD_END)
    assert read_config(str(tmp)) == {}
    assert build_view(str(tmp), list(read_ledger(str(tmp / "ledger.jsonl"))), full=True).phase == "completed"


ITEM7 = {
    "heartbeat null": _monitor_survives(b"null"),
    "heartbeat a number": _monitor_survives(b"5"),
    "heartbeat nested 100,000 deep": _monitor_survives(DEEP),
    "spool 5,000-digit step": _spool_survives(b'{"t": 1.0, "event": "train_started", "step": ' + HUGE + b"}",
                                              "5000 digits"),
    "spool nested 100,000 deep": _spool_survives(b'{"t": 1.0, "event": "ckpt_saved", "step": 1, "x": ' + DEEP + b"}",
                                                 "nested deeper"),
    "spool wrong type": _spool_survives(b'{"t": 1.0, "event": "train_started", "step": "one"}', "is not int"),
    "trace nested 100,000 deep": _trace_refused(b'{"pg_status": ' + DEEP + b"}", "nested deeper"),
    "ledger 5,000-digit number": _ledger_survives(b'{"t": 15.0, "event": "heartbeat", "x": ' + HUGE + b"}"),
    "ledger nested 100,000 deep": _ledger_survives(b'{"t": 15.0, "event": "state", "x": ' + DEEP + b"}"),
    "ledger time not a number": _ledger_survives(b'{"t": "soon", "event": "failure", "cls": "hang"}'),
    "metrics 5,000-digit step": _report_survives_metrics,
    "viewer's heartbeat nested": _viewer_heartbeat_survives,
    "viewer's config.yaml nested": _viewer_config_survives,
}


@pytest.mark.parametrize("name", list(ITEM7))
def test_item7_a_rank_s_bytes_are_refused_and_named_never_raised(name: str, tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    ITEM7[name](tmp_path, caplog)


# ------------------------------------------------------------------ item 8: a squatted directory

def _squat(kind: str, path: Path) -> None:
    if kind == "another user's directory":
        if os.getuid() != 0:
            pytest.skip("making a directory of another user needs root")
        path.mkdir(mode=0o755)
        os.lchown(path, 65534, 65534)
    elif kind == "a link to another directory":
        (path.parent / "theirs").mkdir()
        path.symlink_to(path.parent / "theirs")
    else:
        path.write_text("squatted")


@pytest.mark.parametrize("kind", ["another user's directory", "a link to another directory", "a file"])
def test_item8_a_squatted_node_local_directory_leaves_the_agent_a_private_one(
        kind: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "shm"
    root.mkdir()
    root.chmod(0o1777)  # as /dev/shm: sticky and open to all
    env = {"SLURMKIT_NODE_LOCAL_DIR": str(root)}
    predicted = Path(node_local_dir("/runs/a", env))
    _squat(kind, predicted.parent)
    before = os.lstat(predicted.parent)
    with caplog.at_level(logging.WARNING):
        got = private_dir(node_local_dir("/runs/a", env))  # what NodeAgent.__init__ calls
    assert not got.startswith(str(predicted.parent) + os.sep) and os.path.dirname(os.path.dirname(got)) == str(root)
    for d in (os.path.dirname(got), got):
        st = os.lstat(d)
        assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o700
    assert any(str(predicted.parent) in r.getMessage() and got in r.getMessage() for r in caplog.records)
    assert os.lstat(predicted.parent) == before  # the squatter's entry is left as it was
    # the next agent on the node takes the same one (its ranks learn it from the agent's environment)
    assert private_dir(node_local_dir("/runs/a", env)) == got


# ------------------------------------------------------------------ the shared parser's limits

@pytest.mark.parametrize(("text", "why"), [
    (b"[" * 33 + b"]" * 33, "nested deeper than 32"), (b'{"a": ' + b"1" * 31 + b"}", "31 digits"),
    (b"-" + b"9" * 40, "40 digits"), (b"1e999", "out of range"), (b"[NaN]", "NaN"), (b'"\\udc00"', "lone surrogate"),
    (b'{"a": "\xff"}', "not UTF-8"), (b"x" * 101, "over 100 bytes"),
])
def test_item7_the_shared_parser_refuses_what_a_reader_would_choke_on(text: bytes, why: str) -> None:
    from slurmkit.untrusted import UntrustedDataError, parse_json

    with pytest.raises(UntrustedDataError, match=why):
        parse_json(text, max_bytes=100)


@pytest.mark.parametrize("text", [b"[" * 32 + b"]" * 32, b"1" * 30, b"1.5e300", b'"\\ud83d\\ude00"', b'"[[[[{{{{"'])
def test_item7_the_shared_parser_takes_what_is_within_its_limits(text: bytes) -> None:
    from slurmkit.untrusted import parse_json

    assert parse_json(text, max_bytes=100) is not None
