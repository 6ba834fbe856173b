"""The ledger: typed events, batching, failed writes (ENOSPC/EDQUOT/EIO) held, retried and
reported, torn lines, and rank 0's events reaching it through the node-local spool."""

from __future__ import annotations

import ast
import errno
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurmkit.ledger.events import EVENTS, EventError, validate
from slurmkit.ledger.ledger import URGENT, Ledger, read_ledger
from slurmkit.ledger.spool import SpoolReader, SpoolWriter

REPO = Path(__file__).resolve().parents[3]


class Disk:
    """os.write with a switch: while ``full`` holds an errno, every write fails with it;
    ``short`` makes the next write land only that many bytes (then the disk fills)."""

    def __init__(self) -> None:
        self.full: int | None = None
        self.short: int | None = None
        self.writes = 0

    def write(self, fd: int, data: bytes) -> int:
        self.writes += 1
        if self.short is not None:
            n, self.short = self.short, None
            self.full = errno.ENOSPC
            return os.write(fd, data[:n])
        if self.full is not None:
            raise OSError(self.full, os.strerror(self.full))
        return os.write(fd, data)


def times() -> Iterator[float]:
    t = 1000.0
    while True:
        t += 1.0
        yield t


def events_of(path: str) -> list[str]:
    return [e["event"] for e in read_ledger(path)]


# ------------------------------------------------------------------ the schema
def test_unknown_event_and_bad_types_are_refused_at_append(tmp_path) -> None:
    led = Ledger(str(tmp_path / "l.jsonl"))
    with pytest.raises(EventError, match="unknown ledger event 'ckpt_savd'"):
        led.append("ckpt_savd", step=3)
    with pytest.raises(EventError, match="step='3' is not int"):
        led.append("train_started", step="3")
    with pytest.raises(EventError, match="lacks required field"):
        led.append("heartbeat", generation=0, node="n1")
    with pytest.raises(EventError, match="has no field 'generaton'"):
        led.append("decision", action="restart", generaton=1)  # a closed event: a typo
    with pytest.raises(EventError, match="is not int"):
        led.append("train_started", step=True)  # a bool is not a step
    with pytest.raises(EventError, match="set by the ledger"):
        led.append("fault_injected", kind="x", t=5.0)
    with pytest.raises(EventError, match="not JSON"):
        led.append("fault_injected", kind="x", loss=float("nan"))
    assert not os.path.exists(tmp_path / "l.jsonl")  # nothing half-written
    led.append("ckpt_saved", step=3, tier="nvme", files=4)  # open event: extra detail allowed
    assert events_of(str(tmp_path / "l.jsonl")) == ["ckpt_saved"]


def _appended_event_names() -> set[tuple[str, str]]:
    """Every literal event name slurmkit hands a ledger: ``<...ledger...>.append("name", ...)``,
    the trainer's ``self._event("name", ...)`` and the store's ``{"event": "name", ...}``."""
    found = set()
    for path in (REPO / "slurmkit").rglob("*.py"):
        where = str(path.relative_to(REPO))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args
                    and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
                    and (node.func.attr == "_event" or (node.func.attr == "append" and "edger"
                                                        in ast.unparse(node.func.value)))):
                found.add((where, node.args[0].value))
            if isinstance(node, ast.Dict):
                for k, v in zip(node.keys, node.values):
                    if isinstance(k, ast.Constant) and k.value == "event":
                        for c in ast.walk(v):  # "a" if x else "b" names two events
                            if isinstance(c, ast.Constant) and isinstance(c.value, str):
                                found.add((where, c.value))
    return found


def test_every_event_the_code_writes_is_in_the_schema() -> None:
    names = _appended_event_names()
    assert len(names) > 20, names  # the scan finds the writers (else this test tests nothing)
    unknown = sorted((p, n) for p, n in names if n not in EVENTS)
    assert unknown == []


