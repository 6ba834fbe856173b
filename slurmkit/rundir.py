"""Trust in a run directory: who may change what every allocation of the job executes.

A run directory lives on a shared file system and holds what each allocation of the job runs:
submitit's pickled entry point, the frozen ``config.yaml`` (with ``job.command``) and
``layout.json``. Whoever can write there can make the job run their code as its user. So:

* ``slurmkit submit`` creates the run directory ``RUN_DIR_MODE`` (0700: private to the user;
  teammates read a run through the user's own tools or a copy, never by write access).
* The batch script checks, before any srun, that the run directory is not a symbolic link, is
  owned by the job's user and is not writable by group or others (``shell_check``); the agents
  check the same in Python with the files they read (``check_run_dir``), because the check in
  the script cannot see what changes later.
* submitit's pickles (``submitit/*_submitted.pkl``: what the batch script's srun unpickles and
  runs on every allocation) are the user's, in a ``submitit/`` folder no one else can write;
  a pickle that group or others could write is refused unless the folder is private (0700:
  then no one else reaches it). submit makes the folder ``SUBMITIT_DIR_MODE`` before submitit
  writes into it and the pickles ``PICKLE_MODE`` after, whatever the umask (with umask 002
  they were 0664 in a 0775 folder: a group member could replace what the next allocation runs).
  An agent checks after its own allocation's pickle was loaded: what it refuses is an exposed
  pickle, so that the job ends (93) before a later allocation loads a replaced one.
* The batch script carries the sha256 of the ``config.yaml`` it was submitted with
  (``$SLURMKIT_CONFIG_SHA256``; slurmctld keeps the script, the run directory cannot change
  it), and every agent refuses a ``config.yaml`` that no longer matches it
  (``check_config_digest``): a requeued job runs exactly what was submitted, or nothing.

A refusal ends the job with exit code 93 (do not requeue): a new allocation cannot mend it.
"""

from __future__ import annotations

import logging
import os
import stat

from slurmkit.errors import ActionableError
from slurmkit.layout import config_digest
from slurmkit.runfiles import CONFIG_NAME, LAYOUT_NAME, SUBMITIT_DIR

log = logging.getLogger(__name__)

RUN_DIR_MODE = 0o700
#: The modes submit gives submitit's folder in a run directory (SUBMITIT_DIR) and its pickles.
SUBMITIT_DIR_MODE = 0o700
PICKLE_MODE = 0o600
#: The files of a run directory that decide what the job runs.
TRUSTED_FILES = (CONFIG_NAME, LAYOUT_NAME)
_FIX = ("resubmit the experiment into a run root only you can write (submit.run_root), and find "
        "out who changed the run directory")


class RunDirError(ActionableError):
    """The run directory (or a file in it) could have been changed by someone else."""


def _check_entry(path: str, uid: int, want_dir: bool, *, writable_ok: bool = False,
                 folder_mode: int | None = None) -> None:
    """``path`` is a real directory (``want_dir``) or regular file of ``uid``, not writable by
    group or others unless ``writable_ok``; ``folder_mode``: the mode of the submitit folder
    ``path`` (a pickle) is in, for the message."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise RunDirError(f"{path} cannot be read ({exc.strerror or exc})",
                          "the run directory slurmkit submit created", _FIX) from exc
    kind = "directory" if want_dir else "regular file"
    if stat.S_ISLNK(st.st_mode):
        raise RunDirError(f"{path} is a symbolic link", f"a {kind}, not a link", _FIX)
    right_kind = stat.S_ISDIR(st.st_mode) if want_dir else stat.S_ISREG(st.st_mode)
    if not right_kind:
        raise RunDirError(f"{path} is not a {kind}", f"a {kind}", _FIX)
    if st.st_uid != uid:
        raise RunDirError(f"{path} is owned by uid {st.st_uid}",
                          f"owned by the job's user (uid {uid})", _FIX)
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not writable_ok:
        if folder_mode is not None:
            raise RunDirError(
                f"{path}, submitit's pickle that every allocation of the job unpickles and runs, is "
                f"writable by group or others (mode {stat.S_IMODE(st.st_mode):04o}) in a folder they "
                f"can reach (mode {folder_mode:04o})",
                f"pickles writable by the job's user only (mode {PICKLE_MODE:04o}), or a private "
                f"submitit folder (mode {SUBMITIT_DIR_MODE:04o})",
                f"chmod {PICKLE_MODE:o} {path} and chmod {SUBMITIT_DIR_MODE:o} {os.path.dirname(path)} if you "
                "made them so, else " + _FIX)
        raise RunDirError(f"{path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})",
                          "writable by the job's user only",
                          f"chmod go-w {path} if you made it so, else " + _FIX)


def check_run_dir(run_dir: str, uid: int | None = None) -> None:
    """Refuse a run directory, ``config.yaml`` or ``layout.json`` that is a link, another
    user's, or writable by group or others. ``layout.json`` may be absent (older runs)."""
    uid = os.getuid() if uid is None else uid
    _check_entry(run_dir, uid, want_dir=True)
    for name in TRUSTED_FILES:
        path = os.path.join(run_dir, name)
        if name == LAYOUT_NAME and not os.path.lexists(path):
            continue
        _check_entry(path, uid, want_dir=False)
    check_submitit(run_dir, uid)


