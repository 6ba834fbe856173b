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
* The batch script carries the sha256 of the ``config.yaml`` it was submitted with
  (``$SLURMKIT_CONFIG_SHA256``; slurmctld keeps the script, the run directory cannot change
  it), and every agent refuses a ``config.yaml`` that no longer matches it
  (``check_config_digest``): a requeued job runs exactly what was submitted, or nothing.

A refusal ends the job with exit code 93 (do not requeue): a new allocation cannot mend it.
"""

from __future__ import annotations

import os
import stat

from slurmkit.errors import ActionableError
from slurmkit.layout import CONFIG_NAME, LAYOUT_NAME, config_digest

RUN_DIR_MODE = 0o700
#: The files of a run directory that decide what the job runs.
TRUSTED_FILES = (CONFIG_NAME, LAYOUT_NAME)
_FIX = ("resubmit the experiment into a run root only you can write (submit.run_root), and find "
        "out who changed the run directory")


class RunDirError(ActionableError):
    """The run directory (or a file in it) could have been changed by someone else."""


def _check_entry(path: str, uid: int, want_dir: bool) -> None:
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
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
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
