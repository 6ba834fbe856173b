"""Trust in a local tier's directory, and the private modes of what the store creates there.

A checkpoint on a local path is only as safe as the directories above it: whoever owns one of
them, or may write to one that is not sticky, can rename the step directories and put other
weights in their place, and those pass every check (their manifest moves with them). With
``store.nvme_uri=/local/nvme/$USER/...`` the first user to create ``/local/nvme/<victim>`` would
own every checkpoint the victim saves there. So before the store writes anything, every existing
component of the tier's path, from ``/`` down, is checked:

* it is owned by this user or by root;
* nobody else may write to it, unless it is a sticky directory above the tier (``/tmp``,
  a shared ``/local/nvme``: others cannot rename or delete what this user made in it); the
  tier's own directory must not be writable by others even when sticky (they could create the
  names the store is about to use);
* a symbolic link is followed only when this user or root owns it.

On a shared tier (a Lustre project directory) a directory above the tier's own that is
group-writable or owned by a colleague is a warning naming it, not a refusal: team directories
are commonly a PI's, ``2770``. A directory whose group is the
user's private group (named after the user, no other member: umask 002 sites) counts as
writable by the user alone. The store creates its directories
0700 and its files 0600 whatever the umask: a checkpoint is its owner's data.
"""

from __future__ import annotations

import contextlib
import grp
import os
import pwd
import stat
from collections import deque
from typing import IO

from slurmkit.errors import ConfigError

PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600
_MAX_LINKS = 40  # symbolic links followed in one path (the kernel's own limit)


class UnsafeTierError(ConfigError):
    """A tier's directory could be read, moved or replaced by another user."""


def _who(uid: int) -> str:
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def _walk(path: str, uid: int, tier: str) -> tuple[list[tuple[str, os.stat_result]], bool]:
    """lstat each existing component of the absolute ``path`` from ``/`` down, resolving the
    symbolic links this user or root owns (any other link is refused). Returns the directories
    met, in order, and whether the whole path exists."""
    todo = deque(p for p in path.split("/") if p)
    cur = "/"
    seen = [("/", os.lstat("/"))]
    links = 0
    while todo:
        part = todo.popleft()
        if part == ".":
            continue
        if part == "..":
            cur = os.path.dirname(cur)
            continue
        nxt = os.path.join(cur, part)
        try:
            st = os.lstat(nxt)
        except FileNotFoundError:
            return seen, False
        if stat.S_ISLNK(st.st_mode):
            links += 1
            if st.st_uid not in (uid, 0) or links > _MAX_LINKS:
                raise _refuse(tier, path, f"{nxt} is a symbolic link owned by {_who(st.st_uid)}"
                              if links <= _MAX_LINKS else f"{nxt}: too many symbolic links",
                              "no link in a tier's path that another user owns", nxt)
            target = os.readlink(nxt)
            if target.startswith("/"):
                cur = "/"
            todo.extendleft(reversed([p for p in target.split("/") if p]))
            continue
        if not stat.S_ISDIR(st.st_mode):
            raise _refuse(tier, path, f"{nxt} is not a directory", "a directory", nxt)
        seen.append((nxt, st))
        cur = nxt
    return seen, True


def _private_group(gid: int, uid: int) -> bool:
    """Whether ``gid`` is ``uid``'s user private group (its name, no other member)."""
    if gid == 0:
        return False
    try:
        user = pwd.getpwuid(uid).pw_name
        group = grp.getgrgid(gid)
    except KeyError:
        return False
    return group.gr_name == user and set(group.gr_mem) <= {user}


def _refuse(tier: str, path: str, detected: str, requirement: str, where: str) -> UnsafeTierError:
    return UnsafeTierError(
        detected=f"the {tier} tier's directory {path}: {detected}",
        requirement=f"{requirement}: whoever can write to a directory of a checkpoint's path "
                    "can read, move or replace the checkpoint",
        fix=f"put the tier below a directory only you can write (e.g. `mkdir -m 700` it "
            f"yourself under a sticky shared directory), or have {where} removed or fixed "
            "(`chmod go-w`, or `chmod +t` on a shared parent)")


