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
