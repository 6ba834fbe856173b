"""Reads and writes under a local tier root that never follow a link.

Whoever can write a step directory can put a symbolic link in it: a shard that points at a
file outside the step (another user's, or one the attacker computed the checksum of), a
step directory that points elsewhere, a FIFO that blocks a reader forever. The tier root
itself comes from the user's configuration and is opened as given; below it every
component is opened relative to its parent with ``O_NOFOLLOW``, and only directories and
regular files are accepted. A refusal is an OSError (``LinkRefused``), which every reader
already treats as "this copy is unreadable".

Writes go the same way (the local tier, buddy and peer transfers): the parent directory is
reached without a link, files are created with ``O_NOFOLLOW`` (temporary ones also with
``O_EXCL``) and renamed relative to that directory, so a link planted in a step neither
redirects a write nor gets its target removed; a removal takes the link itself.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import uuid
from collections.abc import Iterator
from typing import IO

from slurmkit.store.tiertrust import make_private_dirs

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_WRITE = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600


class LinkRefused(OSError):
    """A path below a tier root is a link (or not a regular file or directory)."""


def _refused(rel: str, what: str) -> LinkRefused:
    return LinkRefused(errno.ELOOP, f"{rel!r} under the tier root {what}; the checkpoint "
                       "store follows no link below a tier root (remove the link)")


def _components(rel: str) -> list[str]:
    parts = [p for p in rel.split("/") if p]
    if any(p in (".", "..") for p in parts):
        raise _refused(rel, "climbs out of its directory")
    return parts


def _open_dir(root: str, parts: list[str], rel: str, create: bool = False) -> int:
    """An fd of ``root/parts...``, every component below ``root`` opened without
    following a link; with ``create``, missing directories are made 0700."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for p in parts:
            nxt = _sub_dir(fd, p, rel, create)
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


def _sub_dir(fd: int, p: str, rel: str, create: bool) -> int:
    made = False
    while True:
        try:
            nxt = os.open(p, _DIR, dir_fd=fd)
            break
        except FileNotFoundError:
            if not create or made:
                raise
            with contextlib.suppress(FileExistsError):  # another rank of the node made it
                os.mkdir(p, PRIVATE_DIR, dir_fd=fd)
                made = True
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise _refused(rel, f"has {p!r}, a link or not a directory") from exc
            raise
    if made:
        os.fchmod(nxt, PRIVATE_DIR)  # the umask may have taken bits off (0700 exactly)
    return nxt


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


# -- writes, removals, listings ------------------------------------------------------------
def open_parent(root: str, rel: str, create: bool = False) -> tuple[int, str]:
    """(fd of the directory holding ``root/rel``, its last component): no link below
    ``root`` on the way; ``create`` makes missing directories 0700 (the root included)."""
    parts = _components(rel)
    if not parts:
        raise _refused(rel, "is the root itself")
    if create and not os.path.isdir(root):
        make_private_dirs(root)  # the user's own configured path (tiertrust checks it)
    return _open_dir(root, parts[:-1], rel, create), parts[-1]


def make_dirs(root: str, rel: str) -> None:
    """``root/rel`` and its missing parents made 0700, no link below ``root`` followed (an
    existing one refused with LinkRefused)."""
    if not os.path.isdir(root):
        make_private_dirs(root)
    os.close(_open_dir(root, _components(rel), rel, create=True))


def create_at(dfd: int, name: str, *, exclusive: bool = True, append: bool = False) -> int:
    """A write fd of ``name`` in ``dfd``, made 0600: never through a link (``O_NOFOLLOW``),
    and with ``exclusive`` never a file that already exists (temporary names), else
    truncated (or appended to)."""
    flags = _WRITE | (os.O_EXCL if exclusive else os.O_APPEND if append else os.O_TRUNC)
    try:
        fd = os.open(name, flags, PRIVATE_FILE, dir_fd=dfd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _refused(name, "is a link") from exc
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _refused(name, "is not a regular file")
        if stat.S_IMODE(st.st_mode) != PRIVATE_FILE and st.st_uid == os.geteuid():
            os.fchmod(fd, PRIVATE_FILE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def create_private(path: str) -> int:
    """A new 0600 file at ``path`` for writing (``O_EXCL|O_NOFOLLOW``): a leftover of the
    same name (a link someone planted, a file of a crashed run) is removed first, itself."""
    d, name = split(path)
    dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=dfd)
        return create_at(dfd, name)
    finally:
        os.close(dfd)


def write_from(root: str, rel: str, src: IO[bytes], chunk: int = 16 << 20) -> None:
    """Copy ``src`` to ``root/rel`` through a temporary name, fsynced, then renamed over
    ``rel`` (a link there is replaced, its target never written)."""
    dfd, name = open_parent(root, rel, create=True)
    try:
        tmp = f"{name}.tmp-{uuid.uuid4().hex}"
        with os.fdopen(create_at(dfd, tmp), "wb") as fo:
            while buf := src.read(chunk):
                fo.write(buf)
            fo.flush()
            os.fsync(fo.fileno())
        _replace(dfd, tmp, name)
    finally:
        os.close(dfd)


def write_atomic(root: str, rel: str, data: bytes) -> None:
    """``write_from`` for bytes, the directory fsynced so the rename survives a power loss."""
    dfd, name = open_parent(root, rel, create=True)
    try:
        tmp = f"{name}.tmp-{uuid.uuid4().hex}"
        with os.fdopen(create_at(dfd, tmp), "wb") as fo:
            fo.write(data)
            fo.flush()
            os.fsync(fo.fileno())
        _replace(dfd, tmp, name)
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _replace(dfd: int, tmp: str, name: str) -> None:
    try:
        os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dfd)
        raise


