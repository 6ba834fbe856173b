"""Reads under a local tier root that never follow a link.

Whoever can write a step directory can put a symbolic link in it: a shard that points at a
file outside the step (another user's, or one the attacker computed the checksum of), a
step directory that points elsewhere, a FIFO that blocks a reader forever. The tier root
itself comes from the user's configuration and is opened as given; below it every
component is opened relative to its parent with ``O_NOFOLLOW``, and only directories and
regular files are accepted. A refusal is an OSError (``LinkRefused``), which every reader
already treats as "this copy is unreadable".
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator
from typing import IO

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class LinkRefused(OSError):
    """A path below a tier root is a link (or not a regular file or directory)."""


def _refused(rel: str, what: str) -> LinkRefused:
    return LinkRefused(errno.ELOOP, f"{rel!r} under the tier root {what}; checkpoint "
                       "readers follow no link below a tier root")


def _components(rel: str) -> list[str]:
    parts = [p for p in rel.split("/") if p]
    if any(p in (".", "..") for p in parts):
        raise _refused(rel, "climbs out of its directory")
    return parts


def _open_dir(root: str, parts: list[str], rel: str) -> int:
    """An fd of ``root/parts...``, every component below ``root`` opened without
    following a link."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for p in parts:
            try:
                nxt = os.open(p, _DIR, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise _refused(rel, f"has {p!r}, a link or not a directory") from exc
                raise
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_fd(root: str, rel: str) -> int:
    """A read-only fd of the regular file ``root/rel``; LinkRefused when any component
    below ``root`` is a link or the file is not a regular file."""
    parts = _components(rel)
    if not parts:
        raise _refused(rel, "is the root itself")
    dfd = _open_dir(root, parts[:-1], rel)
    try:
        try:
            fd = os.open(parts[-1], _FILE, dir_fd=dfd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise _refused(rel, "is a link") from exc
            raise
    finally:
        os.close(dfd)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise _refused(rel, "is not a regular file")
    os.set_blocking(fd, True)
    return fd


def open_file(root: str, rel: str) -> IO[bytes]:
    """``open_fd`` as a binary file object."""
    return os.fdopen(open_fd(root, rel), "rb")


def read_bytes(root: str, rel: str) -> bytes:
    with open_file(root, rel) as f:
        return f.read()


def size(root: str, rel: str) -> int:
    """Size of the regular file ``root/rel`` (``open_fd``'s checks)."""
    fd = open_fd(root, rel)
    try:
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def split(path: str) -> tuple[str, str]:
    """(directory, file name) of an absolute path: the directory is the root (as given),
    the name is opened without following a link."""
    d, name = os.path.split(path)
    return d or ".", name


def sizes(root: str, rel: str) -> dict[str, int]:
    """name -> size of the regular files directly in ``root/rel``: links and anything
    else are left out; ``rel`` itself being a link raises LinkRefused; missing: {}."""
    try:
        fd = _open_dir(root, _components(rel), rel)
    except FileNotFoundError:
        return {}
    out: dict[str, int] = {}
    try:
        with os.scandir(fd) as it:
            for e in it:
                with contextlib.suppress(FileNotFoundError):
                    if e.is_file(follow_symlinks=False):
                        out[e.name] = e.stat(follow_symlinks=False).st_size
    finally:
        os.close(fd)
    return out


def is_link(root: str, rel: str) -> bool:
    """``root/rel`` exists and is a symbolic link (its parent opened without links)."""
    parts = _components(rel)
    try:
        dfd = _open_dir(root, parts[:-1], rel)
    except FileNotFoundError:
        return False
    try:
        return stat.S_ISLNK(os.stat(parts[-1], dir_fd=dfd, follow_symlinks=False).st_mode)
    except FileNotFoundError:
        return False
    finally:
        os.close(dfd)


@contextlib.contextmanager
def opened(root: str, rel: str) -> Iterator[IO[bytes]]:
    f = open_file(root, rel)
    try:
        yield f
    finally:
        f.close()
