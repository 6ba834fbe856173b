"""A job's node agents as local processes: submitit's local executor (``cluster.kind=local``).

Here, beside the entry point it starts (slurmkit.launch.entry), rather than in the submit verb
(slurmkit.cli.submit): a sweep's local runner (``python -m slurmkit.sweep.local``, a process of
its own) starts every variant with it, and the library never imports slurmkit.cli, which imports
the sweep package. slurmkit.cli.submit re-exports all three names.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

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


#: What submitit's local controller itself prints (nothing, unless it fails), in the run's
#: submitit folder beside the agents' logs.
CONTROLLER_LOG = "local_controller.log"


def controller_env(env: Mapping[str, str], command: str, parameters: Mapping[str, Any]) -> dict[str, str]:
    """The environment of submitit's local job controller (``python -m submitit.local._local``),
    which reads its job from these names, as submitit's own ``start_controller`` sets them."""
    gpus = int(parameters.get("gpus_per_node", 0))
    visible = parameters.get("visible_gpus", ())
    devices = range(gpus) if visible == () else list(visible)[:gpus]
    return {**env,
            "SUBMITIT_LOCAL_NTASKS": str(parameters.get("tasks_per_node", 1)),
            "SUBMITIT_LOCAL_COMMAND": command,
            "SUBMITIT_LOCAL_TIMEOUT_S": str(int(60 * float(parameters.get("timeout_min", 2.0)))),
            "SUBMITIT_LOCAL_SIGNAL_DELAY_S": str(int(parameters.get("signal_delay_s", 30))),
            "SUBMITIT_LOCAL_NODEID": "0", "SUBMITIT_LOCAL_JOB_NUM_NODES": "1",
            "SUBMITIT_STDERR_TO_STDOUT": "1" if parameters.get("stderr_to_stdout") else "",
            "SUBMITIT_EXECUTOR": "local", "CUDA_VISIBLE_DEVICES": ",".join(str(d) for d in devices),
            "SUBMITIT_LOCAL_WITH_SHELL": ""}


def default_sigint() -> None:
    """In the controller before it starts: SIGINT back to its default. A command started in
    the background of a script (or under nohup) has SIGINT ignored, which a child inherits and
    Python then keeps: such a controller ignored the SIGINT of ``slurmkit cancel`` for good."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _executor_class() -> type:
    import submitit
    from submitit.local.local import LocalJob

    class SessionLocalExecutor(submitit.LocalExecutor):  # type: ignore[misc]
        """submitit's local executor whose job controller starts in a session of its own.

        submitit starts the controller in the caller's process group, so the Ctrl-C that a
        terminal sends to its foreground group reached the controller too, which then killed
        every agent: a user stopping ``submit.wait=true`` killed the job, with no ``end``
        record. In its own session (as sbatch's job is, away from the terminal) the job keeps
        running when the command that started it is interrupted or its terminal closes;
        ``slurmkit cancel`` ends it as before (SIGINT to the controller)."""

        def _submit_command(self, command: str) -> Any:
            # Nothing of the terminal's either: a controller holding the caller's stdout kept a
            # reader of it waiting for an end of file until the job ended.
            with open(os.path.join(str(self.folder), CONTROLLER_LOG), "ab") as out:
                proc = subprocess.Popen([sys.executable, "-m", "submitit.local._local", str(self.folder)],
                                        env=controller_env(os.environ, command, self.parameters),
                                        stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                        start_new_session=True, preexec_fn=default_sigint)
            return LocalJob(folder=self.folder, job_id=str(proc.pid), process=proc,
                            tasks=list(range(int(self.parameters.get("tasks_per_node", 1)))))

    return SessionLocalExecutor


def submit_local(spec: JobSpec) -> Submitted:
    from slurmkit.launch.entry import submitit_entry

    ex = _executor_class()(folder=make_submitit_dir(spec.run_dir))  # 0700 first (rundir.py)
    minutes = (spec.time_limit_s or 7 * 24 * 3600) / 60
    ex.update_parameters(tasks_per_node=spec.nodes, timeout_min=minutes,
                         signal_delay_s=spec.signal_lead_s, stderr_to_stdout=True,
                         **local_gpu_parameters(spec.gpus_per_node, os.environ))
    job = ex.submit(submitit_entry, spec.run_dir)
    job._cancel_at_deletion = False  # the job outlives this command, as a Slurm job would
    seal_pickles(spec.run_dir)
    return Submitted(str(job.job_id), spec.run_dir, "local", job)
