"""A job's node agents as local processes: submitit's local executor (``cluster.kind=local``).

Here, beside the entry point it starts (slurmkit.launch.entry), rather than in the submit verb
(slurmkit.cli.submit): a sweep's local runner (``python -m slurmkit.sweep.local``, a process of
its own) starts every variant with it, and the library never imports slurmkit.cli, which imports
the sweep package. slurmkit.cli.submit re-exports all three names.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from slurmkit.rundir import make_submitit_dir, seal_pickles

if TYPE_CHECKING:
    from slurmkit.render import JobSpec


@dataclasses.dataclass
class Submitted:
    job_id: str
    run_dir: str
    executor: str
    job: object  # the submitit job


def local_gpu_parameters(gpus_per_node: int, env: Mapping[str, str]) -> dict[str, object]:
    """submitit's local executor sets CUDA_VISIBLE_DEVICES for the agents it starts: empty
    unless it is told the GPUs, which hid every GPU from a local GPU job (its ranks then
    computed on the CPU). Each emulated node gets this machine's first ``gpus_per_node`` GPUs,
    counted among the ones the caller's own CUDA_VISIBLE_DEVICES names, when that is a list
    of indices."""
    if gpus_per_node <= 0:
        return {}
    named = [item.strip() for item in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if item.strip()]
    if named and all(item.isdigit() for item in named):
        return {"gpus_per_node": min(gpus_per_node, len(named)), "visible_gpus": [int(i) for i in named]}
    return {"gpus_per_node": gpus_per_node}


def submit_local(spec: JobSpec) -> Submitted:
    import submitit

    from slurmkit.launch.entry import submitit_entry

    ex = submitit.LocalExecutor(folder=make_submitit_dir(spec.run_dir))  # 0700 first (rundir.py)
    minutes = (spec.time_limit_s or 7 * 24 * 3600) / 60
    ex.update_parameters(tasks_per_node=spec.nodes, timeout_min=minutes,
                         signal_delay_s=spec.signal_lead_s, stderr_to_stdout=True,
                         **local_gpu_parameters(spec.gpus_per_node, os.environ))
    job = ex.submit(submitit_entry, spec.run_dir)
    job._cancel_at_deletion = False  # the job outlives this command, as a Slurm job would
    seal_pickles(spec.run_dir)
    return Submitted(str(job.job_id), spec.run_dir, "local", job)
