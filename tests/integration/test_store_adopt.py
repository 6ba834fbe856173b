"""store.adopt: a program's DCP save copied by each node's part into the shared tier and a real
S3 server, committed, then put back into the program's folder where it is missing or damaged
(real files, real corruption, real links; the agents' side runs on the cluster in
test_user_program_torchtitan.py)."""

from __future__ import annotations

import json
import os
import uuid
from typing import Any

import pytest

from slurmkit.store import adopt
from slurmkit.store.catalog import check_step, read_latest, read_manifest
from slurmkit.store.manifest import METADATA, Manifest
from slurmkit.store.restore import pick_source
from slurmkit.store.tier import FsspecTier, make_tier
from testkit.s3server import S3Server

pytestmark = pytest.mark.integration
L, SLOTS = 2, 2  # ranks per node, training slots: ranks 0-3


def _program_save(folder: str, step: int, seed: int = 0) -> dict[str, bytes]:
    """A finished DCP save as torchtitan lays it out: step-N/.metadata and one shard per rank."""
    d = os.path.join(folder, f"step-{step}")
    os.makedirs(d, exist_ok=True)
    files = {f"__{r}_0.distcp": os.urandom(3000 + 100 * r + seed) for r in range(L * SLOTS)}
    files[METADATA] = b"\x80\x04 index of step %d" % step
    for name, data in files.items():
        with open(os.path.join(d, name), "wb") as f:
            f.write(data)
    return files


def _notice(step: int, tiers: list[str]) -> adopt.Notice:
    return adopt.Notice(step=step, sid=adopt.save_id(step, "00000000", 1.5 + step), created=1.5 + step,
                        tiers=tiers, world_size=L * SLOTS, slots=SLOTS, algo="crc32", origin="program:torchtitan")


def _adopt(folder: str, step: int, tiers: dict[str, FsspecTier]) -> dict[str, Manifest]:
    """Every slot offers its files (slot 0 with .metadata), then rank 0's agent commits."""
    notice = _notice(step, list(tiers))
    path = os.path.join(folder, f"step-{step}")
    for slot in range(SLOTS):
        names = adopt.own(adopt.step_files(path), {slot * L + lr for lr in range(L)}, metadata=slot == 0)
        entries = adopt.hash_entries(path, names, "crc32")
        for t in tiers.values():
            adopt.offer(t, path, notice, entries, slot)
    return {name: adopt.commit(t, notice, adopt.wait_acks(t, notice, 5)) for name, t in tiers.items()}


@pytest.fixture
def tiers(tmp_path: Any, s3_server: S3Server) -> dict[str, FsspecTier]:
    return {"lustre": make_tier("lustre", str(tmp_path / "lustre"), {}),
            "object": make_tier("object", f"s3://{s3_server.bucket}/adopt/{uuid.uuid4().hex}", s3_server.env())}


def _put_back(tiers: dict[str, FsspecTier], folder: str, slot: int, newest: int | None,
              verified: adopt.Verified | None = None) -> adopt.PutBack:
    return adopt.put_back(list(tiers.values()), folder, lambda s: f"step-{s}", newest, {slot * L + lr for lr in range(L)},
                          metadata=slot == 0, verified={} if verified is None else verified)


def test_each_nodes_part_reaches_both_tiers_and_the_commit_names_every_file(tiers, tmp_path) -> None:
    folder = str(tmp_path / "titan" / "checkpoint")
    files = _program_save(folder, 4)
    committed = _adopt(folder, 4, tiers)
    for name, t in tiers.items():
        m = read_manifest(t, 4)
        assert m == committed[name].with_tier(name) and m.origin == "program:torchtitan", m
        assert sorted(e.name for e in m.files) == sorted(files), m.files
        assert {e.name: e.rank for e in m.files}["__3_0.distcp"] == 3
        assert read_latest(t) == 4
        # every byte checked on the tier; the program's pickled index is not slurmkit's to read
        st = check_step(t, 4, deep=True)
        assert st.ok, st.problem
        t.fs.invalidate_cache()  # (s3fs caches listings; SeaweedFS may keep an empty folder entry)
        left = t.fs.find(f"{t.root}/.partial")
        assert not [k for k in left if "/.partial/" in k], left  # acknowledgements and staging gone
    # slurmkit's own restore never takes a program's save, even a whole one
    src, why = pick_source(list(tiers.values()), 4, str(tmp_path / "scratch"), None)
    assert src is None and "not slurmkit's own" in why, why


