"""Node 0's reader of a user program's checkpoint marker: hostile files give no progress, a
warning, never an exception; the crash-loop rule then counts progress from the marker alone."""

from __future__ import annotations

import json
import logging
import os
import threading

import pytest

from slurmkit.store.config import StoreConfig
from slurmkit.supervise.ckpt_progress import CheckpointProgress, UserCheckpointReader, tier_readers
from slurmkit.failures.classes import FailureClass
from slurmkit.failures.classify import Failure
from slurmkit.supervise.policy import Action, History, Limits, decide
from slurmkit.userapi import MARKER_MAX_BYTES, Reporter, marker_path

NOBODY = 65534
LOG = "slurmkit.supervise.ckpt_progress"


@pytest.fixture()
def run_dir(tmp_path) -> str:
    d = tmp_path / "run"
    d.mkdir()
    return str(d)


def plant(run_dir: str, data: bytes | str, mode: int = 0o644) -> str:
    path = marker_path(run_dir)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
    os.chmod(path, mode)
    return path


def refused(reader: UserCheckpointReader, caplog: pytest.LogCaptureFixture, why: str) -> None:
    """The reader gives no progress and says why, once, in the Detected/Requirement/Fix shape."""
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOG):
        assert reader() is None
        assert reader() is None  # read again every few seconds: the same refusal is not repeated
    msgs = [r.getMessage() for r in caplog.records if r.name == LOG]
    assert len(msgs) == 1, msgs
    assert why in msgs[0] and msgs[0].startswith("Detected: ") and "Requirement: " in msgs[0] and "Fix: " in msgs[0]


def test_no_marker_is_no_progress_and_no_warning(run_dir, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger=LOG):
        assert UserCheckpointReader(run_dir)() is None
        os.makedirs(os.path.dirname(marker_path(run_dir)))
        assert UserCheckpointReader(run_dir)() is None
    assert caplog.records == []


def test_a_marker_written_by_the_api_is_its_step(run_dir) -> None:
    assert Reporter({"RANK": "0", "SLURMKIT_RUN_DIR": run_dir}).checkpoint(12, "/ck/12.pt")
    assert UserCheckpointReader(run_dir)() == 12


@pytest.mark.parametrize(("data", "why"), [
    ('{"step": -1}', "is not a non-negative integer"),
    ('{"step": 1.5}', "is not a non-negative integer"),
    ('{"step": "12"}', "is not a non-negative integer"),
    ('{"step": true}', "is not a non-negative integer"),
    ('{"step": null}', "is not a non-negative integer"),
    ('{"path": "/ck/12.pt"}', "is not a non-negative integer"),
    ("[12]", "a JSON list, not an object"),
    ("12", "a JSON int, not an object"),
    ('{"step": 12', "not JSON"),
    (b'{"step": 12, "path": "\xff"}', "not JSON"),
    ('{"step": ' + "9" * 5000 + "}", "an integer of 5000 digits"),  # beyond Python's int digit limit
    ('{"step": ' + "9" * 4000 + "}", "an integer of 4000 digits"),  # an int to Python: the ledger's readers refuse it
    ("[" * 3000 + "]" * 3000, "nested deeper"),  # nesting deep enough to exhaust a recursive parser
    ("", "not JSON"),
])
def test_garbage_is_refused(run_dir, caplog, data: str | bytes, why: str) -> None:
    plant(run_dir, data)
    refused(UserCheckpointReader(run_dir), caplog, why)


def test_an_oversize_file_is_refused_without_reading_it_all(run_dir, caplog) -> None:
    plant(run_dir, '{"step": 12}' + " " * MARKER_MAX_BYTES)
    refused(UserCheckpointReader(run_dir), caplog, f"more than {MARKER_MAX_BYTES}")


def test_a_symlink_to_a_good_marker_is_refused(run_dir, tmp_path, caplog) -> None:
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text('{"step": 99}')
    path = marker_path(run_dir)
    os.makedirs(os.path.dirname(path))
    os.symlink(elsewhere, path)
    refused(UserCheckpointReader(run_dir), caplog, "cannot open it")


def test_a_symlinked_progress_directory_is_refused(run_dir, tmp_path, caplog) -> None:
    other = tmp_path / "other"
    other.mkdir()
    (other / os.path.basename(marker_path(run_dir))).write_text('{"step": 99}')
    os.symlink(other, os.path.dirname(marker_path(run_dir)))
    refused(UserCheckpointReader(run_dir), caplog, "cannot open its directory")


