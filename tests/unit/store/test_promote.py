"""Promotion copies: unique staging per save, leftovers never adopted on size, the source
chosen by checksum (real files on local tiers, real corruption)."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest

from slurmkit.store.catalog import VerifiedCache, check_step, read_latest
from slurmkit.store.manifest import MANIFEST, FileEntry, Manifest, hash_file, step_dir
from slurmkit.store.promote import SourceError, promote_step, save_id, staging_dir
from slurmkit.store.promoter import Promoter
from slurmkit.store.tier import FsspecTier, make_tier


def _save(tier: FsspecTier, step: int, payload: bytes, created: float = 1.0) -> Manifest:
    """A committed step on ``tier`` with one shard holding ``payload``."""
    rel = f"{step_dir(step)}/__0_0.distcp"
    tier.write_atomic(rel, payload)
    path = tier.local_path(rel)
    assert path is not None
    digest, size = hash_file(path, "crc32")
    m = Manifest(step=step, world_size=1, checksum_algo="crc32", created_unix=created,
                 files=[FileEntry("__0_0.distcp", size, digest, 0)])
    tier.write_atomic(f"{step_dir(step)}/{MANIFEST}", m.to_json())
    return m


def _tiers(tmp_path: Any) -> tuple[FsspecTier, FsspecTier, FsspecTier]:
    return (make_tier("nvme", f"{tmp_path}/nvme", {}),
            make_tier("lustre", f"{tmp_path}/lustre", {}),
            make_tier("object", f"{tmp_path}/object", {}))


def _rank0(nvme: FsspecTier, lustre: FsspecTier, events: list[dict[str, Any]], *, world_size: int,
           retry_pending_s: float, commit_timeout_s: float) -> Promoter:
    """Rank 0's promoter from NVMe to Lustre, with quick retries, emitting into ``events``."""
    return Promoter(primary=nvme, tiers=[nvme, lustre], rank=0, world_size=world_size,
                    emit=events.append, gc=lambda t: None, verified=VerifiedCache(),
                    retry_attempts=1, retry_initial_s=0.01, retry_max_s=0.01,
                    retry_pending_s=retry_pending_s, commit_timeout_s=commit_timeout_s,
                    max_workers=world_size, stagger_delay_s=0, clock=time.monotonic, sleep=time.sleep)


def test_a_same_size_leftover_in_staging_is_replaced_not_adopted(tmp_path: Any) -> None:
    nvme, lustre, _ = _tiers(tmp_path)
    payload = os.urandom(1 << 16)
    m = _save(nvme, 5, payload)
    stage = staging_dir(5, save_id(m))
    lustre.write_atomic(f"{stage}/__0_0.distcp", bytes(len(payload)))  # an aborted copy
    promote_step([nvme], lustre, m)
    assert check_step(lustre, 5, deep=True).ok
    with lustre.open(f"{step_dir(5)}/__0_0.distcp") as f:
        assert f.read() == payload


def test_two_saves_of_one_step_stage_apart(tmp_path: Any) -> None:
    nvme, _, _ = _tiers(tmp_path)
    a = _save(nvme, 7, b"a" * 100, created=1.0)
    b = _save(nvme, 7, b"b" * 100, created=2.0)  # a re-save after a restart
    assert staging_dir(7, save_id(a)) != staging_dir(7, save_id(b))
    assert save_id(a) == save_id(Manifest.from_json(a.to_json()))


