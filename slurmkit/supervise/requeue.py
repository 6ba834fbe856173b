"""Requeue the running job without its bad nodes, and release it at once.

Slurm holds a requeued job for about 120 s (EligibleTime = requeue time + 121 s). A small
detached helper waits until the job is pending again and moves its start time to now. It is
started before the requeue, in its own session, because the requeue ends this job's processes.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from collections.abc import Mapping

from slurmkit.slurm.client import SlurmClient
from slurmkit.slurm.runner import SubprocessRunner

log = logging.getLogger(__name__)

RELEASE_TIMEOUT_S = 180.0


def job_ref(job_id: str, env: Mapping[str, str]) -> str:
    """The id scontrol must be given for this job: ``ARRAY_TASK`` for a job array's task.

    One task of every array has SLURM_JOB_ID equal to the array's id, and scontrol requeue (or
    update) with that id acts on every task of the array, so a task names itself in full.
    """
    if (env.get("SLURM_JOB_ID") == job_id and env.get("SLURM_ARRAY_JOB_ID")
            and env.get("SLURM_ARRAY_TASK_ID")):
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return job_id


def requeue_now(job_id: str, exclude: tuple[str, ...] | list[str], *, env: Mapping[str, str],
                run_dir: str) -> None:
    client = SlurmClient(SubprocessRunner(env=env))
    job_id = job_ref(job_id, env)
    os.makedirs(os.path.join(run_dir, "logs"), exist_ok=True)
    log_path = os.path.join(run_dir, "logs", f"release_{job_id}.log")
    # Slurm takes ExcNodeList only while the job is pending: the helper sets it after the
    # requeue. Until it does, the job is not eligible (held ~120 s), so it cannot start there.
    helper = subprocess.Popen(
        [sys.executable, "-m", "slurmkit.supervise.requeue", "release", job_id, log_path, *exclude],
        env=dict(env), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
        start_new_session=True, close_fds=True)
    # Requeue only once the helper has left this job's process tree: the requeue kills the tree.
    assert helper.stdout is not None  # noqa: S101 - stdout=PIPE
    ready = helper.stdout.readline().strip()
    helper.wait(timeout=30)
    if ready != b"detached":
        log.warning("release helper did not detach (%r); the job waits Slurm's requeue delay", ready)
    client.requeue(job_id)


def release_when_pending(job_id: str, env: Mapping[str, str], exclude: list[str],
                         timeout_s: float = RELEASE_TIMEOUT_S) -> bool:
    client = SlurmClient(SubprocessRunner(env=env))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            info = client.job(job_id)
        except Exception as exc:  # the controller may be busy with the requeue: try again
            log.warning("scontrol show job %s: %s", job_id, exc)
            time.sleep(0.5)
            continue
        if info.state == "PENDING":
            if exclude:
                now_excluded = client.update_exclude(job_id, exclude)
                print(f"job {job_id}: ExcNodeList={','.join(now_excluded)}", flush=True)
            client.release_now(job_id)
            print(f"released job {job_id} (StartTime=now)", flush=True)
            return True
        time.sleep(0.2)
    print(f"job {job_id} never became pending within {timeout_s:.0f} s", flush=True)
    return False


def _detach(log_path: str) -> None:
    """Fork away from the job's process tree; tell the parent on stdout, then log to a file."""
    if os.fork() != 0:
        os._exit(0)
    os.setsid()
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    sys.stdout.write("detached\n")
    sys.stdout.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[0] != "release":
        print("usage: python -m slurmkit.supervise.requeue release JOB_ID LOG [EXCLUDE_NODE...]",
              file=sys.stderr)
        return 2
    _detach(argv[2])
    return 0 if release_when_pending(argv[1], os.environ, argv[3:]) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
