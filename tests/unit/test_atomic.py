"""slurmkit.atomic.atomic_write: the one atomic file write (issue 35)."""

from __future__ import annotations

import os
import stat

import pytest

from slurmkit import atomic
from slurmkit.atomic import atomic_write


def _mode(path: str) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_bytes_and_str_are_written_whole(tmp_path) -> None:
    path = str(tmp_path / "a.json")
    atomic_write(path, b'{"a": 1}\n')
    with open(path, "rb") as f:
        assert f.read() == b'{"a": 1}\n'
    atomic_write(path, "caf\u00e9")
    with open(path, "rb") as f:
        assert f.read() == "caf\u00e9".encode()
    assert os.listdir(tmp_path) == ["a.json"]


def test_a_large_write_is_whole(tmp_path) -> None:
    data = os.urandom(3 << 20)
    path = str(tmp_path / "big")
    atomic_write(path, data)
    with open(path, "rb") as f:
        assert f.read() == data


def test_mode_is_exact_whatever_the_umask(tmp_path) -> None:
    old = os.umask(0o077)
    try:
        atomic_write(str(tmp_path / "shared"), b"x", mode=0o644)
        atomic_write(str(tmp_path / "private"), b"x")  # 0600 by default
    finally:
        os.umask(old)
    old = os.umask(0o002)
    try:
        atomic_write(str(tmp_path / "private2"), b"x", mode=0o600)
    finally:
        os.umask(old)
    assert _mode(str(tmp_path / "shared")) == 0o644
    assert _mode(str(tmp_path / "private")) == 0o600
    assert _mode(str(tmp_path / "private2")) == 0o600


def test_mode_none_is_what_open_gives(tmp_path) -> None:
    old = os.umask(0o027)
    try:
        atomic_write(str(tmp_path / "f"), b"x", mode=None)
        with open(tmp_path / "g", "w"):
            pass
    finally:
        os.umask(old)
    assert _mode(str(tmp_path / "f")) == _mode(str(tmp_path / "g")) == 0o640


def test_an_existing_file_is_replaced_not_rewritten(tmp_path) -> None:
    path = str(tmp_path / "f")
    with open(path, "wb") as f:
        f.write(b"old content, longer than the new")
    os.chmod(path, 0o640)
    before = os.stat(path).st_ino
    with open(path, "rb") as reader:  # a reader holding the old file keeps reading the old one
        atomic_write(path, b"new")
        assert reader.read() == b"old content, longer than the new"
    with open(path, "rb") as f:
        assert f.read() == b"new"
    assert os.stat(path).st_ino != before and _mode(path) == 0o600


def test_a_link_at_the_path_is_replaced_and_its_target_untouched(tmp_path) -> None:
    target = tmp_path / "target"
    target.write_bytes(b"someone else's")
    path = tmp_path / "f"
    os.symlink(target, path)
    atomic_write(str(path), b"mine")
    assert not path.is_symlink() and path.read_bytes() == b"mine"
    assert target.read_bytes() == b"someone else's"


def test_no_temporary_file_is_left_on_error(tmp_path, monkeypatch) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"old")

    def no_space(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(atomic.os, "fsync", no_space)
    with pytest.raises(OSError, match="No space"):
        atomic_write(str(path), b"new")
    assert os.listdir(tmp_path) == ["f"] and path.read_bytes() == b"old"


def test_no_temporary_file_is_left_when_the_rename_fails(tmp_path) -> None:
    d = tmp_path / "d"
    d.mkdir()
    (d / "f").mkdir()  # a directory where the file goes: the rename fails
    with pytest.raises(OSError):
        atomic_write(str(d / "f"), b"new")
    assert os.listdir(d) == ["f"]


def test_the_file_and_then_its_directory_are_fsynced(tmp_path, monkeypatch) -> None:
    synced: list[tuple[bool, int]] = []
    real = os.fsync

    def record(fd: int) -> None:
        st = os.fstat(fd)
        synced.append((stat.S_ISDIR(st.st_mode), st.st_ino))
        real(fd)

    monkeypatch.setattr(atomic.os, "fsync", record)
    path = str(tmp_path / "f")
    atomic_write(path, b"data")
    assert synced == [(False, os.stat(path).st_ino), (True, os.stat(tmp_path).st_ino)]
    synced.clear()
    atomic_write(path, b"again", fsync_dir=False)
    assert synced == [(False, os.stat(path).st_ino)]


def test_a_directory_that_refuses_fsync_is_let_be(tmp_path, monkeypatch) -> None:
    real = os.fsync

    def refuse_dirs(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(22, "Invalid argument")
        real(fd)

    monkeypatch.setattr(atomic.os, "fsync", refuse_dirs)
    atomic_write(str(tmp_path / "f"), b"data")
    assert (tmp_path / "f").read_bytes() == b"data"


def test_a_planted_link_at_the_temporary_name_is_never_followed(tmp_path, monkeypatch) -> None:
    target = tmp_path / "target"
    target.write_bytes(b"untouched")
    os.symlink(target, tmp_path / "f.tmp.planted")
    monkeypatch.setattr(atomic, "temp_name", lambda path: path + ".tmp.planted")
    with pytest.raises(FileExistsError):
        atomic_write(str(tmp_path / "f"), b"data")
    assert target.read_bytes() == b"untouched" and not (tmp_path / "f").exists()


def test_an_own_temporary_name_replaces_a_killed_writers_leftover(tmp_path) -> None:
    path = str(tmp_path / "f")
    target = tmp_path / "target"
    target.write_bytes(b"untouched")
    os.symlink(target, path + ".mine")  # a leftover, here a link: removed itself, never followed
    atomic_write(path, b"data", temp=path + ".mine")
    assert sorted(os.listdir(tmp_path)) == ["f", "target"] and target.read_bytes() == b"untouched"
    with open(path + ".mine", "w") as f:
        f.write("half a rec")
    atomic_write(path, b"more", temp=path + ".mine")
    assert sorted(os.listdir(tmp_path)) == ["f", "target"]
    with open(path, "rb") as f:
        assert f.read() == b"more"


def test_temporary_names_differ(tmp_path) -> None:
    path = str(tmp_path / "f")
    names = {atomic.temp_name(path) for _ in range(100)}
    assert len(names) == 100 and all(os.path.dirname(n) == str(tmp_path) for n in names)