def open_write(root: str, rel: str, append: bool = False) -> IO[bytes]:
    """``root/rel`` opened for writing in place (truncated, or appended to), 0600."""
    dfd, name = open_parent(root, rel, create=True)
    try:
        return os.fdopen(create_at(dfd, name, exclusive=False, append=append),
                         "ab" if append else "wb")
    finally:
        os.close(dfd)


def remove(root: str, rel: str, recursive: bool = False) -> None:
    """Remove ``root/rel``; a link is removed itself, never what it points at; a directory
    needs ``recursive`` (shutil's fd-based tree walk, which follows no link); a missing
    path is not an error."""
    try:
        dfd, name = open_parent(root, rel)
    except FileNotFoundError:
        return
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        if not stat.S_ISDIR(st.st_mode):
            os.unlink(name, dir_fd=dfd)
        elif recursive:
            shutil.rmtree(name, dir_fd=dfd)  # type: ignore[call-arg]  # 3.11 has dir_fd
        else:
            raise IsADirectoryError(errno.EISDIR, f"{rel!r} is a directory (not removed "
                                    "without recursive=True)")
    except FileNotFoundError:
        return
    finally:
        os.close(dfd)


def rename(root: str, src_rel: str, dst_rel: str) -> None:
    """Rename ``root/src_rel`` to ``root/dst_rel`` (dst's parents made 0700), both parents
    reached without a link."""
    sfd, sname = open_parent(root, src_rel)
    try:
        dfd, dname = open_parent(root, dst_rel, create=True)
        try:
            os.rename(sname, dname, src_dir_fd=sfd, dst_dir_fd=dfd)
            os.fsync(dfd)
        finally:
            os.close(dfd)
    finally:
        os.close(sfd)


def move_all(root: str, src_rel: str, dst_rel: str) -> bool:
    """Move every entry of the directory ``root/src_rel`` into ``root/dst_rel`` (made
    0700) by name, both reached without a link, fsynced; then remove ``src_rel`` when it is
    empty. False when ``src_rel`` does not exist."""
    try:
        sfd = _open_dir(root, _components(src_rel), src_rel)
    except FileNotFoundError:
        return False
    try:
        dfd, dname = open_parent(root, dst_rel, create=True)
        try:
            nfd = _sub_dir(dfd, dname, dst_rel, create=True)
            try:
                for name in os.listdir(sfd):
                    os.replace(name, name, src_dir_fd=sfd, dst_dir_fd=nfd)
                os.fsync(nfd)
            finally:
                os.close(nfd)
            os.fsync(dfd)
        finally:
            os.close(dfd)
    finally:
        os.close(sfd)
    pfd, sname = open_parent(root, src_rel)
    try:
        with contextlib.suppress(OSError):  # another rank may still be moving its files
            os.rmdir(sname, dir_fd=pfd)
    finally:
        os.close(pfd)
    return True


def read_or_none(root: str, rel: str) -> bytes | None:
    """The bytes of the regular file ``root/rel``; None when missing; ``b""`` when it is a
    link or not a regular file (unreadable, so different from any body a caller expects)."""
    try:
        return read_bytes(root, rel)
    except FileNotFoundError:
        return None
    except LinkRefused:
        return b""


def lexists(root: str, rel: str) -> bool:
    """``root/rel`` exists (a link counts, unfollowed); a link above it raises LinkRefused."""
    if not _components(rel):
        return os.path.isdir(root)
    try:
        dfd, name = open_parent(root, rel)
    except FileNotFoundError:
        return False
    try:
        os.stat(name, dir_fd=dfd, follow_symlinks=False)
        return True
    except FileNotFoundError:
        return False
    finally:
        os.close(dfd)


def listdir(root: str, rel: str) -> list[str]:
    """Sorted names in the directory ``root/rel`` (links listed, not followed); [] when
    missing; a link at or above ``rel`` raises LinkRefused."""
    try:
        fd = _open_dir(root, _components(rel), rel)
    except FileNotFoundError:
        return []
    try:
        return sorted(os.listdir(fd))
    finally:
        os.close(fd)


def open_in_step(path: str) -> int:
    """A read fd of the step file ``path`` (``<parent>/<step dir>/<name>``): neither the
    step directory nor the file followed if a link (``open_fd`` below the step's parent)."""
    head, name = os.path.split(path)
    parent, step = os.path.split(head)
    return open_fd(parent or ".", f"{step}/{name}")
