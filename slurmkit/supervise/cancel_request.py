"""The cancel request: the file ``slurmkit cancel --checkpoint`` leaves for the node agents.

A checkpoint-then-cancel reuses the stop path every agent and rank already has (SIGUSR1 or
SIGTERM: ranks checkpoint at the next step boundary and leave). What the signal cannot say is
*why*: on the time-limit warning node 0 requeues the job, which a cancel must not do. So the
canceller first writes ``RUN_DIR/cancel_request.json``, then signals; node 0 reads the file
once, after its ranks have left, and ends the job (``end`` status ``cancelled``, then
``scancel`` of its own job, so Slurm records CANCELLED and never requeues it).

The file is read only on that path, never per step, and holds no secret (who asked and when).
The run directory is shared, so the file is read as untrusted: a regular file (never a FIFO
waited on, never a link followed) of a few bytes holding the object the canceller writes; any
other content is refused in the agent's log and counts as no request.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from slurmkit.atomic import atomic_write
from slurmkit.errors import ActionableError
from slurmkit.runfiles import CANCEL_REQUEST_NAME
from slurmkit.untrusted import UntrustedDataError, parse_object, read_regular

log = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 64 * 1024  # the canceller writes under 200 bytes
_FIELDS: dict[str, tuple[type | tuple[type, ...], str]] = {
    "job_id": (str, "string"), "by": (str, "string"), "time": ((int, float), "number")}


class CancelRequestError(ActionableError):
    """A cancel request file that is not one ``slurmkit cancel --checkpoint`` wrote."""


def cancel_request_path(run_dir: str) -> str:
    return os.path.join(run_dir, CANCEL_REQUEST_NAME)


def write_cancel_request(run_dir: str, *, job_id: str, by: str, time_s: float) -> str:
    """Write the request atomically (a reader sees all of it or nothing); returns its path."""
    path = cancel_request_path(run_dir)
    atomic_write(path, json.dumps({"job_id": job_id, "by": by, "time": time_s}), mode=None)
    return path


def load_cancel_request(run_dir: str) -> dict[str, Any] | None:
    """The request, None when there is none; CancelRequestError for anything else there."""
    path = cancel_request_path(run_dir)
    try:
        data = parse_object(read_regular(path, MAX_REQUEST_BYTES), max_bytes=MAX_REQUEST_BYTES)
        for key, (kind, name) in _FIELDS.items():
            if not isinstance(data.get(key), kind) or isinstance(data.get(key), bool):
                raise UntrustedDataError(f"{key}={repr(data.get(key))[:40]}, not a {name}")
    except FileNotFoundError:
        return None
    except (OSError, UntrustedDataError) as exc:  # ELOOP: a link; EACCES: someone else's file
        raise CancelRequestError(f"{path}: {exc}", "the request that slurmkit cancel --checkpoint writes, "
                                 "a small JSON file of this user", f"remove {path} and cancel again") from None
    return data


def read_cancel_request(run_dir: str) -> dict[str, Any] | None:
    """The request, or None when there is none, or when it is refused (then nobody asked; the
    refusal is logged)."""
    try:
        return load_cancel_request(run_dir)
    except CancelRequestError as exc:
        log.error("ignoring the cancel request: %s", exc)
        return None