def check_submitit(run_dir: str, uid: int | None = None) -> None:
    """Refuse a ``submitit/`` folder that is a link, another user's or writable by group or
    others, and a pickle in it that is a link, not a regular file, another user's, or
    writable by group or others while the folder lets them reach it. No folder: nothing to
    check (a plain sbatch script's run)."""
    uid = os.getuid() if uid is None else uid
    folder = os.path.join(run_dir, SUBMITIT_DIR)
    if not os.path.lexists(folder):
        return
    _check_entry(folder, uid, want_dir=True)
    folder_mode = stat.S_IMODE(os.lstat(folder).st_mode)
    with os.scandir(folder) as entries:
        for entry in entries:
            if not entry.name.endswith(".pkl"):
                continue  # logs and scripts: nothing an allocation unpickles
            # In a private (0700) folder no one else reaches a pickle, whatever its own mode: an
            # allocation that starts before submit has tightened it (umask 002) is not refused.
            try:
                _check_entry(entry.path, uid, want_dir=False, writable_ok=not folder_mode & 0o077,
                             folder_mode=folder_mode)
            except RunDirError:
                if not os.path.lexists(entry.path):
                    continue  # submitit renamed its temporary pickle meanwhile: checked by its new name
                raise


def make_submitit_dir(run_dir: str) -> str:
    """``run_dir``'s submitit folder, made (or made again) ``SUBMITIT_DIR_MODE`` before submitit
    writes into it: mkdir's mode is filtered by the umask, and submitit's own mkdir keeps
    whatever mode it finds."""
    path = os.path.join(run_dir, SUBMITIT_DIR)
    try:
        os.mkdir(path, SUBMITIT_DIR_MODE)
    except FileExistsError:
        pass
    try:
        _set_mode(path, SUBMITIT_DIR_MODE, os.O_DIRECTORY)
    except OSError:
        pass  # a link or not a directory: refused by name just below
    _check_entry(path, os.getuid(), want_dir=True)
    return path


def seal_pickles(run_dir: str) -> None:
    """Give the submitit folder ``SUBMITIT_DIR_MODE`` and every pickle in it ``PICKLE_MODE``
    (submitit wrote them 0644, or 0664 under umask 002). Called once the job is queued, so it
    never raises: what it cannot tighten (a link, a file gone, another user's) is logged and
    left for every agent's :func:`check_run_dir` to refuse by name."""
    folder = os.path.join(run_dir, SUBMITIT_DIR)
    try:
        _set_mode(folder, SUBMITIT_DIR_MODE, os.O_DIRECTORY)
        with os.scandir(folder) as entries:
            names = [e.path for e in entries if e.name.endswith(".pkl")]
    except OSError as exc:
        log.warning("%s: not made private (%s); the job's agents check it", folder, exc)
        return
    for path in names:
        try:
            _set_mode(path, PICKLE_MODE, os.O_NONBLOCK)  # O_NONBLOCK: a FIFO there must not hang submit
        except FileNotFoundError:
            continue
        except OSError as exc:
            log.warning("%s: not made %04o (%s); the job's agents check it", path, PICKLE_MODE, exc)


def _set_mode(path: str, mode: int, flags: int) -> None:
    """fchmod through a descriptor opened without following a link (chmod would follow one),
    only when the entry is the user's own. Raises OSError (ELOOP for a link)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | flags)
    try:
        if os.fstat(fd).st_uid == os.getuid():
            os.fchmod(fd, mode)
    finally:
        os.close(fd)


def check_config_digest(run_dir: str, expected: str) -> None:
    """Refuse a ``config.yaml`` whose sha256 is not the one the batch script carries."""
    path = os.path.join(run_dir, CONFIG_NAME)
    with open(path, "rb") as f:
        got = config_digest(f.read())
    if got != expected.strip().lower():
        raise RunDirError(f"{path} has sha256 {got[:16]}..., the job was submitted with "
                          f"{expected.strip()[:16]}...",
                          "the config.yaml that slurmkit submit froze, unchanged",
                          "never edit a run directory's config.yaml; resubmit the experiment "
                          "with the change as an override")


def shell_check(var: str = "SLURMKIT_RUN_DIR") -> list[str]:
    """Bash lines for the batch script: refuse (exit 93) a run directory in ``$var`` that is a
    link, another user's or writable by group or others, before anything is run from it."""
    d = f'"${var}"'
    return [
        f'if [ -L {d} ] || [ ! -d {d} ] || [ ! -O {d} ] || '
        f'[ -n "$(find {d} -maxdepth 0 -perm /022 -print)" ]; then',
        f'  echo "slurmkit: Detected: the run directory ${var} is missing, a link, not yours or '
        'writable by group or others. Requirement: a run directory only the job\'s user can write. '
        f'Fix: {_FIX}." >&2',
        "  exit 93",
        "fi",
    ]
