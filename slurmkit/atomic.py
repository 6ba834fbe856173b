"""Writing a whole file atomically, once (issue 35: the project had 23 hand-rolled copies).

A reader of ``path`` sees the old content or the new, never a part of either; once
:func:`atomic_write` returns, the new content and its name survive a crash of the node.

A leaf module (it imports nothing of slurmkit): the control plane, the agents, the ranks and
the low packages (slurm, store) may all use it. The checkpoint store's writes below a tier root
go through slurmkit/store/nofollow.py instead, relative to directory descriptors opened without
following a link.
"""

from __future__ import annotations

import os
import secrets

#: What a file gets with ``mode=None``: open()'s own default, less the process's umask.
UMASK_DEFAULT = 0o666
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def temp_name(path: str) -> str:
    """A temporary name beside ``path`` (same directory, so the rename stays on one file system)
    that no other writer, thread or process, picks."""
    return f"{path}.tmp.{os.getpid()}.{secrets.token_hex(6)}"


def atomic_write(path: str, data: bytes | str, *, mode: int | None = 0o600, fsync_dir: bool = True,
                 temp: str | None = None) -> None:
    """Write ``data`` (a str is UTF-8 encoded) to ``path``, replacing what is there.

    A new temporary file beside ``path``, created ``O_EXCL | O_NOFOLLOW`` (never the target of a
    link planted at its name, never another writer's file), gets ``mode`` exactly, whatever the
    umask (``mode=None``: ``0o666`` less the umask, what ``open(path, "w")`` gives); the data is
    written and fsynced, the file renamed over ``path`` (``os.replace``: a link at ``path`` is
    replaced, its target never written), then the directory is fsynced so that the rename itself
    survives a crash (``fsync_dir``; a file system that refuses a directory's fsync is let be: the
    rename is still atomic). On any error the temporary file is removed and the error raised.

    ``temp``: the temporary name, in ``path``'s directory, for a writer whose name is its own
    (its pid and thread): what is found there is a leftover of a killed writer that had them,
    removed (the entry itself, never a link's target) before the file is created again. Without
    it the name is new (:func:`temp_name`), so a killed writer's leftover stays where it is.
    """
    raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    tmp = temp_name(path) if temp is None else temp
    create = UMASK_DEFAULT if mode is None else mode
    try:
        fd = os.open(tmp, _CREATE, create)
    except FileExistsError:
        if temp is None:
            raise
        os.unlink(tmp)
        fd = os.open(tmp, _CREATE, create)
    try:
        try:
            if mode is not None:
                os.fchmod(fd, mode)
            view = memoryview(raw)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    if fsync_dir:
        sync_dir(os.path.dirname(path) or ".")


def sync_dir(directory: str) -> None:
    """fsync ``directory``, so that a rename inside it survives a crash; a file system that
    refuses it (or a directory that cannot be opened for reading) is let be."""
    try:
        dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)