def test_a_damaged_shard_and_a_lost_save_are_put_back_from_the_fastest_tier_that_verifies(tiers, tmp_path) -> None:
    folder = str(tmp_path / "checkpoint")
    files = _program_save(folder, 6)
    _adopt(folder, 6, tiers)
    # a flipped byte in rank 2's shard, same size and same name: only its node notices
    path = os.path.join(folder, "step-6", "__2_0.distcp")
    with open(path, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    verified: adopt.Verified = {}
    assert _put_back(tiers, folder, 0, 6, verified).fetched == []  # slot 0's files are whole
    got = _put_back(tiers, folder, 1, 6)
    assert (got.step, got.fetched, got.damaged, got.tier) == (6, ["__2_0.distcp"], ["__2_0.distcp"], "lustre"), got
    with open(path, "rb") as f:
        assert f.read() == files["__2_0.distcp"]
    # the shared tier's copy damaged too: the object store's is taken, after its bytes verified
    lustre_copy = tiers["lustre"].local_path("step_0000000006/__3_0.distcp")
    assert lustre_copy is not None
    with open(lustre_copy, "r+b") as f:
        f.write(b"\x00" * 16)
    os.remove(os.path.join(folder, "step-6", "__3_0.distcp"))
    got = _put_back(tiers, folder, 1, 6)
    assert (got.fetched, got.damaged, got.tier) == (["__3_0.distcp"], [], "object"), got
    # the whole save gone (a purged folder): each node puts its part back, slot 0 .metadata last
    for name in os.listdir(os.path.join(folder, "step-6")):
        os.remove(os.path.join(folder, "step-6", name))
    assert sorted(_put_back(tiers, folder, 1, None).fetched) == ["__2_0.distcp", "__3_0.distcp"]
    assert _put_back(tiers, folder, 0, None, verified).fetched == ["__0_0.distcp", "__1_0.distcp", METADATA]
    for name, data in files.items():
        with open(os.path.join(folder, "step-6", name), "rb") as f:
            assert f.read() == data, name
    # a file slot 0 verified and that is unchanged since is not read again: replace its bytes
    # behind the cache's back keeping size, mtime and inode is not something a program does
    assert any(p.endswith("__0_0.distcp") for p in verified)


def test_a_newer_save_of_the_program_is_left_to_it_and_nothing_adopted_is_nothing(tiers, tmp_path) -> None:
    folder = str(tmp_path / "checkpoint")
    assert _put_back(tiers, folder, 1, None).skipped == "no adopted save on any tier"
    _program_save(folder, 2)
    _adopt(folder, 2, tiers)
    _program_save(folder, 4)
    os.remove(os.path.join(folder, "step-2", "__2_0.distcp"))
    got = _put_back(tiers, folder, 1, 4)
    assert got.fetched == [] and "step 4 is newer" in got.skipped, got


def test_a_slot_that_cannot_deliver_fails_the_commit_by_name_and_a_link_is_never_read(tiers, tmp_path) -> None:
    folder = str(tmp_path / "checkpoint")
    _program_save(folder, 8)
    secret = tmp_path / "secret"
    secret.write_bytes(b"not the program's")
    shard = os.path.join(folder, "step-8", "__3_0.distcp")
    os.remove(shard)
    os.symlink(secret, shard)
    path = os.path.join(folder, "step-8")
    notice = _notice(8, ["lustre"])
    lustre = tiers["lustre"]
    with pytest.raises(OSError):  # hashing it opens without following the link
        adopt.hash_entries(path, adopt.own(adopt.step_files(path), {2, 3}, metadata=False), "crc32")
    entries0 = adopt.hash_entries(path, adopt.own(adopt.step_files(path), {0, 1}, metadata=True), "crc32")
    adopt.offer(lustre, path, notice, entries0, 0)
    lustre.write_atomic(f".partial/step_0000000008.promote-{notice.sid}.acks/slot_1.json",
                        json.dumps({"slot": 1, "ok": False, "problem": "__3_0.distcp is a link"}).encode())
    with pytest.raises(adopt.AdoptError, match="slot 1: __3_0.distcp is a link"):
        adopt.commit(lustre, notice, adopt.wait_acks(lustre, notice, 5))
    assert read_latest(lustre) is None
    # an acknowledgement that lists a file under another rank's name is refused, not committed
    lustre.write_atomic(f".partial/step_0000000008.promote-{notice.sid}.acks/slot_1.json",
                        json.dumps({"slot": 1, "ok": True, "files": [
                            {"name": "__0_0.distcp", "size": 1, "checksum": "0", "rank": 3}]}).encode())
    acks = adopt.read_acks(lustre, notice)
    assert 1 in acks.refused and "names rank 3" in acks.refused[1], acks


def test_a_step_holding_other_files_is_not_adopted_and_a_forged_notice_is_refused(tmp_path) -> None:
    folder = str(tmp_path / "checkpoint")
    _program_save(folder, 2)
    with open(os.path.join(folder, "step-2", "model.safetensors"), "wb") as f:
        f.write(b"x")
    with pytest.raises(adopt.AdoptError, match="DCP saves only"):
        adopt.step_files(os.path.join(folder, "step-2"))
    good = _notice(2, ["lustre"]).to_json()
    assert adopt.Notice.from_json(good).step == 2
    for bad in ({**good, "sid": "../../x"}, {**good, "step": -1}, {**good, "origin": ""}, [good], {"step": 1}):
        with pytest.raises(adopt.AdoptError):
            adopt.Notice.from_json(bad)