def test_the_source_is_the_tier_where_the_file_verifies(tmp_path: Any) -> None:
    """NVMe's copy rotted (same size); Lustre holds the same save intact: the object tier
    gets Lustre's bytes. With no intact copy anywhere nothing is committed."""
    nvme, lustre, obj = _tiers(tmp_path)
    payload = os.urandom(1 << 16)
    m = _save(nvme, 9, payload)
    promote_step([nvme], lustre, m)
    shard = nvme.local_path(f"{step_dir(9)}/__0_0.distcp")
    assert shard is not None
    with open(shard, "r+b") as f:
        f.seek(100)
        f.write(b"\x00" * 8 if payload[100:108] != b"\x00" * 8 else b"\x01" * 8)
    promote_step([nvme, lustre], obj, m)
    assert check_step(obj, 9, deep=True).ok
    with obj.open(f"{step_dir(9)}/__0_0.distcp") as f:
        assert f.read() == payload
    other = make_tier("object", f"{tmp_path}/object2", {})
    with pytest.raises(SourceError, match="no tier holds a verified __0_0.distcp"):
        promote_step([nvme], other, m)
    assert not other.exists(f"{step_dir(9)}/{MANIFEST}")


def test_a_rank_that_never_delivers_is_given_up_at_the_deadline(tmp_path: Any) -> None:
    """Rank 1's node was replaced: it never copies its file of step 4. Rank 0 copies its
    own, waits ``commit_timeout_s``, then gives the step up with a ledger event; the step
    is no longer pending and nothing is committed on the destination."""
    nvme, lustre, _ = _tiers(tmp_path)
    files = []
    for rank in (0, 1):
        rel = f"{step_dir(4)}/__{rank}_0.distcp"
        nvme.write_atomic(rel, os.urandom(4096))
        path = nvme.local_path(rel)
        assert path is not None
        digest, size = hash_file(path, "crc32")
        files.append(FileEntry(f"__{rank}_0.distcp", size, digest, rank))
    m = Manifest(step=4, world_size=2, checksum_algo="crc32", files=files,
                 promote_to=["lustre"])
    nvme.write_atomic(f"{step_dir(4)}/{MANIFEST}", m.to_json())
    events: list[dict[str, Any]] = []
    p = _rank0(nvme, lustre, events, world_size=2, retry_pending_s=3600, commit_timeout_s=0.5)
    try:
        assert p.wait_idle(timeout=None)
        (ev,) = [e for e in events if e["event"] == "ckpt_failed"]
        assert ev["step"] == 4 and ev["pending"] is False
        assert ev["reason"] == "promotion_abandoned" and "ranks [1]" in ev["error"]
        assert p.pending() == [] and read_latest(lustre) is None
        assert not lustre.exists(f"{step_dir(4)}/{MANIFEST}")
    finally:
        p.stop()


def test_a_destination_failing_after_the_copies_reports_the_step_and_keeps_it_due(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The object store stops while rank 0 reads the acknowledgements (s3fs raises OSError from
    inside its calls, not TierError): the ledger event names the step, which stays due and is
    committed by a later round once the destination answers."""
    import slurmkit.store.promoter as promoter

    nvme, lustre, _ = _tiers(tmp_path)
    m = _save(nvme, 6, os.urandom(4096))
    nvme.write_atomic(f"{step_dir(6)}/{MANIFEST}", Manifest(
        step=6, world_size=1, checksum_algo="crc32", files=m.files, promote_to=["lustre"]).to_json())
    real, calls = promoter.read_acks, []

    def outage_once(dest: Any, man: Manifest) -> Any:
        calls.append(man.step)
        if len(calls) == 1:
            raise OSError("[Errno 104] Connection reset by peer")
        return real(dest, man)

    monkeypatch.setattr(promoter, "read_acks", outage_once)
    events: list[dict[str, Any]] = []
    p = _rank0(nvme, lustre, events, world_size=1, retry_pending_s=0.05, commit_timeout_s=30)
    try:
        deadline = time.monotonic() + 60
        while read_latest(lustre) != 6 and time.monotonic() < deadline:
            p.wait_idle(timeout=0.1)
        failed = [e for e in events if e["event"] == "ckpt_failed"]
        assert failed and failed[0]["step"] == 6 and failed[0]["pending"] is True, events
        assert "Connection reset" in failed[0]["error"], failed
        assert read_latest(lustre) == 6 and check_step(lustre, 6, deep=True).ok
        assert len(calls) >= 2
    finally:
        p.stop()
