"""The run's token: ``RUN_DIR/rdzv/token``, 32 random bytes private to the run's owner.

Node 0's agent creates it before the rendezvous file; every agent keys and seals the agents'
channel with it (slurmkit.supervise.channelbase) and every rank signs its checkpoint
coordination with it (slurmkit.store.coord). A file others can read or write, or owned by
someone else, is refused (:class:`ChannelError`).

A leaf module (it imports only slurmkit.errors) so that the store and the supervisor both read
the token without the store importing slurmkit.supervise; ChannelError lives here because
load_token raises it, and slurmkit.supervise.channel re-exports every name.
"""

from __future__ import annotations

import os
import secrets
import stat

from slurmkit.errors import ActionableError
from slurmkit.runfiles import RDZV_DIR, TOKEN_NAME

_TOKEN_BYTES = 32


class ChannelError(ActionableError):
    """Something read from the agents' store (or the token file) cannot be trusted."""


def token_path(run_dir: str) -> str:
    return os.path.join(run_dir, RDZV_DIR, TOKEN_NAME)


def _check_token_file(path: str, st: os.stat_result) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise ChannelError(f"{path} is not a regular file", "the agents' token is a plain file",
                           f"remove {path} and start the run again")
    if st.st_uid != os.getuid():
        raise ChannelError(f"{path} is owned by uid {st.st_uid}, not by this user ({os.getuid()})",
                           "only the run's owner holds the agents' token",
                           f"remove {path} (someone else may have planted it) and start the run again")
    if st.st_mode & 0o077:
        raise ChannelError(f"{path} has mode {stat.S_IMODE(st.st_mode):04o}",
                           "the agents' token is readable by its owner only (0600)",
                           f"remove {path} (its token may have leaked) and start the run again; "
                           "or `chmod 600` it if nobody else could have read it")


def _create_token(path: str) -> None:
    """Write a fresh token at ``path`` unless one is there. Written whole under a private
    name, then linked into place: a process reading the token meanwhile (a rank, another
    agent) finds no file or the whole token, never an empty one."""
    if os.path.lexists(path):
        return  # the usual case: nothing to write (the run directory may even be read-only)
    tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, secrets.token_hex(_TOKEN_BYTES).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass  # another process of the run made it first: theirs stands
    except OSError:  # a file system without hard links: an exclusive create, then the write
        with open(tmp, "rb") as f:
            token = f.read()
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            return
        try:
            os.write(fd, token)
            os.fsync(fd)
        finally:
            os.close(fd)
    finally:
        os.unlink(tmp)


def load_token(run_dir: str, *, create: bool) -> bytes:
    """The run's token; ``create``: make it if missing (the first agent that starts the run)."""
    path = token_path(run_dir)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if create:
        _create_token(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise ChannelError(f"no agents' token at {path}", "node 0's agent creates it before the "
                           "rendezvous file", "put submit.run_root on a file system every node sees") from None
    except OSError as exc:
        raise ChannelError(f"cannot open {path}: {exc}", "the agents' token is a plain 0600 file",
                           f"remove {path} and start the run again") from None
    try:
        _check_token_file(path, os.fstat(fd))
        raw = os.read(fd, 4 * _TOKEN_BYTES).strip()
    finally:
        os.close(fd)
    try:
        token = bytes.fromhex(raw.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        token = b""
    if len(token) != _TOKEN_BYTES:
        raise ChannelError(f"{path} does not hold a {_TOKEN_BYTES}-byte hex token",
                           "the token file written by the run's first agent",
                           f"remove {path} and start the run again")
    return token
