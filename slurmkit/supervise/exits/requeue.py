"""Requeue the running job without its bad nodes, and release it at once.

Slurm holds a requeued job for about 120 s (EligibleTime = requeue time + 121 s). A small
detached helper waits until the job is pending again and moves its start time to now. It is
started before the requeue, in its own session, because the requeue ends this job's processes.

A requeue that excludes nodes is a ``requeuehold``: Slurm takes ExcNodeList only while the job
is pending, and a requeue that waited for a down node to finish (node 0 lost: the job stays
COMPLETING until Slurm marks it DOWN) comes back pending without the 120 s delay and was
allocated again within milliseconds, on the excluded node, before the helper could exclude it
(seen on the local cluster). Held, it cannot start until the helper has excluded and released it.
"""

from __future__ import annotations

import logging
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping

from slurmkit.runfiles import LOGS_DIR
from slurmkit.slurm.client import SlurmClient, slurm_client
from slurmkit.slurm.errors import SlurmError

log = logging.getLogger(__name__)

RELEASE_TIMEOUT_S = 180.0
#: Polls of the requeued job while waiting for PENDING: 0.2 s at first (the requeue is usually
#: through within a second), doubling to at most 5 s so a controller busy with a large
#: requeue is not hammered; each poll itself retries transient errors with the client's backoff.
POLL_FIRST_S, POLL_MAX_S = 0.2, 5.0

#: How scontrol names the hold of a job (``requeuehold`` gives the last one).
HELD_REASONS = frozenset({"JobHeldUser", "JobHeldAdmin", "job_requeued_in_held_state"})

#: Starts the detached release helper; returns True once it has left this job's process tree.
StartHelper = Callable[[list[str], Mapping[str, str]], bool]


def job_ref(job_id: str, env: Mapping[str, str]) -> str:
    """The id scontrol must be given for this job: ``ARRAY_TASK`` for a job array's task.

    One task of every array has SLURM_JOB_ID equal to the array's id, and scontrol requeue (or
    update) with that id acts on every task of the array, so a task names itself in full.
    """
    if (env.get("SLURM_JOB_ID") == job_id and env.get("SLURM_ARRAY_JOB_ID")
            and env.get("SLURM_ARRAY_TASK_ID")):
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return job_id


def start_detached_helper(argv: list[str], env: Mapping[str, str]) -> bool:
    """Run ``argv`` in its own session; True once it printed that it detached."""
    helper = subprocess.Popen(
        argv, env=dict(env), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL, start_new_session=True, close_fds=True)
    assert helper.stdout is not None  # noqa: S101 - stdout=PIPE
    ready = helper.stdout.readline().strip()
    helper.wait(timeout=30)
    return ready == b"detached"


def requeue_now(client: SlurmClient, job_id: str, exclude: tuple[str, ...] | list[str], *,
                env: Mapping[str, str], run_dir: str,
                start_helper: StartHelper = start_detached_helper) -> None:
    """Requeue through ``client``, after starting the helper that releases the job at once.

    The helper is a separate process (the requeue ends this one), so it builds its own client
    from ``env`` at its entry point (:func:`main`); tests drive :func:`release_when_pending`
    with their own client instead.
    """
    job_id = job_ref(job_id, env)
    os.makedirs(os.path.join(run_dir, LOGS_DIR), exist_ok=True)
    log_path = os.path.join(run_dir, LOGS_DIR, f"release_{job_id}.log")
    # Slurm takes ExcNodeList only while the job is pending: the helper sets it after the
    # requeue. Until it does, the job is not eligible (held ~120 s), so it cannot start there.
    argv = [sys.executable, "-m", "slurmkit.supervise.exits.requeue", "release", job_id, log_path,
            *exclude]
    # Requeue only once the helper has left this job's process tree: the requeue kills the tree.
    if not start_helper(argv, env):
        log.warning("release helper did not detach; the job waits Slurm's requeue delay")
    if requeued_already(client, job_id, env):
        return
    try:
        client.requeue(job_id, hold=bool(exclude))
    except SlurmError:
        if not requeued_already(client, job_id, env):
            raise