def check_tier_path(tier: str, path: str, *, shared: bool = False,
                    uid: int | None = None) -> list[str]:
    """Refuse (UnsafeTierError) a tier directory ``path`` that another user could control;
    return warnings (a group-writable directory of a ``shared`` tier). Only the existing part
    of the path is checked: call again once it is created (``private_tier_root``)."""
    uid = os.geteuid() if uid is None else uid
    path = os.path.abspath(path)
    seen, complete = _walk(path, uid, tier)
    warnings = []
    for n, (where, st) in enumerate(seen):
        is_root = complete and n == len(seen) - 1  # the tier's own directory
        warning = _judge(tier, path, where, st, uid, shared=shared, is_root=is_root)
        if warning:
            warnings.append(f"the {tier} tier's directory {path}: {where} {warning}: they "
                            "can replace checkpoints there")
    return warnings


def _judge(tier: str, path: str, where: str, st: os.stat_result, uid: int, *, shared: bool,
           is_root: bool) -> str | None:
    """One directory of the path: raise UnsafeTierError, or return a warning (what a team
    directory of a shared tier may be: owned by a colleague, writable by the group)."""
    problems = []
    if st.st_uid not in (uid, 0):
        if not shared or is_root:
            raise _refuse(tier, path, f"{where} is owned by {_who(st.st_uid)}",
                          "every directory of the path owned by you or root", where)
        problems.append(f"is owned by {_who(st.st_uid)}")
    mode = stat.S_IMODE(st.st_mode)
    open_to_others = bool(mode & 0o022) and not (mode & stat.S_ISVTX and not is_root)
    if open_to_others and not (not mode & 0o002 and _private_group(st.st_gid, uid)):
        if mode & 0o002 or not shared:
            whom = "anyone" if mode & 0o002 else "its group"
            raise _refuse(tier, path, f"{where} (mode {mode:04o}) is writable by {whom}",
                          "no directory of the path writable by others, except sticky "
                          "directories above the tier's own", where)
        problems.append(f"(mode {mode:04o}) is group-writable")
    return " and ".join(problems) or None


def make_private_dirs(path: str) -> None:
    """``os.makedirs(path, exist_ok=True)``, each directory it creates 0700 whatever the umask
    (existing ones are left as they are)."""
    missing = []
    cur = os.path.abspath(path)
    while not os.path.isdir(cur):
        missing.append(cur)
        parent = os.path.dirname(cur)
        if parent == cur:
            break
        cur = parent
    for d in reversed(missing):
        try:
            os.mkdir(d, PRIVATE_DIR)
        except FileExistsError:
            continue  # another rank of this node made it first
        os.chmod(d, PRIVATE_DIR)  # the umask may have taken bits off (0700 exactly)


def private_tier_root(tier: str, path: str, *, shared: bool = False,
                      uid: int | None = None) -> list[str]:
    """Check ``path``, create what is missing of it (0700), check it again (another user may
    have created a component in between); return the warnings. Raises UnsafeTierError."""
    check_tier_path(tier, path, shared=shared, uid=uid)
    make_private_dirs(path)
    return check_tier_path(tier, path, shared=shared, uid=uid)


def open_private(path: str, mode: str = "wb") -> IO[bytes]:
    """Open ``path`` for writing as a 0600 file whatever the umask (``"wb"`` or ``"ab"``)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC
    flags |= os.O_APPEND if "a" in mode else os.O_TRUNC
    fd = private_fd(path, flags)
    return os.fdopen(fd, mode)


def private_fd(path: str, flags: int) -> int:
    """``os.open(path, flags, 0600)``, the mode set exactly (a file created by this user)."""
    fd = os.open(path, flags, PRIVATE_FILE)
    try:
        st = os.fstat(fd)
        if stat.S_IMODE(st.st_mode) != PRIVATE_FILE and st.st_uid == os.geteuid():
            os.fchmod(fd, PRIVATE_FILE)
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(fd)
        raise
    return fd
