"""JobSpec -> submitit SlurmExecutor parameters, the script submitit will submit, and a
standalone sbatch script. Pure functions over a JobSpec; golden files pin the output."""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Mapping
from typing import Any

import jinja2
import submitit
from submitit.slurm.slurm import SlurmExecutor

from slurmkit.errors import ConfigError
from slurmkit.render.jobspec import JobSpec, exclude_expr
from slurmkit.render.values import check_printable
from slurmkit.resources import packaged
from slurmkit.rundir import shell_check
from slurmkit.runfiles import CONFIG_NAME, LOGS_DIR, SUBMITIT_DIR

TEMPLATE_DIR = str(packaged("sbatch_templates"))  # shipped as package data (slurmkit/resources.py)
AGENT_MODULE = "slurmkit.launch"


def _env(template_dir: str | None = None) -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(template_dir or TEMPLATE_DIR),
        autoescape=False,  # shell, not HTML: quoting is done explicitly with the `q` filter
        trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True,
        undefined=jinja2.StrictUndefined,
    )
    env.filters["q"] = lambda v: shlex.quote(str(v))
    env.globals["trust_check"] = shell_check()  # setup.sh.j2, in both script kinds
    # the run directory's names (slurmkit.runfiles), as the templates join them
    env.globals["CONFIG_NAME"] = CONFIG_NAME
    env.globals["LOGS_DIR"] = LOGS_DIR
    return env


def _mem(mem_gb: float) -> str:
    return f"{int(mem_gb)}G" if mem_gb == int(mem_gb) else f"{int(mem_gb * 1024)}M"


def script_lines(text: str) -> list[str]:
    """``text`` cut at "\n" only. ``str.splitlines()`` also cuts at U+2028, U+0085, \\x0b, ...,
    and joining its pieces with "\n" would turn such a character inside a value into a line
    break of the script (the values are refused before, slurmkit.render.values; this keeps
    the renderer from making one)."""
    return (text[:-1] if text.endswith("\n") else text).split("\n")


def setup_lines(spec: JobSpec) -> list[str]:
    text = _env().get_template("setup.sh.j2").render(spec=spec)
    return [ln for ln in script_lines(text) if ln.strip(" \t")]


# pyxis: a named container is imported once per node and job and reused by the job's later
# steps (the agents' relaunch steps, the steps of several nodes), where an unnamed one is
# imported by every step. The name carries the attempt, so a requeued job never picks up the
# container an earlier allocation left on a node (pyxis removes them at the job's end, unless
# the site keeps them). The batch script expands it; node 0's relaunches compute the same.
CONTAINER_NAME_SHELL = "slurmkit_${SLURM_JOB_ID}_${SLURM_RESTART_COUNT:-0}"


def container_name(env: Mapping[str, str]) -> str:
    """``CONTAINER_NAME_SHELL`` as the batch script expands it in ``env``."""
    job, restart = env.get("SLURM_JOB_ID", ""), env.get("SLURM_RESTART_COUNT") or "0"
    if not (job.isdigit() and restart.isdigit()):
        raise ValueError(f"SLURM_JOB_ID={job!r} / SLURM_RESTART_COUNT={restart!r}: not a job's numbers")
    return f"slurmkit_{job}_{restart}"


def container_mounts(spec: JobSpec) -> list[str]:
    """cluster.container_mounts, and the run directory at its own path unless a mount already
    brings it: the agents and ranks inside the container write their logs, heartbeat ledger and
    checkpoints there."""
    if any(c in spec.run_dir for c in ",:"):
        raise ConfigError(f"run directory {spec.run_dir!r} for a container job (cluster.container_image)",
                          "a path without ',' or ':' (pyxis splits --container-mounts on them)",
                          "set submit.run_root to a path without ',' and ':'")
    mounts = list(spec.container_mounts)
    sources = [m.split(":", 1)[0].rstrip("/") for m in mounts]
    if not any(spec.run_dir == src or spec.run_dir.startswith(src + "/") for src in sources if src):
        mounts.append(f"{spec.run_dir}:{spec.run_dir}")
    return mounts


def srun_args(spec: JobSpec) -> list[str]:
    """Arguments of the srun that starts one node agent per node (the container's name is added
    where the step is started: it depends on the attempt)."""
    args = ["--kill-on-bad-exit=0", *spec.srun_args]
    if spec.no_kill:
        args.append("--no-kill")  # the step survives a lost node; the agents continue on a spare
    if spec.container_image:
        args.append(f"--container-image={spec.container_image}")
        args.append(f"--container-mounts={','.join(container_mounts(spec))}")
    return args


