"""Where this node agent is: node rank, node count, job id, read once from the environment."""

from __future__ import annotations

import socket
from collections.abc import Mapping
from dataclasses import dataclass

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

    @property
    def attempt(self) -> str:
        """Identifies one run of the job: a requeued job is a new attempt."""
        return f"{self.job_id}-{self.restart_count}"


def node_context(env: Mapping[str, str]) -> NodeContext:
    """Build the context from Slurm's task environment, or from submitit's local executor."""
    if "SLURM_NODEID" in env and "SLURM_JOB_ID" in env:
        # One srun step per node (sbatch_templates/launch_agents.sh.j2) says where it is itself:
        # inside a one-node step SLURM_NODEID is always 0.
        if env.get("SLURMKIT_NODES") and env.get("SLURMKIT_NODE_RANK"):
            nodes = tuple(env["SLURMKIT_NODES"].split(","))
            node_rank, num_nodes = int(env["SLURMKIT_NODE_RANK"]), len(nodes)
        else:
            nodes = tuple(expand_hostlist(env.get("SLURM_JOB_NODELIST", env.get("SLURMD_NODENAME", ""))))
            node_rank, num_nodes = int(env["SLURM_NODEID"]), int(env.get("SLURM_NNODES", len(nodes) or 1))
        name = env.get("SLURMD_NODENAME") or socket.gethostname()
        # srun launches from the batch host (node 0); its address is given to every task.
        addr = env.get("SLURM_LAUNCH_NODE_IPADDR") or (nodes[0] if nodes else "127.0.0.1")
        return NodeContext(
            node_rank=node_rank, num_nodes=num_nodes,
            node_name=name, nodes=nodes or (name,), job_id=env["SLURM_JOB_ID"],
            restart_count=int(env.get("SLURM_RESTART_COUNT", "0") or 0), master_addr=addr,
            executor="slurm")
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