def test_every_literal_append_names_fields_its_event_has() -> None:
    """``ledger.append("decision", generaton=...)`` in any module fails here, not in an agent."""
    wrong = []
    for path in (REPO / "slurmkit").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args
                    and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
                    and node.func.attr == "append" and "edger" in ast.unparse(node.func.value)):
                continue
            spec = EVENTS[node.args[0].value]
            names = [k.arg for k in node.keywords if k.arg is not None]
            spread = any(k.arg is None for k in node.keywords)  # **fields: checked at run time
            bad = [k for k in names if spec.type_of(k) is None and not spec.open]
            missing = [] if spread else [k for k in spec.required if k not in names]
            if bad or missing:
                wrong.append((str(path.relative_to(REPO)), node.lineno, node.args[0].value, bad, missing))
    assert wrong == []


def test_the_events_the_supervisor_writes_validate() -> None:
    validate("failure", {"generation": 1, "cls": "rank_crash", "rank": 3, "node": "n2",
                         "evidence": "returncode -9", "time_of_fault": 1.5, "ranks_affected": [3],
                         "slurm_view": []})
    validate("end", {"status": "stopped", "exit_code": 93, "reason": "r"})
    validate("checkpointed_on_signal", {"generation": 0, "signal": None, "step": None})


# ------------------------------------------------------------------ batching
def test_batched_ledger_holds_samples_and_writes_them_with_the_next_urgent_event(tmp_path) -> None:
    path = str(tmp_path / "l.jsonl")
    disk = Disk()
    led = Ledger(path, source="agent:n1", clock=iter(times()).__next__, flush_interval_s=3600.0,
                 write=disk.write)
    for g in range(5):
        led.append("heartbeat", generation=0, node="n1", steps={"0": g})
        led.append("state", old="running", new="running", why="sample")
    assert disk.writes == 0 and not os.path.exists(path)  # held: no shared-FS write yet
    led.append("failure", cls="rank_crash", rank=0, node="n1")  # urgent: written with the rest
    assert disk.writes == 1
    assert events_of(path) == ["heartbeat", "state"] * 5 + ["failure"]
    assert [e["t"] for e in read_ledger(path)] == sorted(e["t"] for e in read_ledger(path))
    led.append("heartbeat", generation=0, node="n1", steps={"0": 9})
    assert led.close() and disk.writes == 2 and events_of(path)[-1] == "heartbeat"
    assert all(e["source"] == "agent:n1" for e in read_ledger(path))


def test_batch_is_written_when_it_reaches_max_batch_bytes(tmp_path) -> None:
    path = str(tmp_path / "l.jsonl")
    disk = Disk()
    led = Ledger(path, flush_interval_s=3600.0, max_batch_bytes=1000, write=disk.write)
    while disk.writes == 0:
        led.append("heartbeat", generation=0, node="n1", steps={str(r): 5 for r in range(4)})
    assert 1000 <= os.path.getsize(path) < 1200
    led.close()


def test_interval_flush_thread_writes_held_events(tmp_path) -> None:
    path = str(tmp_path / "l.jsonl")
    led = Ledger(path, flush_interval_s=0.01)
    led.append("heartbeat", generation=0, node="n1", steps={"0": 1})
    thread = led._thread
    assert thread is not None and thread.daemon
    # wait for the flusher's own interval to pass, on the counter it bumps after the write
    # returned (the file itself exists from the open(O_CREAT), before anything is in it)
    while led.stats.flushes == 0:
        thread.join(0.01)
    assert events_of(path) == ["heartbeat"]
    led.close()
    assert not thread.is_alive()


# ------------------------------------------------------------------ failed writes
@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EIO])
def test_failed_write_is_held_retried_reported_and_recorded(tmp_path, code: int) -> None:
    path = str(tmp_path / "l.jsonl")
    disk, said = Disk(), []
    led = Ledger(path, source="agent:n1", write=disk.write, report=said.append,
                 clock=iter(times()).__next__)
    led.append("submitted", job_id="7")
    disk.full = code
    for step in (1, 2, 3):  # the agent goes on: append never raises
        led.append("train_started", step=step)
    assert events_of(path) == ["submitted"]
    assert led.stats.failures == 3 and led.stats.dropped == 0
    assert len(said) == 1  # reported once, not once per event
    assert errno.errorcode[code] in said[0] and "1 event(s) held" in said[0] and path in said[0]
    disk.full = None
    assert led.flush()
    got = list(read_ledger(path))
    assert [e["event"] for e in got] == ["submitted", "train_started", "train_started",
                                         "train_started", "ledger_write_failed"]
    assert [e.get("step") for e in got[1:4]] == [1, 2, 3]  # nothing lost, in order
    gap = got[-1]
    assert gap["failures"] == 3 and gap["errno"] == errno.errorcode[code] and gap["dropped"] == 0
    assert got[1]["t"] < gap["first_failure_t"] < got[2]["t"]  # when the first write failed
    assert any("works again" in s for s in said)