def executor_parameters(spec: JobSpec) -> dict[str, Any]:
    """Parameters for submitit's SlurmExecutor.update_parameters (names as submitit spells them)."""
    extra: dict[str, Any] = {"time": spec.time_limit, "signal": f"B:USR1@{spec.signal_lead_s}"}
    if spec.requeue:
        extra["requeue"] = "expedite" if spec.requeue_expedite else True
    else:
        extra["no-requeue"] = True
    if spec.no_kill:
        extra["no-kill"] = True
    params: dict[str, Any] = {
        "job_name": spec.name, "nodes": spec.nodes, "ntasks_per_node": 1,
        "stderr_to_stdout": True, "setup": setup_lines(spec), "srun_args": srun_args(spec),
        # None drops submitit's default --wckey=submitit: a wckey is the site's choice (cluster.wckey).
        "wckey": spec.wckey, "additional_parameters": extra,
    }
    if spec.gpus_per_node:
        params["gpus_per_node"] = f"{spec.gpu_type}:{spec.gpus_per_node}" if spec.gpu_type else spec.gpus_per_node
    if spec.cpus_per_task:
        params["cpus_per_task"] = spec.cpus_per_task
    if spec.mem_gb is not None:
        extra["mem"] = _mem(spec.mem_gb)
    if spec.exclusive:
        params["exclusive"] = True
    if spec.singleton:
        params["dependency"] = "singleton"
    expr = exclude_expr(spec)
    if expr:
        params["exclude"] = expr
    for key in ("partition", "account", "qos", "constraint"):
        if getattr(spec, key):
            params[key] = getattr(spec, key)
    for key in ("reservation", "switches", "segment"):  # not submitit parameters: passed as given
        if getattr(spec, key):
            extra[key] = getattr(spec, key)
    return params


def launch_agents(log_dir: str | None, args: list[str], command: str, group: int = 1, train: int = 0,
                  container: bool = False) -> str:
    """Shell lines that start one agent per node: node 0's in an srun step of its own, the
    others in steps of ``group`` nodes (launch.nodes_per_step, resolved), no step holding both
    one of the first ``train`` nodes (the train nodes) and a spare.

    ``log_dir`` None: the agents log into "$SLURMKIT_RUN_DIR/logs", which the batch script sets
    per array task (sbatch_templates/setup.sh.j2).
    """
    if type(group) is not int or group < 1:
        raise ValueError(f"nodes per step must be an int >= 1, not {group!r}")
    prefix = shlex.join(["srun", "--unbuffered", *args])
    if container:  # expanded by the batch script: the attempt is known only there
        prefix += f' --container-name="{CONTAINER_NAME_SHELL}"'
    return _env().get_template("launch_agents.sh.j2").render(
        log_dir=log_dir, srun_prefix=prefix, command=command, group=group, train=train).rstrip("\n")


class SlurmkitExecutor(SlurmExecutor):
    """submitit's SlurmExecutor whose script starts the agents in srun steps of
    ``nodes_per_step`` nodes, node 0's alone (see sbatch_templates/launch_agents.sh.j2),
    instead of one step over all nodes."""

    nodes_per_step = 1
    train_nodes = 0
    container = False  # pyxis: name the agents' container per attempt (CONTAINER_NAME_SHELL)

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        lines = script_lines(super()._make_submission_file_text(command, uid))
        idx = [i for i, ln in enumerate(lines) if ln.startswith("srun ")]
        if len(idx) != 1:
            raise RuntimeError(f"expected one srun line in submitit's script, found {len(idx)}")
        lines[idx[0]] = launch_agents(str(self.folder), list(self.parameters.get("srun_args", [])), command,
                                      self.nodes_per_step, self.train_nodes, self.container)
        return "\n".join(lines) + "\n"


class _RenderingExecutor(SlurmkitExecutor):
    """Only renders the script (a dry run): needs no srun on this machine (a laptop)."""

    @classmethod
    def affinity(cls) -> int:
        return 1


def make_executor(spec: JobSpec, python: str | None = None, *, render_only: bool = False) -> SlurmkitExecutor:
    # Again here: a sweep places its JobSpec in the sweep directory after build_jobspec checked it.
    check_printable(spec, [("the Python interpreter", python)])
    kind = _RenderingExecutor if render_only else SlurmkitExecutor
    ex = kind(folder=os.path.join(spec.run_dir, SUBMITIT_DIR), python=python)
    ex.update_parameters(**executor_parameters(spec))
    ex.nodes_per_step, ex.train_nodes = spec.nodes_per_step, spec.train_nodes
    ex.container = bool(spec.container_image)
    return ex


def render_submitit_script(spec: JobSpec, python: str | None = None) -> str:
    """The exact script ``make_executor(spec).submit(...)`` hands to sbatch."""
    ex = make_executor(spec, python=python, render_only=True)
    return ex._make_submission_file_text(ex._submitit_command_str, "dryrun")


def render_standalone(spec: JobSpec, script_path: str, python: str | None = None) -> str:
    """A self-contained sbatch script (no submitit pickles) for centers that use plain sbatch.

    Also the script of a sweep's job array (``spec.array``): every task starts its agents with
    the sweep directory, and each agent picks its variant by SLURM_ARRAY_TASK_ID
    (slurmkit/launch/context.py: task_run_dir).
    """
    py = python or sys.executable
    check_printable(spec, [("the Python interpreter", py), ("the script path", script_path)])
    log_dir = None if spec.array else os.path.join(spec.run_dir, LOGS_DIR)
    launch = launch_agents(log_dir, srun_args(spec),
                           shlex.join([py, "-u", "-m", AGENT_MODULE, spec.run_dir]), spec.nodes_per_step,
                           spec.train_nodes, bool(spec.container_image))
    return _env().get_template("standalone.sbatch.j2").render(
        spec=spec, script_path=script_path, mem=_mem(spec.mem_gb) if spec.mem_gb is not None else "",
        exclude=exclude_expr(spec) or "", launch=launch)


__all__ = ["CONTAINER_NAME_SHELL", "container_mounts", "container_name", "executor_parameters", "make_executor", "render_standalone", "render_submitit_script",
           "setup_lines", "srun_args", "submitit"]
