"""The snapshot gate: the writer serializes a tensor only after its staging copy finished."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest
import torch

from slurmkit.errors import ConfigError, SlurmkitError
from slurmkit.store import CheckpointStore, StoreConfig
from slurmkit.store.coord import Coordinator
from slurmkit.store.restore import restore_newest
from slurmkit.store.staging import FillGate, StagingBuffers, fill
from slurmkit.store.tier import make_tier
from slurmkit.store.writer import PrimaryWriter


def wait_until(cond: Any, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


def test_gate_blocks_until_set_and_abort_raises() -> None:
    gate = FillGate(["a", "b"])
    gate.wait("not-gated")  # keys without a pending copy pass at once
    got: list[str] = []
    t = threading.Thread(target=lambda: (gate.wait("a"), got.append("a")))
    t.start()
    gate.set("b")
    assert got == [] and t.is_alive()
    gate.set("a")
    t.join(10)
    assert got == ["a"]
    gate2 = FillGate(["x"])
    gate2.abort()
    with pytest.raises(SlurmkitError, match="aborted"):
        gate2.wait("x")


def test_writer_serializes_what_the_snapshot_copied(tmp_path: Any) -> None:
    """The writer starts on half-filled buffers; the file holds the finished copy."""
    tier = make_tier("nvme", str(tmp_path / "nvme"), env={})
    w = PrimaryWriter(tier, Coordinator(None, 0, 1), algo="crc32", write_threads=1,
                      config_hash="", clock=time.time, token="t")
    state = {"first": torch.arange(1000.0), "second": torch.ones(1000)}
    flat, copies = StagingBuffers().prepare(state)
    gate = FillGate([k for k, _, _ in copies])
    flat["first"].zero_()  # what the buffer holds before the snapshot reaches it
    done: list[Any] = []
    t = threading.Thread(target=lambda: done.append(w.write(7, 1, flat, lambda s: [], gate)))
    t.start()
    partial = tmp_path / "nvme" / ".partial"
    wait_until(lambda: partial.exists() and any(
        f.endswith(".distcp") for d in os.listdir(partial) for f in os.listdir(partial / d)),
        "the writer to open its shard file")
    assert t.is_alive()  # waiting at the gate of the first tensor
    fill(copies, gate)
    t.join(30)
    assert done and done[0].step == 7
    tmpl = {"first": torch.zeros(1000), "second": torch.zeros(1000)}
    r = restore_newest(tmpl, [tier], Coordinator(None, 0, 1), str(tmp_path / "scratch"),
                       lambda e: None)
    assert r is not None and r.step == 7
    assert torch.equal(tmpl["first"], torch.arange(1000.0))
    assert torch.equal(tmpl["second"], torch.ones(1000))


def test_bad_state_is_rejected_before_any_write(tmp_path: Any) -> None:
    events: list[dict[str, Any]] = []
    store = CheckpointStore.from_config(StoreConfig(nvme_uri=str(tmp_path / "nvme")), rank=0,
                                        world_size=1, node="n", env={}, on_event=events.append)
    with pytest.raises(ConfigError):
        store.save(1, {"w": torch.ones(3), "bad": object()})
    store.wait()
    store.close()
    assert events == []
    assert not (tmp_path / "nvme" / "n" / ".partial").exists() or \
        os.listdir(tmp_path / "nvme" / "n" / ".partial") == []


@pytest.mark.parametrize("overlap", [False, True])
def test_failed_copy_fails_the_save_and_frees_the_writer(tmp_path: Any, overlap: bool,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[dict[str, Any]] = []
    cfg = StoreConfig(nvme_uri=str(tmp_path / "nvme"), overlap_snapshot=overlap)
    store = CheckpointStore.from_config(cfg, rank=0, world_size=1, node="n", env={},
                                        on_event=events.append)

    def broken_fill(copies: Any, gate: FillGate) -> None:
        raise RuntimeError("copy failed (e.g. a device error)")

    monkeypatch.setattr("slurmkit.store.store.fill", broken_fill)
    with pytest.raises(RuntimeError, match="copy failed"):
        store.save(1, {"w": torch.ones(3)})
    monkeypatch.undo()
    h = store.save(2, {"w": torch.ones(3)})  # the writer thread is free again
    assert h.wait(30)
    store.close()
    # an overlapping writer had started: it reports the aborted save; else nothing started
    assert [e["step"] for e in events if e["event"] == "ckpt_failed"] == ([1] if overlap else [])
    assert store.latest_verified() == 2


@pytest.mark.parametrize("overlap", [False, True])
def test_saves_round_trip_with_and_without_overlap(tmp_path: Any, overlap: bool) -> None:
    cfg = StoreConfig(nvme_uri=str(tmp_path / "nvme"), overlap_snapshot=overlap, keep_nvme=3)
    store = CheckpointStore.from_config(cfg, rank=0, world_size=1, node="n", env={})
    state = {"m": {f"w{i}": torch.full((4096,), float(i)) for i in range(8)}, "step": 0}
    for step in (1, 2, 3):
        for t in state["m"].values():
            t.add_(100.0)  # mutated right after save() returns: the snapshot must not see it
        state["step"] = step
        h = store.save(step, state)
        for t in state["m"].values():
            t.add_(0.5)
        assert h.wait(30)
    tmpl = {"m": {k: torch.zeros(4096) for k in state["m"]}, "step": None}
    r = store.restore(tmpl)
    store.close()
    assert r is not None and r.step == 3 and tmpl["step"] == 3
    for i, k in enumerate(state["m"]):
        assert torch.equal(tmpl["m"][k], torch.full((4096,), i + 300.0 + 1.0))


def test_restore_scratch_is_per_rank(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks of one node share the NVMe tier; each downloads into (and removes) its own dir."""
    seen: list[str] = []
    monkeypatch.setattr("slurmkit.store.store.restore_newest",
                        lambda tmpl, tiers, coord, scratch, emit: seen.append(scratch))
    for rank in (0, 3):
        store = CheckpointStore.from_config(StoreConfig(nvme_uri=str(tmp_path / "nvme")),
                                            rank=rank, world_size=1, node="n", env={})
        store.restore({})
        store.close()
    assert seen == [str(tmp_path / "nvme" / "n" / ".restore" / "rank_0"),
                    str(tmp_path / "nvme" / "n" / ".restore" / "rank_3")]
