"""The sealing DCP writer: checksums taken while writing, plain DCP format, scoped zip CRC."""

from __future__ import annotations

import os
import threading
import warnings
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.serialization

from slurmkit.store import sealing
from slurmkit.store.manifest import hash_file
from slurmkit.store.sealing import SealingFileSystem, SealingStream, SealingWriter


def state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    return {"a": torch.randn(300, 70, generator=g), "b": torch.randn(5, generator=g),
            "c": torch.arange(10, dtype=torch.int16), "v": torch.randn(40, generator=g)[5:15],
            "blob": torch.frombuffer(bytearray(b'{"x":1}'), dtype=torch.uint8)}


def save(path: str, algo: str, threads: int) -> SealingWriter:
    w = SealingWriter(path, algo=algo, thread_count=threads)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: "assuming the intent is to save in a single process"
        dcp.save(state(), storage_writer=w, no_dist=True)
    return w


@pytest.mark.parametrize("algo", ["sha256", "crc32"])
@pytest.mark.parametrize("threads", [1, 3])
def test_records_match_the_bytes_on_disk(tmp_path: Any, algo: str, threads: int) -> None:
    w = save(str(tmp_path), algo, threads)
    names = sorted(n for n in os.listdir(tmp_path))
    assert sorted(w.sealed) == names  # every file (.metadata included) sealed, nothing else
    assert len([n for n in names if n.endswith(".distcp")]) == threads
    for name, (digest, size) in w.sealed.items():
        assert (digest, size) == hash_file(os.path.join(tmp_path, name), algo)


def test_plain_dcp_load_reads_it_bit_exact(tmp_path: Any) -> None:
    save(str(tmp_path), "sha256", 2)
    want = state()
    got = {k: torch.zeros_like(v) for k, v in want.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(got, checkpoint_id=str(tmp_path), no_dist=True)
    for k, v in want.items():
        assert torch.equal(got[k], v), k


def test_view_is_saved_as_its_own_elements(tmp_path: Any) -> None:
    big = torch.randn(1 << 16)
    w = SealingWriter(str(tmp_path), algo="crc32", thread_count=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"v": big[:8]}, storage_writer=w, no_dist=True)
    shard = w.sealed["__0_0.distcp"][1]
    assert shard < 4096  # not the 256 KiB storage behind the view


def test_failed_stream_leaves_no_record(tmp_path: Any) -> None:
    fs = SealingFileSystem("sha256")
    with pytest.raises(RuntimeError):
        with fs.create_stream(str(tmp_path / "f"), "wb") as s:
            s.write(b"abc")
            raise RuntimeError("serializer failed")
    assert fs.sealed == {}
    with fs.create_stream(str(tmp_path / "g.tmp"), "wb") as s:
        s.write(b"abc")
    fs.rename(str(tmp_path / "g.tmp"), str(tmp_path / "g"))
    assert fs.sealed == {"g": hash_file(str(tmp_path / "g"), "sha256")}


def test_stream_counts_and_hashes_memoryviews(tmp_path: Any) -> None:
    s = SealingStream(str(tmp_path / "x"), "crc32")
    s.write(b"hello ")
    s.write(memoryview(torch.arange(4, dtype=torch.int32).numpy()))
    assert s.tell() == 6 + 16
    digest, size = s.seal()
    assert s.closed
    assert (digest, size) == hash_file(str(tmp_path / "x"), "crc32")


def test_zip_crc_off_only_on_writer_threads() -> None:
    seen: dict[str, bool] = {}
    inside = threading.Event()
    leave = threading.Event()

    def writer() -> None:
        with sealing._no_zip_crc():
            seen["writer"] = torch.serialization.get_crc32_options()
            inside.set()
            leave.wait(10)

    t = threading.Thread(target=writer)
    t.start()
    assert inside.wait(10)
    seen["trainer"] = torch.serialization.get_crc32_options()  # concurrently, another thread
    leave.set()
    t.join()
    assert seen == {"writer": False, "trainer": True}
    assert torch.serialization.get_crc32_options() is True


def test_split_items_balances_bytes() -> None:
    from torch.distributed.checkpoint.default_planner import create_default_local_save_plan

    st = {f"t{i}": torch.zeros(n) for i, n in enumerate([100, 90, 50, 40, 10, 10])}
    plan = create_default_local_save_plan(st, is_coordinator=True)
    buckets = sealing.split_items(plan.items, 2)
    sizes = [sum(sealing._item_bytes(i) for i in b) for b in buckets]
    assert sorted(sizes) == [600, 600]  # 300 float32 in all


def write_pattern(path: str, sizes: list[int], direct: bool) -> tuple[bytes, SealingStream]:
    data = bytes((i * 7 + 3) % 251 for i in range(sum(sizes)))
    s = SealingStream(path, "crc32", direct=direct)
    pos = 0
    for n in sizes:
        s.write(memoryview(data)[pos:pos + n])
        pos += n
    return data, s


@pytest.mark.parametrize("sizes", [
    [0], [1], [4096], [4097], [16384], [16385], [3, 16384 * 3 + 5, 4093, 1],
    [16384 - 1, 2, 16384 * 2 - 1], [50000, 50000, 50000],
])
def test_direct_stream_writes_exact_bytes_across_buffer_boundaries(
        tmp_path: Any, monkeypatch: Any, sizes: list[int]) -> None:
    monkeypatch.setattr(sealing, "CHUNK", 16384)  # many buffer boundaries in little data
    path = str(tmp_path / "f")
    data, s = write_pattern(path, sizes, direct=True)
    assert s.direct  # this filesystem takes O_DIRECT (the fallback is tested below)
    assert s.tell() == len(data)
    digest, size = s.seal()
    with open(path, "rb") as f:
        assert f.read() == data
    assert (digest, size) == hash_file(path, "crc32")


def test_stream_falls_back_to_the_page_cache_when_o_direct_is_refused(
        tmp_path: Any, monkeypatch: Any) -> None:
    """Refused at open (tmpfs on older kernels) and refused at the first write."""
    import errno

    monkeypatch.setattr(sealing, "CHUNK", 16384)
    monkeypatch.setattr(sealing, "_open_direct", lambda path: None)
    data, s = write_pattern(str(tmp_path / "a"), [40000, 3], direct=True)
    assert not s.direct
    s.seal()
    assert (tmp_path / "a").read_bytes() == data

    monkeypatch.undo()
    monkeypatch.setattr(sealing, "CHUNK", 16384)
    real_pwrite = os.pwrite
    direct_fds: set[int] = set()
    real_open_direct = sealing._open_direct

    def open_direct(path: str) -> int | None:
        fd = real_open_direct(path)
        if fd is not None:
            direct_fds.add(fd)
        return fd

    def pwrite(fd: int, b: Any, off: int) -> int:
        if fd in direct_fds:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, b, off)

    monkeypatch.setattr(sealing, "_open_direct", open_direct)
    monkeypatch.setattr(os, "pwrite", pwrite)
    data, s = write_pattern(str(tmp_path / "b"), [40000, 3], direct=True)
    assert direct_fds and not s.direct  # the first full buffer was refused and rewritten
    digest, size = s.seal()
    assert (tmp_path / "b").read_bytes() == data
    assert (digest, size) == hash_file(str(tmp_path / "b"), "crc32")


def test_aligned_buffers_are_reused_across_files(tmp_path: Any) -> None:
    before = len(sealing._pool)
    for name in ("x", "y", "z"):
        _, s = write_pattern(str(tmp_path / name), [100], direct=True)
        s.seal()
    assert len(sealing._pool) >= min(2, sealing._POOL_MAX) and len(sealing._pool) >= before
