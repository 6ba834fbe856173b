"""Requeue by handing the run to a successor job: the way out that stays inside the job.

A requeue that excludes nodes used to be ``scontrol requeuehold`` plus a helper, double-forked
out of the job, that set ExcNodeList on the pending job and released it. A site that tracks
processes in cgroups (``ProctrackType=proctrack/cgroup``, nearly every production site) kills that
helper with the job, and the job then stays held for good; and a process that tries to outlive
its job is what such a site forbids. So the job that must leave its nodes behind submits its own
successor instead, from node 0's agent, while it still runs:

1. ``scontrol update JobId=<this> Requeue=0``: Slurm will not requeue this job on its own any
   more (a NODE_FAIL of the lost node would otherwise bring it back next to its successor).
   Best effort: refused, the successor still waits for this job to end, and its agent finds a
   requeued predecessor in the ledger.
2. ``sbatch --hold --dependency=afterany:<this>[,singleton] --exclude=<every excluded node>`` of
   the very batch script this job runs (``submitit/<this>_submission.sh``, or ``job.sbatch``):
   same run directory, same frozen config (its hash is in the script), same resources.
   ``SLURMKIT_PREDECESSOR=<this>`` goes in its environment. Held, it cannot start before
   step 3; waiting on ``afterany``, never while this job still holds nodes.
3. For submitit's script, ``<this>_submitted.pkl`` is copied to ``<new>_submitted.pkl`` (the
   function the script runs, looked up by job id) and the script to ``<new>_submission.sh`` (the
   successor's own, for its own handover), each written whole before it is renamed.
4. A ``successor`` ledger event names the new job; ``scontrol release <new>``.

This job then ends with node 0's code 0 (COMPLETED in sacct; the ledger says it handed over).
``slurmkit status``, ``cancel``, ``submit.wait`` and the report follow the ledger to the newest
job. Any step that fails cancels a successor already submitted (nothing half-way) and raises
:class:`SuccessorUnavailable`; the caller falls back to the in-place requeue and says so.

Cost: four Slurm RPCs per requeue (update, sbatch, release, one ``scontrol show job`` for the
current exclusions), independent of the job size; two files copied on the run directory.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping

from slurmkit.atomic import atomic_write
from slurmkit.errors import SubmissionError
from slurmkit.ledger.names import SUCCESSOR
from slurmkit.runfiles import SCRIPT_NAME, SUBMITIT_DIR
from slurmkit.slurm.client import SlurmClient, slurm_client
from slurmkit.slurm.errors import SlurmError
from slurmkit.slurm.hostlist import compress_hostlist, expand_hostlist
from slurmkit.supervise.exits.requeue import last_line

log = logging.getLogger(__name__)

#: Names the job a successor took over from (set in the successor's environment by sbatch).
PREDECESSOR_ENV = "SLURMKIT_PREDECESSOR"
#: ``<job>-<restart count>``: the predecessor's attempt, whose done marker the successor reads.
PREDECESSOR_ATTEMPT_ENV = "SLURMKIT_PREDECESSOR_ATTEMPT"
#: Variables of this job's own steps that must not leak into the successor's environment (sbatch
#: exports its caller's environment): Slurm sets its own for the new job, but not every one of
#: them (SLURM_RESTART_COUNT is absent in a job never requeued), and a stale one would tell the
#: successor's agents they are another job's steps.
_JOB_PREFIXES = ("SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "SUBMITIT_", "PMI_", "PMIX_", "OMPI_")
_KEEP = frozenset({"SLURM_CONF"})  # where the cluster's slurm.conf is: the successor needs it too
_STEP_VARS = frozenset({
    "CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "GPU_DEVICE_ORDINAL", "SLURMKIT_NODE_RANK",
    "SLURMKIT_NODES", "SLURMKIT_STEPS_ENDED", "SLURMKIT_GROUP_LOG_DIR", "SLURMKIT_CONFIG_SHA256",
    "SLURMKIT_RUN_DIR", "SLURMKIT_CONFIG", PREDECESSOR_ENV, PREDECESSOR_ATTEMPT_ENV,
})
_JOB_ID = re.compile(r"^[0-9]+$")


class SuccessorUnavailable(Exception):
    """This job cannot hand over to a successor job; the message says why (one line)."""


def successor_env(env: Mapping[str, str]) -> dict[str, str]:
    """The environment sbatch runs with: this agent's, without this job's and step's own."""
    return {k: v for k, v in env.items()
            if k in _KEEP or not (k.startswith(_JOB_PREFIXES) or k in _STEP_VARS)}


def batch_script(run_dir: str, job_id: str) -> tuple[str, str | None]:
    """The batch script this job runs, and submitit's pickle of it (None for plain sbatch)."""
    sub = os.path.join(run_dir, SUBMITIT_DIR)
    script = os.path.join(sub, f"{job_id}_submission.sh")
    pickled = os.path.join(sub, f"{job_id}_submitted.pkl")
    if os.path.isfile(script) and os.path.isfile(pickled):
        return script, pickled
    standalone = os.path.join(run_dir, SCRIPT_NAME)  # plain sbatch (submit.emit=sbatch)
    if os.path.isfile(standalone):
        return standalone, None
    raise SuccessorUnavailable(f"no batch script of job {job_id} in {run_dir} (looked for {script} and "
                               f"{standalone})")


