"""Where this node agent is: node rank, node count, job id (and array task), read once from the
environment; and which run directory a job array's task works in."""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from slurmkit.contract import GROUP_LOG_ENV  # defined there: node 0's relauncher sets it too
from slurmkit.errors import SlurmkitError
from slurmkit.slurm.hostlist import expand_hostlist


@dataclass(frozen=True)
class NodeContext:
    node_rank: int
    num_nodes: int
    node_name: str
    nodes: tuple[str, ...]  # every node of the allocation, in node-rank order
    job_id: str
    restart_count: int  # Slurm's requeue count (0 on the first run)
    master_addr: str  # where node 0's agent can be reached
    executor: str  # "slurm" or "local"
    array_job_id: str | None = None  # a sweep's task: the array's job id and this task's index
    array_task_id: int | None = None

    @property
    def job_ref(self) -> str:
        """How scontrol addresses this job. An array task must be named ``ARRAY_TASK``: one task's
        own SLURM_JOB_ID equals the array's id, and scontrol acts on every task for that id."""
        if self.array_job_id is not None and self.array_task_id is not None:
            return f"{self.array_job_id}_{self.array_task_id}"
        return self.job_id

    @property
    def attempt(self) -> str:
        """Identifies one run of the job: a requeued job is a new attempt."""
        return f"{self.job_id}-{self.restart_count}"


def node_context(env: Mapping[str, str]) -> NodeContext:
    """Build the context from Slurm's task environment, or from submitit's local executor."""
    if "SLURM_NODEID" in env and "SLURM_JOB_ID" in env:
        name = env.get("SLURMD_NODENAME") or socket.gethostname()
        # The agents' srun steps (sbatch_templates/launch_agents.sh.j2) say where each agent is:
        # a step of one node names its node rank (inside it SLURM_NODEID is always 0); in a step
        # of several, SLURM_NODEID counts the step's nodes, so the agent finds its own node in
        # the job's list.
        if env.get("SLURMKIT_NODES") and env.get("SLURMKIT_NODE_RANK"):
            nodes = tuple(env["SLURMKIT_NODES"].split(","))
            node_rank, num_nodes = int(env["SLURMKIT_NODE_RANK"]), len(nodes)
        elif env.get("SLURMKIT_NODES") and env.get(GROUP_LOG_ENV):
            nodes = tuple(env["SLURMKIT_NODES"].split(","))
            node_rank, num_nodes = _rank_in(nodes, name), len(nodes)
        else:
            nodes = tuple(expand_hostlist(env.get("SLURM_JOB_NODELIST", env.get("SLURMD_NODENAME", ""))))
            node_rank, num_nodes = int(env["SLURM_NODEID"]), int(env.get("SLURM_NNODES", len(nodes) or 1))
        # srun launches from the batch host (node 0); its address is given to every task.
        addr = env.get("SLURM_LAUNCH_NODE_IPADDR") or (nodes[0] if nodes else "127.0.0.1")
        return NodeContext(
            node_rank=node_rank, num_nodes=num_nodes,
            node_name=name, nodes=nodes or (name,), job_id=env["SLURM_JOB_ID"],
            restart_count=int(env.get("SLURM_RESTART_COUNT", "0") or 0), master_addr=addr,
            executor="slurm", array_job_id=env.get("SLURM_ARRAY_JOB_ID") or None,
            array_task_id=_task_id(env))
    if "SUBMITIT_LOCAL_GLOBALID" in env:
        n = int(env.get("SUBMITIT_LOCAL_NTASKS", "1"))
        rank = int(env["SUBMITIT_LOCAL_GLOBALID"])
        nodes = tuple(f"local{i}" for i in range(n))
        return NodeContext(node_rank=rank, num_nodes=n, node_name=nodes[rank], nodes=nodes,
                           job_id=env.get("SUBMITIT_LOCAL_JOB_ID", "local"), restart_count=0,
                           master_addr="127.0.0.1", executor="local")
    raise SlurmkitError(
        "Detected: neither Slurm's task environment (SLURM_NODEID) nor submitit's local one. "
        "Requirement: the node agent runs inside a job. Fix: start it with `python -m slurmkit.submit`.")


def _rank_in(nodes: tuple[str, ...], name: str) -> int:
    """This node's rank in a step of several nodes: its place in the job's node list (never 0:
    node 0's agent has a step of its own)."""
    if name not in nodes or nodes.index(name) == 0:
        raise SlurmkitError(
            f"Detected: an agent in a step of several nodes on {name!r}, which is "
            f"{'node 0' if name in nodes else 'not in SLURMKIT_NODES'} ({len(nodes)} nodes). Requirement: the "
            "batch script's steps (sbatch_templates/launch_agents.sh.j2) name nodes of the job's list, node 0 in "
            "a step of its own. Fix: submit with `python -m slurmkit.submit`; do not start agents by hand.")
    return nodes.index(name)


def group_log(env: Mapping[str, str], node_rank: int) -> str | None:
    """Where an agent of a step of several nodes writes its output: the file a step of one
    node would have (``<log dir>/<job id>_node<rank>_log.out``, which ``slurmkit logs`` and
    the relauncher look for); None in a step of one node (srun's --output names it)."""
    log_dir = env.get(GROUP_LOG_ENV)
    if not log_dir or env.get("SLURMKIT_NODE_RANK"):
        return None
    return os.path.join(log_dir, f"{env.get('SLURM_JOB_ID', 'job')}_node{node_rank}_log.out")


def redirect_output(path: str) -> None:
    """Point this process's stdout and stderr (and its children's) at ``path``, appended to
    and never through a link planted in the run directory."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o640)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    finally:
        os.close(fd)


def _task_id(env: Mapping[str, str]) -> int | None:
    text = env.get("SLURM_ARRAY_TASK_ID", "")
    if not text:
        return None
    if not text.isdigit():
        raise SlurmkitError(f"Detected: SLURM_ARRAY_TASK_ID={text!r}. Requirement: a task index set "
                            "by Slurm. Fix: do not set SLURM_ARRAY_TASK_ID by hand.")
    return int(text)


def task_run_dir(path: str, env: Mapping[str, str]) -> str:
    """The run directory this agent works in.

    A sweep's job array starts every task with the sweep directory; task i runs variant i, whose
    directory sweep.json names (checked: it must be ``<sweep_dir>/<i>``). Any other path is a
    run directory already.
    """
    from slurmkit.sweepdir import is_sweep_dir, load_sweep

    if not is_sweep_dir(path):
        return path
    task = _task_id(env)
    if task is None:
        raise SlurmkitError(
            f"Detected: {path} is a sweep directory but SLURM_ARRAY_TASK_ID is not set. Requirement: "
            "a sweep runs as a job array, one task per variant. Fix: submit it with "
            "`python -m slurmkit.submit -m ...`, or start the agent with one variant's run directory.")
    variants = load_sweep(path).variants
    if task >= len(variants):
        raise SlurmkitError(
            f"Detected: array task {task} of a sweep with {len(variants)} variants ({path}). "
            "Requirement: one task per variant (--array=0-N-1). Fix: resubmit the sweep.")
    return variants[task].run_dir
