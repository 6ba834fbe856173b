"""The campaign's own S3 server: one a run can stop and start without touching anyone else's.

The local cluster's S3 server is shared by every job and test on the machine. A run whose plan
stops S3 gets a SeaweedFS server of its own (``testkit.s3server``: a real ``weed
server`` on loopback) with fresh keys, in a directory under the run root. The job reaches it
through the submitting environment (sbatch exports it; secrets have no place in job.env), and
its object tier (``store.object_uri``) points into that server's bucket. ``stop`` is what an
outage is (the process group SIGKILLed, the port closed); ``start`` brings it back on the same
port, keys and data directory, so the objects written before the outage are there again.
"""

from __future__ import annotations

import secrets
import shutil
import signal
from collections.abc import Callable

from testkit.s3server import S3Server, free_port, start_s3_server, stop_pid

Start = Callable[..., S3Server]
Stop = Callable[[int], None]


def crash(pid: int, timeout_s: float = 10.0) -> None:
    """SIGKILL the server's process group and wait until its leader is gone: an outage that
    begins at once (``weed`` takes the whole 10 s grace of a SIGTERM to stop, while a short
    run trains on through most of its remaining steps)."""
    stop_pid(pid, timeout_s, first=signal.SIGKILL)


class CampaignS3:
    def __init__(self, state_dir: str, *, start: Start = start_s3_server, stop: Stop = stop_pid,
                 outage: Stop = crash) -> None:
        self.state_dir = state_dir
        self.access_key = "chaos" + secrets.token_hex(6)
        self.secret_key = secrets.token_hex(20)
        self.port = 0
        self.server: S3Server | None = None
        self._start, self._stop, self._outage = start, stop, outage
        self.outages = 0

    @property
    def up(self) -> bool:
        return self.server is not None

    def start(self) -> S3Server:
        """Start the server (the same port, keys and data as before); returns when it answers
        and its bucket exists."""
        if self.server is None:
            self.port = self.port or free_port()
            self.server = self._start(self.state_dir, access_key=self.access_key,
                                      secret_key=self.secret_key, s3_port=self.port)
        return self.server

    def stop(self) -> None:
        """The outage: the server's process group is SIGKILLed (``crash``)."""
        if self.server is not None:
            self._outage(self.server.pid)
            self.server = None
            self.outages += 1

    def env(self) -> dict[str, str]:
        if self.server is None:
            raise RuntimeError("the campaign's S3 server is not running")
        return self.server.env()

    def object_uri(self, prefix: str) -> str:
        """The object tier of a run in this server's bucket ($SLURMKIT_RUN_ID: the store's)."""
        bucket = self.server.bucket if self.server is not None else "checkpoints"
        return f"s3://{bucket}/{prefix}/$SLURMKIT_RUN_ID"

    def close(self, *, remove: bool = True) -> None:
        """Stop the server for good and remove its data directory."""
        if self.server is not None:
            self._stop(self.server.pid)
            self.server = None
        if remove:
            shutil.rmtree(self.state_dir, ignore_errors=True)
