"""Node 0's view of checkpoint progress, from the checkpoint store itself.

The crash-loop rule (slurmkit.supervise.policy.decide) needs the newest committed step. It is
read from the tiers' ``latest.json`` (which moves only after that step's manifest verified),
not by parsing the ledger: at 2,048 nodes the ledger is large and shared, and a decision must
not wait on it. A background thread refreshes the value; ``latest`` asks for a fresh read and
waits for it at most ``wait_s``, so a slow file system or object store delays a decision by at
most that bound (the last value read is used then).

A program that saves its own checkpoints (``job.command=[...]``, slurmkit.userapi) reports
each one on rank 0 in a small marker in the run directory; :class:`UserCheckpointReader` is one
more reader, beside the tiers'. The file is input from the ranks, so it is checked as such: a
link, someone else's file, anything but a small regular file or a JSON object with a
non-negative integer ``step`` gives no progress and one warning in the log, never an exception.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from collections.abc import Callable, Sequence

from slurmkit.contract import MARKER_MAX_BYTES, RUN_DIR, marker_path
from slurmkit.errors import SlurmkitError
from slurmkit.untrusted import UntrustedDataError, parse_object

log = logging.getLogger(__name__)

#: One read of the newest committed step of one tier (None: nothing committed or unreadable).
StepReader = Callable[[], "int | None"]


class CheckpointProgress:
    def __init__(self, readers: Sequence[StepReader], *, refresh_s: float = 5.0) -> None:
        self._readers = list(readers)
        self._refresh_s = refresh_s
        self._best: int | None = None
        self._lock = threading.Lock()
        self._wanted = threading.Event()
        self._fresh = threading.Event()
        self._thread: threading.Thread | None = None

    def _read_once(self) -> None:
        for read in self._readers:
            try:
                step = read()
            except Exception as exc:  # noqa: BLE001 - an unreadable tier gives no progress, never an error
                log.warning("checkpoint progress: %s", exc)
                continue
            if step is not None:
                with self._lock:
                    self._best = step if self._best is None else max(self._best, step)

    def _loop(self) -> None:
        while True:
            self._wanted.wait(self._refresh_s)
            self._wanted.clear()
            self._read_once()
            self._fresh.set()

    def start(self) -> "CheckpointProgress":
        self._thread = threading.Thread(target=self._loop, name="ckpt-progress", daemon=True)
        self._thread.start()
        return self

    def latest(self, wait_s: float = 2.0) -> int | None:
        """The newest committed step seen; refreshed first when that takes under ``wait_s``."""
        if self._thread is None:
            self._read_once()
        else:
            self._fresh.clear()
            self._wanted.set()
            self._fresh.wait(wait_s)
        with self._lock:
            return self._best

    def peek(self) -> int | None:
        """The newest committed step read so far, without waiting (a fresh read is asked for,
        and the next call sees it): for a loop that must not block on a slow tier."""
        if self._thread is None:
            self._read_once()
        else:
            self._wanted.set()
        with self._lock:
            return self._best


class UntrustedMarker(SlurmkitError):
    """A checkpoint marker that cannot be taken as progress (why, in words)."""


def _read_marker_bytes(path: str) -> bytes | None:
    """The marker's bytes; None when it does not exist (yet). Neither the marker nor its
    directory is followed when it is a link; only a small regular file of this user is read."""
    try:
        dfd = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as exc:  # ELOOP/ENOTDIR: a link or a file where the directory should be
        raise UntrustedMarker(f"cannot open its directory: {exc}") from None
    try:
        dst = os.fstat(dfd)
        if dst.st_uid != os.getuid():
            raise UntrustedMarker(f"its directory is owned by uid {dst.st_uid}, not {os.getuid()}")
        try:  # O_NONBLOCK: a FIFO planted there must not block the reader
            fd = os.open(os.path.basename(path), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dfd)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise UntrustedMarker(f"cannot open it: {exc}") from None
    finally:
        os.close(dfd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UntrustedMarker("not a regular file")
        if st.st_uid != os.getuid():
            raise UntrustedMarker(f"owned by uid {st.st_uid}, not by this user ({os.getuid()})")
        if st.st_mode & 0o022:
            raise UntrustedMarker(f"writable by others (mode {stat.S_IMODE(st.st_mode):o})")
        if st.st_size > MARKER_MAX_BYTES:
            raise UntrustedMarker(f"{st.st_size} bytes, more than {MARKER_MAX_BYTES}")
        data = os.read(fd, MARKER_MAX_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MARKER_MAX_BYTES:  # grew between the fstat and the read
        raise UntrustedMarker(f"more than {MARKER_MAX_BYTES} bytes")
    return data


def parse_marker(data: bytes) -> int:
    """The ``step`` of a marker's bytes; UntrustedMarker unless it is a JSON object whose step
    is a non-negative integer (not a bool, a float or a string)."""
    try:  # within limits: a step of thousands of digits would reach the ledger, whose readers refuse it
        record = parse_object(data, max_bytes=MARKER_MAX_BYTES)
    except UntrustedDataError as exc:
        raise UntrustedMarker(str(exc)) from None
    step = record.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise UntrustedMarker(f"step {str(step)[:40]!r} is not a non-negative integer")
    return step


class UserCheckpointReader:
    """A StepReader of the program's own checkpoints: the step in rank 0's marker
    (slurmkit.userapi.marker_path), None when there is none or it is refused. A refusal is
    logged as a warning once per distinct reason (the reader runs every few seconds)."""

    def __init__(self, run_dir: str) -> None:
        self.path = marker_path(run_dir)
        self._last_refusal: str | None = None

    def __call__(self) -> int | None:
        try:
            data = _read_marker_bytes(self.path)
            step = None if data is None else parse_marker(data)
        except (UntrustedMarker, OSError) as exc:
            reason = str(exc)
            if reason != self._last_refusal:
                self._last_refusal = reason
                log.warning("Detected: the checkpoint marker %s was refused: %s. Requirement: a regular "
                            "file of this user, at most %d bytes, a JSON object with a non-negative "
                            "integer step, as slurmkit.userapi.report_checkpoint writes it. Fix: remove "
                            "it and report checkpoints with report_checkpoint(step)",
                            self.path, reason, MARKER_MAX_BYTES)
            return None
        self._last_refusal = None
        return step


def tier_readers(store_cfg: object, env: dict[str, str], node_name: str) -> list[StepReader]:
    """``latest.json`` readers of the run's tiers as node 0 sees them: its own NVMe directory,
    the shared file system and the object store (slurmkit.store builds the same URIs); with
    ``SLURMKIT_RUN_DIR`` in ``env``, also the program's own checkpoint marker there."""
    from slurmkit.store.catalog import read_latest
    from slurmkit.store.config import StoreConfig, store_env
    from slurmkit.store.tier import make_tier

    assert isinstance(store_cfg, StoreConfig)  # noqa: S101 - typed by the caller's config
    env = store_env(store_cfg, env)
    uris = []
    if store_cfg.nvme_uri:
        uris.append(("nvme", f"{store_cfg.nvme_uri.rstrip('/')}/{node_name}", ""))
    if store_cfg.lustre_uri:
        uris.append(("lustre", store_cfg.lustre_uri, ""))
    if store_cfg.object_uri:
        uris.append(("object", store_cfg.object_uri, store_cfg.s3_profile))
    readers: list[StepReader] = []
    for name, uri, profile in uris:
        def read(name: str = name, uri: str = uri, profile: str = profile) -> int | None:
            return read_latest(make_tier(name, uri, env, profile))
        readers.append(read)
    if env.get(RUN_DIR):
        readers.append(UserCheckpointReader(env[RUN_DIR]))
    return readers
