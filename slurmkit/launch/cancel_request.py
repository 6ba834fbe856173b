"""The cancel request: the file ``slurmkit cancel --checkpoint`` leaves for the node agents.

A checkpoint-then-cancel reuses the stop path every agent and rank already has (SIGUSR1 or
SIGTERM: ranks checkpoint at the next step boundary and leave). What the signal cannot say is
*why*: on the time-limit warning node 0 requeues the job, which a cancel must not do. So the
canceller first writes ``RUN_DIR/cancel_request.json``, then signals; node 0 reads the file
once, after its ranks have left, and ends the job (``end`` status ``cancelled``, then
``scancel`` of its own job, so Slurm records CANCELLED and never requeues it).

The file is read only on that path, never per step, and holds no secret (who asked and when).
"""

from __future__ import annotations

import json
import os
from typing import Any

CANCEL_REQUEST_NAME = "cancel_request.json"


def cancel_request_path(run_dir: str) -> str:
    return os.path.join(run_dir, CANCEL_REQUEST_NAME)


def write_cancel_request(run_dir: str, *, job_id: str, by: str, time_s: float) -> str:
    """Write the request atomically (a reader sees all of it or nothing); returns its path."""
    path = cancel_request_path(run_dir)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"job_id": job_id, "by": by, "time": time_s}, f)
    os.replace(tmp, path)
    return path


def read_cancel_request(run_dir: str) -> dict[str, Any] | None:
    """The request, or None when there is none (or it is unreadable: then nobody asked)."""
    try:
        with open(cancel_request_path(run_dir), encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) else None
