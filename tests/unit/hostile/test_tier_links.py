"""Links planted inside a local tier (issue 34, item 4): no operation of the store follows a
symbolic link below a tier root.

Each case plants a real link from inside the tier to a file outside it whose content is
known, runs one operation, and asserts that the outside file was neither read (its bytes
appear in no result), nor written, nor removed. ``step_1/shard`` is a link to the outside
file; ``step_2`` is a step directory that is a link to the outside directory.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from slurmkit.errors import ConfigError
from slurmkit.store import buddy
from slurmkit.store.promote import copy_file
from slurmkit.store.staging import StagingBuffers
from slurmkit.store.tier import FsspecTier, TierError, make_tier

SECRET = b"SECRET-OUTSIDE-THE-TIER"


@dataclass
class World:
    tier: FsspecTier
    root: Path
    outside: Path  # the directory step_2 points at
    secret: Path  # outside/secret: step_1/shard points at it
    scratch: Path  # the caller's own directory (downloads, sources)


@pytest.fixture
def w(tmp_path: Path) -> World:
    root, outside, scratch = tmp_path / "tier", tmp_path / "outside", tmp_path / "scratch"
    for d in (root / "step_1", outside, scratch):
        d.mkdir(parents=True)
    secret = outside / "secret"
    secret.write_bytes(SECRET)
    os.symlink(secret, root / "step_1" / "shard")
    os.symlink(outside, root / "step_2")
    return World(make_tier("nvme", str(root), {}), root, outside, secret, scratch)


def _untouched(w: World) -> None:
    assert w.secret.read_bytes() == SECRET
    assert sorted(os.listdir(w.outside)) == ["secret"]


def _no_secret_in(*places: Any) -> None:
    for p in places:
        data = p.read_bytes() if isinstance(p, Path) and p.exists() else p
        assert SECRET not in (data if isinstance(data, bytes) else repr(data).encode())


# -- the local tier's operations ------------------------------------------------------------
def _get_file(w: World, rel: str) -> Any:
    out = w.scratch / "got"
    with pytest.raises(TierError, match="link"):
        w.tier.get_file(rel, str(out))
    return out


def _get_file_hashed(w: World, rel: str) -> Any:
    out = w.scratch / "got"
    with pytest.raises(TierError, match="link"):
        w.tier.get_file_hashed(rel, str(out), "sha256", len(SECRET))
    return out


def _open_read(w: World, rel: str) -> Any:
    with pytest.raises(TierError, match="link"):
        with w.tier.open(rel, "rb") as f:
            return f.read()
    return b""


def _checksum(w: World, rel: str) -> Any:
    with pytest.raises(TierError, match="link"):
        return w.tier.checksum(rel, "crc32")
    return b""


def _open_write(w: World, rel: str) -> Any:
    with pytest.raises(TierError, match="link"):
        with w.tier.open(rel, "wb") as f:
            f.write(b"overwritten")
    return b""


def _put_file(w: World, rel: str) -> Any:
    src = w.scratch / "src"
    src.write_bytes(b"overwritten")
    with pytest.raises(TierError, match="link"):
        w.tier.put_file(str(src), rel)
    return b""


def _write_atomic(w: World, rel: str) -> Any:
    with pytest.raises(TierError, match="link"):
        w.tier.write_atomic(rel, b"overwritten")
    return b""


def _rm(w: World, rel: str) -> Any:
    with pytest.raises(TierError, match="link"):
        w.tier.rm(rel)
    return b""


def _sizes_of_linked_step(w: World, rel: str) -> Any:
    with pytest.raises(TierError, match="link"):
        w.tier.sizes(rel)
    return b""


def _ls_of_linked_step(w: World, rel: str) -> Any:
    with pytest.raises(TierError, match="link"):
        w.tier.ls(rel)
    return b""


CASES: list[tuple[str, Callable[[World, str], Any], str]] = [
    ("get_file of a linked shard", _get_file, "step_1/shard"),
    ("get_file through a linked step", _get_file, "step_2/secret"),
    ("get_file_hashed of a linked shard", _get_file_hashed, "step_1/shard"),
    ("open of a linked shard", _open_read, "step_1/shard"),
    ("open through a linked step", _open_read, "step_2/secret"),
    ("checksum of a linked shard", _checksum, "step_1/shard"),
    ("open for writing onto a linked shard", _open_write, "step_1/shard"),
    ("put_file into a linked step", _put_file, "step_2/secret"),
    ("write_atomic into a linked step", _write_atomic, "step_2/secret"),
    ("rm of a file through a linked step", _rm, "step_2/secret"),
    ("sizes of a linked step", _sizes_of_linked_step, "step_2"),
    ("ls of a linked step", _ls_of_linked_step, "step_2"),
]


@pytest.mark.parametrize("name,op,rel", CASES, ids=[c[0] for c in CASES])
def test_a_local_tier_operation_follows_no_link(w: World, name: str,
                                                op: Callable[[World, str], Any],
                                                rel: str) -> None:
    result = op(w, rel)
    _no_secret_in(result)
    _untouched(w)


def test_sizes_leave_a_linked_shard_out(w: World) -> None:
    (w.root / "step_1" / "real").write_bytes(b"abc")
    assert w.tier.sizes("step_1") == {"real": 3}
    with pytest.raises(TierError, match="link"):
        w.tier.size("step_1/shard")
    _untouched(w)


def test_rm_of_a_linked_step_removes_the_link_itself(w: World) -> None:
    w.tier.rm("step_2", recursive=True)
    w.tier.rm("step_1/shard")
    assert not os.path.lexists(w.root / "step_2")
    assert os.listdir(w.root / "step_1") == []
    _untouched(w)


# -- buddy copies and peer recovery -------------------------------------------------------
class RecordingLink:
    """A Link that records what is sent, or feeds prepared frames to recv."""

    def __init__(self, frames: list[torch.Tensor] | None = None) -> None:
        self.sent: list[torch.Tensor] = []
        self.frames = list(frames or [])

    def send(self, t: torch.Tensor) -> None:
        self.sent.append(t.clone())

    def recv(self, t: torch.Tensor) -> None:
        t.copy_(self.frames.pop(0))


@pytest.mark.parametrize("rel", ["step_1/shard", "step_2/secret"])
def test_a_buddy_send_of_a_linked_file_sends_it_as_missing(w: World, rel: str) -> None:
    link = RecordingLink()
    buddy._send_file_frame(link, str(w.root / rel), len(SECRET))  # type: ignore[arg-type]
    assert [int(t.item()) for t in link.sent] == [-1]
    _no_secret_in(b"".join(t.numpy().tobytes() for t in link.sent))


def test_a_received_file_does_not_write_through_a_planted_link(w: World) -> None:
    """Peer recovery receives into ``.fetch-<rank>-<name>`` in the step directory: a link
    planted under that name is replaced, its target never written."""
    tmp = w.root / "step_1" / ".fetch-0-shard"
    os.symlink(w.secret, tmp)
    body = b"the peer's bytes"
    link = RecordingLink([torch.tensor([len(body)], dtype=torch.int64),
                          torch.frombuffer(bytearray(body), dtype=torch.uint8)])
    got = buddy._recv_file_frame(link, str(tmp), "crc32")  # type: ignore[arg-type]
    assert got is not None and got[1] == len(body)
    assert not tmp.is_symlink() and tmp.read_bytes() == body
    assert oct(tmp.stat().st_mode & 0o777) == oct(0o600)
    _untouched(w)


# -- promotion ----------------------------------------------------------------------------
def test_promotion_does_not_copy_a_linked_shard(w: World, tmp_path: Path) -> None:
    """The copy opens the source once without following a link (a shard swapped for a link
    after it verified is refused, never read)."""
    dest = make_tier("lustre", str(tmp_path / "lustre"), {})
    with pytest.raises(TierError, match="link"):
        copy_file(w.tier, dest, "step_1/shard", ".partial/stage/shard")
    _no_secret_in(*[p for p in (tmp_path / "lustre").rglob("*") if p.is_file()])
    _untouched(w)


# -- the save refuses a value restore would refuse ------------------------------------------
@pytest.mark.parametrize("depth", [65, 5000])
def test_a_json_value_nested_too_deep_is_refused_before_writing(depth: int) -> None:
    v: Any = "leaf"
    for _ in range(depth):
        v = [v]
    with pytest.raises(ConfigError, match="nests more than 64 levels") as err:
        StagingBuffers().prepare({"w": torch.zeros(2), "deep": v})
    assert "'deep'" in str(err.value)


def test_a_json_value_at_the_depth_limit_is_saved() -> None:
    v: Any = 1
    for _ in range(64):
        v = [v]
    flat, _ = StagingBuffers().prepare({"ok": v})
    assert set(flat) == {"__json__.ok"}


def test_a_json_value_over_the_size_limit_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import slurmkit.store.safe_reader as safe_reader

    monkeypatch.setattr(safe_reader, "MAX_JSON_BYTES", 1000)  # 256 MiB in earnest
    with pytest.raises(ConfigError, match="1002 bytes as JSON"):
        StagingBuffers().prepare({"big": "x" * 1000})


# -- the save's commit ----------------------------------------------------------------------
@pytest.mark.parametrize("planted", ["step_0000000010", ".partial"])
def test_a_save_into_a_step_directory_that_is_a_link_writes_nothing_through_it(
        tmp_path: Path, planted: str) -> None:
    """DCP writes into ``.partial/step_N.<token>`` and the commit moves the shards into
    ``step_N``: a link planted at either is refused, and neither the shards nor the
    manifest land in the directory it points at."""
    from slurmkit.store import CheckpointStore, StoreConfig
    from slurmkit.store.manifest import step_dir

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(SECRET)
    events: list[dict[str, Any]] = []
    st = CheckpointStore.from_config(StoreConfig(nvme_uri=str(tmp_path / "nvme")), rank=0,
                                     world_size=1, node="n0", env={}, on_event=events.append,
                                     sleep=lambda s: None)
    assert step_dir(10) == "step_0000000010"
    os.symlink(outside, tmp_path / "nvme" / "n0" / planted)
    with contextlib.suppress(Exception):  # the failed commit is reported, maybe raised
        st.save(10, {"w": torch.ones(4)})
        st.wait()
    st.close()
    assert sorted(os.listdir(outside)) == ["secret"]
    assert (outside / "secret").read_bytes() == SECRET
    assert "ckpt_saved" not in [e["event"] for e in events]


def test_restore_downloads_go_through_no_planted_restore_link(tmp_path: Path) -> None:
    """A step restored from the object tier is downloaded to ``.restore/rank_N`` on the
    node's tier: a link planted there would receive the checkpoint; it goes to a private
    temporary directory instead, and the restore still succeeds."""
    import shutil

    from slurmkit.store import CheckpointStore, StoreConfig

    outside = tmp_path / "outside"
    outside.mkdir()
    cfg = StoreConfig(nvme_uri=str(tmp_path / "nvme"),
                      object_uri=f"memory://links-{tmp_path.name}/ckpt")

    def store() -> Any:
        return CheckpointStore.from_config(cfg, rank=0, world_size=1, node="n0", env={},
                                           sleep=lambda s: None)

    st = store()
    st.save(10, {"w": torch.arange(4.0)}, final=True)  # promoted to the object tier now
    st.wait()
    st.close()
    shutil.rmtree(tmp_path / "nvme" / "n0")  # the node lost its copy: the object tier has it
    (tmp_path / "nvme" / "n0").mkdir(mode=0o700)
    os.symlink(outside, tmp_path / "nvme" / "n0" / ".restore")
    st = store()
    tmpl = {"w": torch.zeros(4)}
    r = st.restore(tmpl)
    st.close()
    assert r is not None and r.step == 10 and torch.equal(tmpl["w"], torch.arange(4.0))
    assert os.listdir(outside) == []
