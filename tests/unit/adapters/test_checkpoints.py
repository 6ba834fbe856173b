"""The checkpoints a program finished writing (issue 36), in real folders: torchtitan's ``step-N``
DCP directories (complete once DCP's ``.metadata`` is there), Lightning's ``.ckpt`` files
(complete once the zip's end record is there: checked on a real ``epoch=1-step=10.ckpt`` from
lightning 2.6.6), a user's glob; and a folder written by someone hostile: links out of it,
FIFOs, odd names, 10,000 entries."""

from __future__ import annotations

import io
import logging
import os
import zipfile
from pathlib import Path

import pytest

from slurmkit.adapters import compile_glob, complete_checkpoints
from slurmkit.errors import ConfigError


def _dcp(path: Path, complete: bool = True) -> Path:
    path.mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(b"\0" * 64)
    if complete:
        (path / ".metadata").write_bytes(b"dcp metadata")
    return path


def _zip_bytes() -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:  # torch.save's container: a zip, its end record last
        z.writestr("archive/data.pkl", b"\x80\x02}q\x00." * 20)
        z.writestr("archive/data/0", b"\0" * 256)
    return buf.getvalue()


def _ckpt(path: Path, complete: bool = True) -> Path:
    data = _zip_bytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data if complete else data[: len(data) - 30])
    return path


def test_torchtitan_step_dirs_with_their_metadata(tmp_path: Path) -> None:
    folder = tmp_path / "outputs" / "checkpoint"
    _dcp(folder / "step-5")
    _dcp(folder / "step-10")
    _dcp(folder / "step-15", complete=False)  # being written, or cut short: not complete
    hf = folder / "step-12"
    hf.mkdir()
    (hf / "model.safetensors.index.json").write_text("{}")  # a last save in HF format
    assert complete_checkpoints("torchtitan", str(folder)) == [
        (5, str(folder / "step-5")), (10, str(folder / "step-10")), (12, str(folder / "step-12"))]


def test_torchtitan_odd_and_hostile_entries(tmp_path: Path) -> None:
    folder = tmp_path / "checkpoint"
    _dcp(folder / "step-1")
    outside = _dcp(tmp_path / "elsewhere" / "step-99")
    os.symlink(outside, folder / "step-99")  # a link out of the folder: not followed
    os.symlink(folder / "step-1", folder / "step-2")  # a link inside it: not followed either
    meta_link = folder / "step-3"
    meta_link.mkdir()
    os.symlink(outside / ".metadata", meta_link / ".metadata")  # the mark itself a link
    meta_dir = folder / "step-4"
    meta_dir.mkdir()
    (meta_dir / ".metadata").mkdir()  # the mark a directory
    os.mkfifo(folder / "step-5")  # a FIFO named as a step: never opened
    (folder / "step-6").write_text("a file")
    for odd in ("step-", "step-abc", "step-7.tmp", "step--8", "step-" + "9" * 20, "step-9007199254740992",
                "Step-10", "step-١١", " step-12", "step-13 "):
        _dcp(folder / odd)
    _dcp(Path(os.fsdecode(os.fsencode(str(folder)) + b"/step-\xff")))
    fifo_mark = folder / "step-14"
    fifo_mark.mkdir()
    os.mkfifo(fifo_mark / ".metadata")
    assert complete_checkpoints("torchtitan", str(folder)) == [(1, str(folder / "step-1"))]