def _dependency(script: str, job_id: str) -> str:
    """afterany on this job, and the script's own singleton where it asks for one."""
    with open(script, encoding="utf-8", errors="replace") as f:
        head = f.read(65536)
    singleton = re.search(r"^#SBATCH\s+--dependency=\S*singleton", head, re.MULTILINE) is not None
    return f"afterany:{job_id}" + (",singleton" if singleton else "")


def _copy_whole(src: str, dst: str) -> None:
    with open(src, "rb") as fi:
        data = fi.read()
    # 0600 whatever the umask: the copy is submitit's pickle, which the next allocation loads
    atomic_write(dst, data, mode=0o600)


def submit_successor(client: SlurmClient, job_id: str, exclude: tuple[str, ...] | list[str], *,
                     env: Mapping[str, str], run_dir: str, sbatch: SlurmClient | None = None,
                     attempt: str = "") -> str:
    """Submit (held), prepare and release the job that takes this run over; its id.

    ``client`` makes the queries and updates; ``sbatch`` (default: a client whose environment
    is :func:`successor_env` of ``env``) submits. Raises SuccessorUnavailable, with no successor
    left behind, when any step fails. ``attempt`` (``<job>-<restart count>``) goes to the
    successor, which reports how that attempt ended (supervise/exits/previous.py).
    """
    if env.get("SLURM_ARRAY_TASK_ID"):
        raise SuccessorUnavailable("a sweep's array task is requeued in place (its script is the array's)")
    if not _JOB_ID.match(job_id):
        raise SuccessorUnavailable(f"job id {job_id!r} is not a plain job id")
    script, pickled = batch_script(run_dir, job_id)
    try:
        info = client.job(job_id)
        excluded = sorted({*info.excluded_nodes, *(n for x in exclude for n in expand_hostlist(x))})
    except SlurmError as exc:
        raise SuccessorUnavailable(f"scontrol show job {job_id}: {last_line(exc)}") from exc
    try:
        client.update_job(job_id, Requeue="0")
    except SlurmError as exc:  # the successor still waits for this job to end
        log.warning("could not stop Slurm from requeueing job %s itself: %s", job_id, last_line(exc))
    args = ["--hold", f"--dependency={_dependency(script, job_id)}"]
    if excluded:
        args.append(f"--exclude={compress_hostlist(excluded)}")
    submitter = sbatch or slurm_client(successor_env(env))
    try:
        handed = {PREDECESSOR_ENV: job_id,
                  **({PREDECESSOR_ATTEMPT_ENV: attempt} if attempt.startswith(f"{job_id}-") else {})}
        new = submitter.submit(script, extra_args=args, env=handed)
    except (SlurmError, SubmissionError) as exc:
        raise SuccessorUnavailable(f"sbatch refused the successor: {last_line(exc)}") from exc
    # submitit's files of the new job: the pickle its script looks up by job id, and the script
    # under the new id too, so that the successor can hand over again (batch_script() of its
    # own id; without it a second requeue fell back to the in-place one and Slurm's 121 s hold)
    copies: list[tuple[str, str]] = []
    if pickled is not None:
        sub = os.path.dirname(pickled)
        copies = [(pickled, os.path.join(sub, f"{new}_submitted.pkl")),
                  (script, os.path.join(sub, f"{new}_submission.sh"))]
    try:
        for src, dst in copies:
            _copy_whole(src, dst)
        client.release(new)
    except (OSError, SlurmError) as exc:
        try:
            client.cancel(new)
        except SlurmError as again:
            log.error("could not cancel the half-made successor job %s: %s", new, again)
        for _src, dst in copies:
            if os.path.exists(dst):
                os.unlink(dst)
        raise SuccessorUnavailable(f"successor job {new} could not be prepared: {last_line(exc)}") from exc
    log.warning("job %s hands the run over to job %s (excluding %s)", job_id, new,
                ",".join(excluded) or "nothing")
    return new


def successor_chain(run_dir: str, job_id: str) -> list[str]:
    """``job_id`` and every job the run went on in after it, oldest first, from the ledger's
    ``successor`` events (one read of the ledger). Read once a job has ended (``submit.wait``,
    test helpers, benches), never per poll; a ledger line that does not parse is skipped by the
    reader, a job id that is not one is never followed, and a loop ends the chain."""
    from slurmkit.ledger.ledger import LEDGER_NAME, read_ledger

    after: dict[str, str] = {}
    for e in read_ledger(os.path.join(run_dir, LEDGER_NAME)):
        if e.get("event") == SUCCESSOR and _JOB_ID.match(str(e.get("job_id", ""))):
            after[str(e.get("predecessor"))] = str(e["job_id"])  # the newest handover of a job counts
    jobs = [job_id]
    while (nxt := after.get(jobs[-1])) is not None and nxt not in jobs:
        jobs.append(nxt)
    return jobs


def successor_of(run_dir: str, job_id: str) -> str | None:
    """The job that took the run over from ``job_id``, or None."""
    chain = successor_chain(run_dir, job_id)
    return chain[1] if len(chain) > 1 else None


__all__ = ["PREDECESSOR_ATTEMPT_ENV", "PREDECESSOR_ENV", "SuccessorUnavailable", "batch_script", "submit_successor", "successor_chain", "successor_of",
           "successor_env"]
