"""A per-rank heartbeat on the node's own memory, read by that node's agent.

Any training script can use it: ``Heartbeat.from_env(rank)`` then ``hb.beat(step)`` once per
step. The beat is a small JSON file replaced atomically (write a temporary file, then
``os.replace``), so a reader sees either the previous beat or the new one, never a torn one.

The file lives in a node-local directory (:func:`node_local_dir`: /dev/shm, else $TMPDIR,
else /tmp), never in the run directory: at 2,048 nodes x 8 ranks a beat per step on Lustre
would be tens of thousands of metadata operations per second, and a slow metadata server would
stall every rank's step. On tmpfs a beat is four system calls that never leave the node. The
directory is per user and per run, mode 0700, and never one someone else owns (the parent is
world-writable: another user could otherwise pre-create it and read or forge beats). Its name is
predictable, so another user can take it first (in sticky /dev/shm the victim cannot even remove
it): an agent then uses a directory of its own with an unpredictable name (``mkdtemp``) and tells
its ranks where through their environment (:func:`private_dir`).

The agent publishes what the rank beats at a low, bounded rate (``heartbeat`` ledger samples),
which is what tools on the login node read.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import stat
import tempfile
import time
from collections.abc import Callable, Mapping
from typing import Any

from slurmkit.errors import ActionableError
from slurmkit.untrusted import UntrustedDataError, parse_object, read_regular

log = logging.getLogger(__name__)
BEAT_BYTES = 64 * 1024  # one beat read back (slurmkit.launch.monitor reads the same)


class LocalDirError(ActionableError):
    """The node-local directory for heartbeats cannot be made private to this user."""


def local_root(env: Mapping[str, str]) -> str:
    """Where node-local files go: $SLURMKIT_NODE_LOCAL_DIR, /dev/shm, $TMPDIR, /tmp (first
    that is a writable directory)."""
    for cand in (env.get("SLURMKIT_NODE_LOCAL_DIR"), "/dev/shm", env.get("TMPDIR"), "/tmp"):
        if cand and os.path.isdir(cand) and os.access(cand, os.W_OK | os.X_OK):
            return cand
    raise LocalDirError(detected="no writable node-local directory (/dev/shm, $TMPDIR, /tmp)",
                        requirement="a directory on the node's own memory or disk for heartbeats",
                        fix="export SLURMKIT_NODE_LOCAL_DIR=<a writable local directory>")


def node_local_dir(run_dir: str, env: Mapping[str, str], uid: int | None = None) -> str:
    """This run's node-local directory: <root>/slurmkit-<uid>/<hash of the run dir>. Every node
    derives the same name; on one machine (the local cluster) the nodes share it, which is
    safe because the files in it are named by global rank. ``uid``: the run's user (default:
    this process's), for a reader that is not the run's user (a test as root)."""
    key = hashlib.sha256(os.path.realpath(run_dir).encode()).hexdigest()[:16]
    return os.path.join(local_root(env), f"slurmkit-{os.getuid() if uid is None else uid}", key)


def private_dir(path: str, *, fallback: bool = True) -> str:
    """Create ``path`` and its parent with mode 0700 and return it; refuse one that is a link,
    another user's, or not a directory (fix the mode when it is ours).

    With ``fallback`` (the node agent: it passes the directory to its ranks in their
    environment, so they need not guess its name), a refused ``<root>/slurmkit-<uid>`` is left
    alone and ``<root>/slurmkit-<uid>-<random>/<name>`` is used instead: one this user already
    owns (only this user can own one, so reusing it is safe), else a new one made by
    ``mkdtemp``, which nobody can have taken. Without it, LocalDirError says what was found."""
    try:
        return _make_private(path)
    except LocalDirError as exc:
        if not fallback:
            raise
        refused = exc
    root, uid = os.path.dirname(os.path.dirname(path)), os.getuid()
    try:
        base = _own_fallback(root, uid) or tempfile.mkdtemp(prefix=f"slurmkit-{uid}-", dir=root)
    except OSError as exc:
        raise LocalDirError(
            detected=f"{refused.detected}, and no private directory can be made in {root} ({exc})",
            requirement=refused.requirement, fix=refused.fix) from exc
    fresh = _make_private(os.path.join(base, os.path.basename(path)))
    log.warning("node-local directory: %s; using %s instead (%s)", refused.detected, fresh, refused.fix)
    return fresh


def _make_private(path: str) -> str:
    for d in (os.path.dirname(path), path):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            pass
        except OSError as exc:  # EROFS, ENOSPC, a root that is not a real directory: say so, never a traceback
            raise LocalDirError(detected=f"{d} cannot be made ({exc.strerror or exc})",
                                requirement=f"a directory of uid {os.getuid()} with mode 0700 for heartbeats",
                                fix="export SLURMKIT_NODE_LOCAL_DIR=<a writable local directory>") from exc
        st = os.lstat(d)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            raise LocalDirError(
                detected=f"{d} is {'not a directory' if not stat.S_ISDIR(st.st_mode) else f'owned by uid {st.st_uid}'}",
                requirement=f"a directory of uid {os.getuid()} with mode 0700 for heartbeats",
                fix=f"remove {d}, or export SLURMKIT_NODE_LOCAL_DIR=<a private local directory>")
        if st.st_mode & 0o077:
            os.chmod(d, 0o700)
    return path


def _own_fallback(root: str, uid: int) -> str | None:
    """A directory ``slurmkit-<uid>-*`` in ``root`` that this user owns (not a link), if any."""
    try:
        names = sorted(n for n in os.listdir(root) if n.startswith(f"slurmkit-{uid}-"))
    except OSError:
        return None
    for name in names:
        try:
            st = os.lstat(os.path.join(root, name))
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == uid:
            return os.path.join(root, name)
    return None


def local_heartbeat_path(run_dir: str, rank: int, env: Mapping[str, str] | None = None,
                         uid: int | None = None) -> str:
    """The node-local heartbeat file of ``rank`` in the run at ``run_dir`` (of user ``uid``)."""
    env = os.environ if env is None else env
    return os.path.join(node_local_dir(run_dir, env, uid), "heartbeat", f"rank{rank}.json")


def heartbeat_path(env: Mapping[str, str], rank: int) -> str | None:
    """$SLURMKIT_HEARTBEAT_FILE, else the node-local file for $SLURMKIT_RUN_DIR, else None."""
    explicit = env.get("SLURMKIT_HEARTBEAT_FILE")
    if explicit:
        return explicit
    run_dir = env.get("SLURMKIT_RUN_DIR")
    if run_dir:
        return local_heartbeat_path(run_dir, rank, env)
    return None


class Heartbeat:
    """Writes ``{"rank", "step", "time", "pid", "generation"}`` to ``path`` on every beat."""

    def __init__(self, path: str, *, rank: int, generation: int = 0,
                 clock: Callable[[], float] = time.time, pid: int | None = None) -> None:
        self.path = path
        self.rank = rank
        self.generation = generation
        self._clock = clock
        self._pid = os.getpid() if pid is None else pid
        self._tmp = f"{path}.tmp.{self._pid}"
        os.makedirs(os.path.dirname(os.path.abspath(path)), mode=0o700, exist_ok=True)

    @classmethod
    def from_env(cls, env: Mapping[str, str], rank: int) -> Heartbeat | None:
        """The heartbeat the node agent asked for, or None when no path is configured."""
        path = heartbeat_path(env, rank)
        if path is None:
            return None
        if not env.get("SLURMKIT_HEARTBEAT_FILE"):  # ours to create: private, per user and run
            # strict: a reader finds this beat by its name (no agent tells anyone another one)
            private_dir(os.path.dirname(os.path.dirname(path)), fallback=False)
        return cls(path, rank=rank, generation=int(env.get("SLURMKIT_GENERATION", "0")))

    def beat(self, step: int, **extra: Any) -> dict[str, Any]:
        """Record that ``step`` optimizer steps are complete; returns the written record."""
        record: dict[str, Any] = {
            "rank": self.rank,
            "step": step,
            "time": round(self._clock(), 6),
            "pid": self._pid,
            "generation": self.generation,
        }
        record.update(extra)
        with open(self._tmp, "w", encoding="utf-8") as f:
            json.dump(record, f)
        os.replace(self._tmp, self.path)
        return record


FIGURES_MAX = 16  # figures taken from one beat or sample (slurmkit.userapi.MAX_METRICS)


def figures_of(record: Mapping[str, Any]) -> tuple[dict[str, float | None], int | None]:
    """The figures (``metrics``: name -> number or None) and ``total_steps`` that a beat, or a
    ledger sample copied from one, carries: both written by a rank, so only identifiers of at
    most 48 characters with finite numbers (else None), at most FIGURES_MAX of them, and a
    positive int total are taken; anything else is left out."""
    raw = record.get("metrics")
    figures: dict[str, float | None] = {}
    if isinstance(raw, Mapping):
        for name, value in list(raw.items())[:FIGURES_MAX]:
            if not isinstance(name, str) or not name.isidentifier() or len(name) > 48:
                continue
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            figures[name] = float(value) if ok else None
    total = record.get("total_steps")
    if isinstance(total, bool) or not isinstance(total, int) or not 0 < total < 2**53:
        total = None
    return figures, total


def read_heartbeat(path: str) -> dict[str, Any] | None:
    """The last beat at ``path``, or None if there is none yet, or it is not a beat (not a
    regular file, not a JSON object within slurmkit.untrusted's limits: a rank wrote it)."""
    try:
        return parse_object(read_regular(path, BEAT_BYTES), max_bytes=BEAT_BYTES)
    except (OSError, UntrustedDataError):
        return None