def refused_by_slurm(job_id: str, exc: BaseException, run_id: str | None) -> str:
    """What to say when Slurm refused this job's own requeue (a QOS or job_submit plugin that
    forbids it, JobRequeue=0 with no --requeue, no scontrol inside a container): the job stops
    instead of ending FAILED on an exception, and its checkpoints are kept for a resubmission."""
    said = last_line(exc)
    resume = f"store.run_id={run_id}" if run_id else "the same store.run_id"
    return (f"Detected: Slurm refused `scontrol requeue {job_id}`: {said}. Requirement: a job that may "
            "requeue itself (the site's JobRequeue, QOS and job_submit rules allow it, and scontrol "
            f"runs inside the job). Fix: the run's checkpoints are kept: resubmit with {resume} to "
            "resume from them, and ask the site whether jobs may requeue themselves")


def last_line(exc: BaseException) -> str:
    """The last non-empty line of an error (a Slurm command's own words), at most 300 characters."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return (lines[-1] if lines else type(exc).__name__)[:300]


def requeued_already(client: SlurmClient, job_id: str, env: Mapping[str, str]) -> bool:
    """True when Slurm has requeued this job past the attempt ``env`` belongs to.

    A node 0 lost without --no-kill races Slurm's own NODE_FAIL requeue: when Slurm was first,
    a second ``scontrol requeue`` fails (pending job) or, worse, lands after the next attempt
    started and kills it. The helper started above still excludes the bad nodes and releases
    the pending job. Unknown (no attempt number, controller unreachable): False, requeue.
    """
    ours = env.get("SLURM_RESTART_COUNT", "0") or "0"
    if "SLURM_JOB_ID" not in env or not ours.isdigit():
        return False
    try:
        info = client.job(job_id)
    except SlurmError as exc:
        log.warning("scontrol show job %s before the requeue: %s", job_id, exc)
        return False
    if info.restart_cnt > int(ours):
        log.warning("job %s was requeued already (restart %d, this attempt %s): not requeued again",
                    job_id, info.restart_cnt, ours)
        return True
    return False


def release_when_pending(client: SlurmClient, job_id: str, exclude: list[str],
                         timeout_s: float = RELEASE_TIMEOUT_S, *,
                         clock: Callable[[], float] = time.monotonic,
                         sleep: Callable[[float], None] = time.sleep,
                         wall: Callable[[], float] = time.time) -> bool:
    """Once the requeued job is PENDING: exclude the bad nodes and make it eligible now."""
    deadline = clock() + timeout_s
    wait = POLL_FIRST_S
    while clock() < deadline:
        try:
            info = client.job(job_id)
        except SlurmError as exc:  # the controller may be busy with the requeue: try again
            log.warning("scontrol show job %s: %s", job_id, exc)
            info = None
        if info is not None and info.state == "PENDING":
            # slurmd refuses a batch launch whose credential dates from the same second as the
            # revocation of the previous attempt's ("Killing non-startable batch job: Job
            # credential revoked", then the job ends FAILED: seen on the local cluster, released
            # 0.25 s after the requeue onto the same node). Slurm's own requeue delay avoids
            # it; releasing at once must let the second turn over first (at most 2 s).
            sleep(max(math.floor(wall()) + 2 - wall(), 0.0))
            try:
                if exclude:
                    now_excluded = client.update_exclude(job_id, exclude)
                    print(f"job {job_id}: ExcNodeList={','.join(now_excluded)}", flush=True)
            finally:  # never leave the job held: without the exclusion it still runs
                if info.reason in HELD_REASONS:
                    client.release(job_id)
                client.release_now(job_id)
            print(f"released job {job_id} (StartTime=now)", flush=True)
            return True
        sleep(min(wait, max(deadline - clock(), 0.0)))
        wait = min(wait * 2, POLL_MAX_S)
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
        print("usage: python -m slurmkit.supervise.exits.requeue release JOB_ID LOG [EXCLUDE_NODE...]",
              file=sys.stderr)
        return 2
    _detach(argv[2])
    client = slurm_client(os.environ)  # the helper's own entry point
    return 0 if release_when_pending(client, argv[1], argv[3:]) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