def test_a_fifo_is_refused_without_blocking(run_dir, caplog) -> None:
    path = marker_path(run_dir)
    os.makedirs(os.path.dirname(path))
    os.mkfifo(path)
    done = threading.Event()
    result: list[int | None] = []

    def read() -> None:
        result.append(UserCheckpointReader(run_dir)())
        done.set()
    with caplog.at_level(logging.WARNING, logger=LOG):
        threading.Thread(target=read, daemon=True).start()
        assert done.wait(10), "the reader blocked on a FIFO"
    assert result == [None]
    assert any("not a regular file" in r.getMessage() for r in caplog.records)


def test_a_directory_at_the_marker_path_is_refused(run_dir, caplog) -> None:
    os.makedirs(marker_path(run_dir))
    refused(UserCheckpointReader(run_dir), caplog, "not a regular file")


def test_a_marker_others_may_write_is_refused(run_dir, caplog) -> None:
    plant(run_dir, '{"step": 12}', mode=0o666)
    refused(UserCheckpointReader(run_dir), caplog, "writable by others")


def _need_root() -> None:
    # chown to another uid needs root: the suite runs as root (CI does); elsewhere it fails.
    if os.geteuid() != 0:
        pytest.fail("chown to another uid needs root: run the suite as root (CI does)")


def test_another_users_marker_is_refused(run_dir, caplog) -> None:
    _need_root()
    os.chown(plant(run_dir, '{"step": 12}'), NOBODY, NOBODY)
    refused(UserCheckpointReader(run_dir), caplog, f"owned by uid {NOBODY}")


def test_a_progress_directory_of_another_user_is_refused(run_dir, caplog) -> None:
    _need_root()
    path = plant(run_dir, '{"step": 12}')
    os.chown(os.path.dirname(path), NOBODY, NOBODY)
    refused(UserCheckpointReader(run_dir), caplog, f"its directory is owned by uid {NOBODY}")


def test_a_refusal_is_said_again_once_it_changes_and_a_good_marker_counts_again(run_dir, caplog) -> None:
    reader = UserCheckpointReader(run_dir)
    plant(run_dir, '{"step": -3}')
    refused(reader, caplog, "is not a non-negative integer")
    plant(run_dir, json.dumps({"step": 20}))
    assert reader() == 20
    plant(run_dir, '{"step": -3}')
    refused(reader, caplog, "is not a non-negative integer")  # refused again after a good one: said again


def store(tmp_path) -> StoreConfig:
    """A real shared-FS tier, empty: the program saves its checkpoints elsewhere."""
    return StoreConfig(lustre_uri=str(tmp_path / "lustre"))


def test_tier_readers_read_the_marker_of_the_run_directory(run_dir, tmp_path) -> None:
    readers = tier_readers(store(tmp_path), {"SLURMKIT_RUN_DIR": run_dir}, "node1")
    progress = CheckpointProgress(readers)
    assert progress.latest() is None  # an empty tier, no marker: no progress
    Reporter({"RANK": "0", "SLURMKIT_RUN_DIR": run_dir}).checkpoint(30)
    assert progress.latest() == 30
    assert not any(isinstance(r, UserCheckpointReader) for r in tier_readers(store(tmp_path), {}, "node1"))


def _crash() -> Failure:
    return Failure(cls=FailureClass.RANK_CRASH, rank=3, node="node2", time=0.0, evidence="returncode -9",
                   ranks_affected=(0, 1, 2, 3))


def test_the_crash_loop_rule_counts_the_programs_reported_checkpoints_and_nothing_else(run_dir, tmp_path) -> None:
    """Two SIGKILLs with max_restarts_without_progress=1, the program checkpointing between them:
    with reports the run restarts each time; with the same checkpoint files unreported, the
    first failure stops it (93)."""
    limits = Limits(max_restarts=5, max_restarts_without_progress=1)
    reporter = Reporter({"RANK": "0", "SLURMKIT_RUN_DIR": run_dir})
    progress = CheckpointProgress(tier_readers(store(tmp_path), {"SLURMKIT_RUN_DIR": run_dir}, "node1"))
    h = History()
    for step in (10, 20):
        (tmp_path / f"step{step}.pt").write_bytes(b"the program's own checkpoint")
        reporter.checkpoint(step, str(tmp_path / f"step{step}.pt"))
        decision, h = decide(_crash(), h, progress.latest(), limits, [], [])
        assert decision.action == Action.RESTART, decision
        h = h.restarted()
    silent_dir = tmp_path / "silent"
    silent_dir.mkdir()
    silent = CheckpointProgress(tier_readers(store(tmp_path), {"SLURMKIT_RUN_DIR": str(silent_dir)}, "node1"))
    (silent_dir / "step10.pt").write_bytes(b"the program's own checkpoint, never reported")
    decision, _ = decide(_crash(), History(), silent.latest(), limits, [], [])
    assert decision.action == Action.STOP and "crash loop" in decision.reason, decision