def test_failures_are_reported_again_after_report_every_s(tmp_path) -> None:
    mono = iter([0.0, 10.0, 61.0, 62.0, 200.0])
    disk, said = Disk(), []
    led = Ledger(str(tmp_path / "l.jsonl"), write=disk.write, report=said.append,
                 mono=mono.__next__, report_every_s=60.0)
    disk.full = errno.ENOSPC
    for s in range(4):
        led.append("train_started", step=s)
    assert len(said) == 2  # at t=0 and t=61, not at 10 or 62


def test_held_events_are_bounded_and_heartbeat_samples_go_first(tmp_path) -> None:
    disk = Disk()
    disk.full = errno.ENOSPC
    led = Ledger(str(tmp_path / "l.jsonl"), write=disk.write, report=lambda _m: None,
                 max_held_bytes=2000, flush_interval_s=3600.0)
    led.append("train_started", step=0)
    for s in range(100):
        led.append("heartbeat", generation=0, node="n1", steps={"0": s})
    led.append("train_finished", step=100)
    assert led._held_bytes <= 2000 and led.stats.dropped > 0
    disk.full = None
    assert led.close()
    got = list(read_ledger(str(tmp_path / "l.jsonl")))
    kinds = [e["event"] for e in got]
    assert kinds[0] == "train_started" and "train_finished" in kinds  # events kept, samples shed
    assert got[-1]["event"] == "ledger_write_failed" and got[-1]["dropped"] == led.stats.dropped
    beats = [e["steps"]["0"] for e in got if e["event"] == "heartbeat"]
    assert beats == sorted(beats) and beats[-1] == 99  # the newest samples survive


def test_a_write_cut_short_by_a_full_disk_leaves_only_a_skipped_fragment(tmp_path) -> None:
    path = str(tmp_path / "l.jsonl")
    disk = Disk()
    led = Ledger(path, write=disk.write, report=lambda _m: None, flush_interval_s=3600.0)
    led.append("train_started", step=1)
    led.append("ckpt_saved", step=10, tier="nvme")
    disk.short = 30  # the batch lands 30 bytes (inside the first record), then ENOSPC
    assert not led.flush()
    with open(path, "rb") as f:
        assert b"\n" not in f.read()  # a torn fragment is all there is
    disk.full = None
    assert led.flush()
    assert [e["event"] for e in read_ledger(path)] == ["train_started", "ckpt_saved",
                                                       "ledger_write_failed"]


def test_close_gives_up_after_its_retries_without_raising(tmp_path) -> None:
    disk, said, slept = Disk(), [], []
    led = Ledger(str(tmp_path / "l.jsonl"), write=disk.write, report=said.append,
                 flush_interval_s=3600.0)
    led.append("heartbeat", generation=0, node="n1", steps={"0": 1})
    disk.full = errno.EIO
    assert not led.close(retries=(0.2, 1.0), sleep=slept.append)
    assert slept == [0.2, 1.0] and led.stats.dropped == 1 and "gave up on 1 event" in said[-1]


def test_an_unopenable_ledger_never_raises_into_the_agent(tmp_path) -> None:
    def opener(_path: str) -> int:
        raise OSError(errno.ESTALE, "Stale file handle")
    said: list[str] = []
    led = Ledger(str(tmp_path / "l.jsonl"), opener=opener, report=said.append)
    led.append("end", status="completed", exit_code=0)
    assert led.stats.failures == 1 and "ESTALE" in said[0]