def test_a_missing_or_odd_folder_has_none(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    os.mkfifo(tmp_path / "fifo")
    for folder in (tmp_path / "absent", tmp_path / "file", tmp_path / "fifo"):
        for adapter in ("torchtitan", "lightning"):
            assert complete_checkpoints(adapter, str(folder)) == []
    assert complete_checkpoints("torchtitan", "bad\0name") == []


def test_10000_entries_are_bounded(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    for i in range(10_000):
        (folder / f"junk-{i:05d}").touch()
    for step in (10, 20, 30):
        _dcp(folder / f"step-{step}")
    with caplog.at_level(logging.WARNING, logger="slurmkit.adapters.checkpoints"):
        found = complete_checkpoints("torchtitan", str(folder), limit=100)
    assert set(found) <= {(s, str(folder / f"step-{s}")) for s in (10, 20, 30)}
    assert "stopped after 100 entries" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="slurmkit.adapters.checkpoints"):
        complete_checkpoints("torchtitan", str(folder))  # the default bound, 4,096
    assert "stopped after 4096 entries" in caplog.text
    caplog.clear()
    assert [s for s, _ in complete_checkpoints("torchtitan", str(folder), limit=20_000)] == [10, 20, 30]
    assert not caplog.text


def test_lightning_ckpt_files(tmp_path: Path) -> None:
    root = tmp_path / "lightning_logs"
    a = _ckpt(root / "version_0" / "checkpoints" / "epoch=0-step=10.ckpt")
    _ckpt(root / "version_0" / "checkpoints" / "epoch=1-step=20.ckpt", complete=False)  # still growing
    b = _ckpt(root / "version_1" / "checkpoints" / "epoch=1-step=20-v1.ckpt")
    c = _ckpt(root / "version_1" / "checkpoints" / "step=30.ckpt")
    d = _ckpt(root / "version_1" / "checkpoints" / "epoch=2-step=40-val_loss=0.12.ckpt")
    os.symlink(c.name, root / "version_1" / "checkpoints" / "last.ckpt")  # ModelCheckpoint's link
    _ckpt(root / "version_1" / "checkpoints" / "last-step=50.ckpt.tmp")
    _ckpt(root / "version_1" / "checkpoints" / "epoch=2-val_step=60.ckpt")  # another metric's name
    (root / "version_1" / "checkpoints" / "epoch=3-step=70.ckpt").write_bytes(b"legacy torch.save, no zip")
    _ckpt(root / "version_x" / "checkpoints" / "epoch=0-step=80.ckpt")
    _ckpt(tmp_path / "elsewhere" / "checkpoints" / "epoch=9-step=90.ckpt")
    os.symlink(tmp_path / "elsewhere", root / "version_2")  # a version that is a link out
    os.symlink(tmp_path / "elsewhere" / "checkpoints", root / "version_0" / "checkpoints" / "sub")
    assert complete_checkpoints("lightning", str(root)) == [(10, str(a)), (20, str(b)), (30, str(c)), (40, str(d))]


def test_lightning_ckpt_files_directly_in_the_folder(tmp_path: Path) -> None:
    folder = tmp_path / "checkpoints"
    a = _ckpt(folder / "epoch=0-step=5.ckpt")
    with_comment = folder / "epoch=0-step=6.ckpt"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("a", b"x")
        z.comment = b"a short comment"
    with_comment.write_bytes(buf.getvalue())
    os.mkfifo(folder / "epoch=0-step=7.ckpt")
    assert complete_checkpoints("lightning", str(folder)) == [(5, str(a)), (6, str(with_comment))]


def test_a_real_torch_save_is_complete_and_its_cut_copy_is_not(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    whole = folder / "epoch=0-step=3.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(64)}, "global_step": 3}, whole)
    data = whole.read_bytes()
    for cut in (10, 22, len(data) // 2):
        (folder / f"epoch=0-step={100 + cut}.ckpt").write_bytes(data[:-cut])
    assert complete_checkpoints("lightning", str(folder)) == [(3, str(whole))]


def test_a_users_glob(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    snap = _ckpt(folder / "snapshot-100.pt")
    _ckpt(folder / "snapshot-200.pt", complete=False)
    plain = folder / "snapshot-300.pt"
    plain.write_bytes(b"not a zip: taken as written")
    os.symlink(snap, folder / "snapshot-400.pt")
    assert complete_checkpoints("torchrun", str(folder), "snapshot-{step}.pt") == \
        [(100, str(snap)), (300, str(plain))]
    # nested, the step in a directory's name, pointing at the file written last
    _dcp(folder / "ckpt" / "step_7")
    _dcp(folder / "ckpt" / "step_8", complete=False)
    os.symlink(_dcp(tmp_path / "out" / "step_9"), folder / "ckpt" / "step_9")
    assert complete_checkpoints("none", str(folder), "ckpt/step_{step}/.metadata") == \
        [(7, str(folder / "ckpt" / "step_7" / ".metadata"))]
    # a directory matched: complete with DCP's mark
    assert complete_checkpoints("none", str(folder), "ckpt/step_{step}") == [(7, str(folder / "ckpt" / "step_7"))]
    # wildcards within one name; the glob wins over the adapter's own layout
    (folder / "ep3").mkdir()
    model = _ckpt(folder / "ep3" / "model_12.pt")
    assert complete_checkpoints("torchtitan", str(folder), "ep?/*_{step}.pt") == [(12, str(model))]
    # without a glob, a script's folder says nothing
    assert complete_checkpoints("torchrun", str(folder)) == []
    assert complete_checkpoints("none", str(folder)) == []


@pytest.mark.parametrize("glob", ["", "snapshot.pt", "a-{step}-{step}.pt", "/abs/{step}.pt", "../{step}.pt",
                                  "a/./{step}", "a//{step}", "**/{step}.pt", "[ab]-{step}.pt", "{steps}.pt",
                                  "*-*-{step}.pt", "/".join(["d"] * 8 + ["{step}"]), "x" * 300 + "{step}",
                                  "{step}\0"])
def test_a_glob_that_is_none(glob: str) -> None:
    with pytest.raises(ConfigError) as info:
        compile_glob(glob)
    assert str(info.value).startswith("Detected: checkpoint glob") and "Fix:" in str(info.value)
    with pytest.raises(ConfigError):
        complete_checkpoints("none", "/nonexistent", glob)


def test_glob_odd_names_are_skipped(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    folder.mkdir()
    for name in ("s-.pt", "s-x.pt", "s-" + "9" * 17 + ".pt", "s-١.pt", "s-1.pt.tmp", "s-\n1.pt"):
        _ckpt(folder / name)
    _ckpt(Path(os.fsdecode(os.fsencode(str(folder)) + b"/s-\xff1.pt")))
    good = _ckpt(folder / "s-0001.pt")
    assert complete_checkpoints("none", str(folder), "s-{step}.pt") == [(1, str(good))]