# ------------------------------------------------------------------ reading
def test_reader_skips_torn_and_foreign_lines_and_recovers_a_record_glued_to_a_fragment(tmp_path) -> None:
    path = tmp_path / "l.jsonl"
    path.write_bytes(b'{"t": 1.0, "event": "submitted"}\n'
                     b'{"t": 2.0, "event": "train_sta'  # torn by a killed writer...
                     b'{"t": 3.0, "event": "heartbeat", "generation": 0, "node": "n", "steps": {}}\n'
                     b'[1, 2]\n\xff\xfe\n\n'
                     b'{"t": 4.0, "event": "end", "status": "comp')  # ...and a torn last line
    assert [e["t"] for e in read_ledger(str(path))] == [1.0, 3.0]


# ------------------------------------------------------------------ rank 0 -> its agent
def test_rank_events_reach_the_ledger_through_the_spool_before_the_agents_next_event(tmp_path) -> None:
    spool = str(tmp_path / "local" / "events" / "a.rank0.jsonl")
    path = str(tmp_path / "run" / "ledger.jsonl")
    rank0 = SpoolWriter(spool, source="rank0", clock=iter(times()).__next__)
    agent = Ledger(path, source="agent:n1", flush_interval_s=3600.0)
    agent.attach(SpoolReader(spool))
    rank0.append("train_started", step=0, generation=0)
    rank0.append("ckpt_saved", step=10, tier="nvme", rank=0)
    assert not os.path.exists(path)  # the rank wrote nothing on the shared file system
    with open(spool, "ab") as f:  # a line still being written is not taken half
        f.write(b'{"t": 5.0, "event": "train_finished", "step"')
    agent.append("end", status="completed", exit_code=0)
    got = list(read_ledger(path))
    assert [(e["event"], e["source"]) for e in got] == [
        ("train_started", "rank0"), ("ckpt_saved", "rank0"), ("end", "agent:n1")]
    with open(spool, "ab") as f:
        f.write(b': 40, "generation": 0}\n{"t": 6.0, "event": "bogus"}\n')
    said: list[str] = []
    agent._report = said.append
    assert agent.flush()
    assert events_of(path)[-2:] == ["train_finished", "rank_data_refused"] and agent.stats.rejected == 1
    assert "bogus" in said[0]
    refused = list(read_ledger(path))[-1]  # named in the ledger too: the rank's file, and why
    assert refused["file"] == spool and "unknown ledger event 'bogus'" in refused["reason"]
    assert os.stat(spool).st_mode & 0o777 == 0o600
    agent.close()


def test_spool_write_failure_is_reported_not_raised(tmp_path, capsys) -> None:
    w = SpoolWriter(str(tmp_path / "events" / "x.jsonl"))
    os.rmdir(tmp_path / "events")
    (tmp_path / "events").write_text("a file where the directory was")  # ENOTDIR, even as root
    w.append("train_started", step=0)
    assert w.lost == 1 and "cannot hand event 'train_started'" in capsys.readouterr().err


def test_urgent_events_are_known_events() -> None:
    assert URGENT <= set(EVENTS)


def test_a_real_enospc_from_the_kernel_is_held_and_written_once_space_is_back(tmp_path) -> None:
    """/dev/full fails every write with ENOSPC (the kernel's, not a fake's); the opener points
    the ledger there while the disk is 'full', then back at the real file."""
    path = str(tmp_path / "l.jsonl")
    where = {"file": "/dev/full"}
    said: list[str] = []

    def opener(_p: str) -> int:
        return os.open(where["file"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    led = Ledger(path, opener=opener, report=said.append, flush_interval_s=3600.0)
    led.append("failure", cls="hang", rank=1, node="n2")  # urgent: tried at once, fails
    assert led.stats.failures == 1 and "ENOSPC" in said[0] and "No space left" in said[0]
    where["file"] = path
    assert led.close()
    assert events_of(path) == ["failure", "ledger_write_failed"]
    assert list(read_ledger(path))[-1]["errno"] == "ENOSPC"
