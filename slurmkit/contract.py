"""The contract between the node agent, the ranks it starts, and Slurm: exit codes, the rank
environment, and which device a rank computes on.

One module so that the two sides cannot drift: the agent writes these variables and reads
these exit codes; the trainer (or any user trainer under the agent) reads the variables and
returns the codes. Nothing here imports torch: the agent, the CLI and the ranks all use it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from slurmkit.errors import ConfigError
from slurmkit.runfiles import MARKER_DIR, MARKER_NAME

# ---------------------------------------------------------------------------- exit codes
EXIT_OK = 0
EXIT_FAILED = 1  # anything unexpected
EXIT_CONFIG_ERROR = 2  # the trainer refused its configuration (a restart cannot help)
# The supervisor decided not to restart; Slurm must not requeue (--requeue jobs are requeued on
# any other non-zero code by the site's RequeueExit, so this one value is reserved).
EXIT_NO_REQUEUE = 93
# "Saved, not finished": the rank wrote a final checkpoint on SIGUSR1/SIGTERM and left on purpose;
# the supervisor requeues the job (time limit) or ends it (cancel --checkpoint, preemption).
EXIT_CHECKPOINTED_ON_SIGNAL = 95
# The one line a rank prints (at the start of a line, on stderr) when it refuses its
# configuration, before it exits EXIT_CONFIG_ERROR: the supervisor's classifier knows it, so a
# configuration that cannot work stops the run at once instead of being restarted.
CONFIG_ERROR_MARKER = "slurmkit: config-error: "

# ---------------------------------------------------------------------------- checkpoint marker
# The marker's place in the run directory (its names are slurmkit.runfiles') and its size bound:
# the one definition the writer (slurmkit.userapi.report_checkpoint, which re-exports them) and
# node 0's reader (slurmkit.supervise.ckpt_progress) share.
MARKER_MAX_BYTES = 8192
#: A rank's beat may name what it does outside its steps (slurmkit.userapi.report_phase): an
#: identifier of at most MAX_PHASE characters. PHASE_SAVING stops the agent's hang clock until
#: the next beat (a save calls nothing until it is over); any other phase restarts it per beat.
PHASE_SAVING = "saving"
MAX_PHASE = 32


def marker_path(run_dir: str) -> str:
    """``RUN_DIR/progress/user_checkpoint.json``: rank 0's newest reported checkpoint."""
    return os.path.join(run_dir, MARKER_DIR, MARKER_NAME)

# ---------------------------------------------------------------------------- rank environment
# torchrun's names, so a trainer written for torchrun runs under the agent unchanged.
RANK = "RANK"
LOCAL_RANK = "LOCAL_RANK"
WORLD_SIZE = "WORLD_SIZE"
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
GROUP_RANK = "GROUP_RANK"  # the node's training slot
MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"
# slurmkit's own.
RUN_DIR = "SLURMKIT_RUN_DIR"
CONFIG = "SLURMKIT_CONFIG"  # the frozen config.yaml
CONFIG_SHA256 = "SLURMKIT_CONFIG_SHA256"  # its sha256, carried by the batch script (rundir.py)
LEDGER = "SLURMKIT_LEDGER"
GENERATION = "SLURMKIT_GENERATION"  # restarts inside one allocation count generations
NODE = "SLURMKIT_NODE"
ATTEMPT = "SLURMKIT_ATTEMPT"  # <job id>-<requeue count>
HEARTBEAT_FILE = "SLURMKIT_HEARTBEAT_FILE"
DEVICE = "SLURMKIT_DEVICE"  # "cpu" or "cuda:<index>", index among the rank's visible devices
#: The job's ``job.program`` setting as given ("auto", "lightning", "none", ...): "none" keeps
#: slurmkit's Lightning callback out of the program's Trainer (slurmkit.integrations.lightning).
PROGRAM = "SLURMKIT_PROGRAM"
#: Set on an agents' srun step of several nodes (sbatch_templates/launch_agents.sh.j2, and node 0
#: when it relaunches several agents in one step): the directory where each of its agents writes
#: its own log (slurmkit.launch.context.group_log).
GROUP_LOG_ENV = "SLURMKIT_GROUP_LOG_DIR"

# Slurm's task view (RankIdentity.slurm_env): one rank = one task of the training world.
SLURM_PROCID = "SLURM_PROCID"  # global rank
SLURM_LOCALID = "SLURM_LOCALID"  # local rank
SLURM_NODEID = "SLURM_NODEID"  # the node's training slot
SLURM_NTASKS = "SLURM_NTASKS"  # world size (and SLURM_NPROCS, its old name)
SLURM_NPROCS = "SLURM_NPROCS"
SLURM_STEP_NUM_TASKS = "SLURM_STEP_NUM_TASKS"
SLURM_NTASKS_PER_NODE = "SLURM_NTASKS_PER_NODE"  # ranks per node
SLURM_TASKS_PER_NODE = "SLURM_TASKS_PER_NODE"  # Slurm's "4(x2)" form
SLURM_STEP_TASKS_PER_NODE = "SLURM_STEP_TASKS_PER_NODE"
SLURM_NNODES = "SLURM_NNODES"  # train nodes (SLURM_JOB_NUM_NODES keeps the allocation's count)
SLURM_STEP_NUM_NODES = "SLURM_STEP_NUM_NODES"
SLURM_NODELIST = "SLURM_NODELIST"  # the rendezvous host (see RankIdentity.slurm_env)
SLURM_GTIDS = "SLURM_GTIDS"  # the global ranks on this node
SLURM_CPUS_PER_TASK = "SLURM_CPUS_PER_TASK"  # the rank's share of the agent's CPUs (rank_cpus_env)
SLURM_CPUS_ON_NODE = "SLURM_CPUS_ON_NODE"  # the job's CPUs on this node (read, never set)

CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
CUDA_DEVICE_ORDER = "CUDA_DEVICE_ORDER"


class ContractError(ConfigError):
    """A rank's environment breaks the contract (a variable missing, malformed, out of range).

    A ConfigError: a rank exits with EXIT_CONFIG_ERROR, since a restart would meet the same."""


@dataclass(frozen=True)
class RankIdentity:
    """Who a rank is in the job, as torchrun would tell it."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    group_rank: int
    master_addr: str
    master_port: int

    def env(self) -> dict[str, str]:
        return {RANK: str(self.rank), LOCAL_RANK: str(self.local_rank), WORLD_SIZE: str(self.world_size),
                LOCAL_WORLD_SIZE: str(self.local_world_size), GROUP_RANK: str(self.group_rank),
                MASTER_ADDR: self.master_addr, MASTER_PORT: str(self.master_port)}

    def slurm_env(self) -> dict[str, str]:
        """The same place in Slurm's task variables, as if srun had started every rank as a task.

        The agent runs as the single task of a one-node srun step, and its ranks inherit that
        step's view: ``SLURM_NTASKS=1``, ``SLURM_PROCID=0`` on every rank, so a program that
        asks Slurm who it is (PyTorch Lightning's SLURMEnvironment, NeMo, submitit's
        JobEnvironment) trains alone. The training world is the step these variables
        describe: its ranks, its nodes (the train slots; spares run no ranks), contiguous ranks
        per node. ``SLURM_NODELIST`` names the rendezvous host (MASTER_ADDR): Lightning takes
        its first entry as the main address and overwrites MASTER_ADDR with it, and the slot-0
        node may be a spare that replaced node 0. The job's own variables (SLURM_JOB_ID,
        SLURM_JOB_NODELIST, SLURM_JOB_NUM_NODES, ...) still describe the allocation.
        """
        nodes = self.world_size // self.local_world_size
        per_node = f"{self.local_world_size}(x{nodes})" if nodes > 1 else str(self.local_world_size)
        first = self.group_rank * self.local_world_size
        return {SLURM_PROCID: str(self.rank), SLURM_LOCALID: str(self.local_rank),
                SLURM_NODEID: str(self.group_rank), SLURM_NTASKS: str(self.world_size),
                SLURM_NPROCS: str(self.world_size), SLURM_STEP_NUM_TASKS: str(self.world_size),
                SLURM_NTASKS_PER_NODE: str(self.local_world_size), SLURM_TASKS_PER_NODE: per_node,
                SLURM_STEP_TASKS_PER_NODE: per_node, SLURM_NNODES: str(nodes),
                SLURM_STEP_NUM_NODES: str(nodes), SLURM_NODELIST: self.master_addr,
                SLURM_GTIDS: ",".join(str(first + i) for i in range(self.local_world_size))}

    def full_env(self) -> dict[str, str]:
        """torchrun's variables and Slurm's task view: what the agent gives each rank."""
        return {**self.env(), **self.slurm_env()}


def rank_identity(slot: int, local_rank: int, *, ranks_per_node: int, train_nodes: int,
                  master_addr: str, master_port: int) -> RankIdentity:
    """Global rank = slot x ranks_per_node + local rank: ranks of one node are contiguous."""
    if not 0 <= local_rank < ranks_per_node or not 0 <= slot < train_nodes:
        raise ValueError(f"local rank {local_rank} of {ranks_per_node} in slot {slot} of {train_nodes}")
    return RankIdentity(rank=slot * ranks_per_node + local_rank, local_rank=local_rank,
                        world_size=train_nodes * ranks_per_node, local_world_size=ranks_per_node,
                        group_rank=slot, master_addr=master_addr, master_port=master_port)


def rank_cpus_env(inherited: Mapping[str, str], ranks_per_node: int) -> dict[str, str]:
    """``SLURM_CPUS_PER_TASK`` for one rank: its share of the agent task's CPUs.

    The agent's one task holds the node's CPUs for all its ranks; a program that sizes its
    threads or DataLoader workers from SLURM_CPUS_PER_TASK (as Slurm's own documentation
    suggests) would otherwise take the whole node in every rank. An exclusive job submitted
    without --cpus-per-task (a site with CoreSpecCount refuses the whole node's count) has no
    SLURM_CPUS_PER_TASK: its step holds the CPUs Slurm gave the job on the node,
    SLURM_CPUS_ON_NODE. Nothing when Slurm set neither."""
    text = (inherited.get(SLURM_CPUS_PER_TASK, "").strip()
            or inherited.get(SLURM_CPUS_ON_NODE, "").strip())
    if not text.isdigit() or ranks_per_node < 1:
        return {}
    return {SLURM_CPUS_PER_TASK: str(max(1, int(text) // ranks_per_node))}


# ---------------------------------------------------------------------------- which device
def visible_count(value: str) -> int:
    """How many devices a CUDA_VISIBLE_DEVICES value names (an empty value: none)."""
    return len([d for d in value.split(",") if d.strip()])


def block_index(local_rank: int, local_world: int, devices: int) -> int:
    """The first device of ``local_rank``'s share of ``devices``, as the topology planner deals
    them in PCI order: equal blocks when there are at least as many devices as ranks, else
    neighbouring ranks share one device."""
    if devices <= 0:
        return local_rank
    per_rank = max(1, devices // local_world)
    if local_world * per_rank <= devices:
        return local_rank * per_rank
    return local_rank * devices // local_world


def choose_device(*, local_rank: int, local_world: int, gpus_per_node: int,
                  inherited: Mapping[str, str], final: Mapping[str, str],
                  planned: Sequence[int] = ()) -> str:
    """The device the rank must compute on, decided by the agent (the rank never guesses).

    ``inherited``: the environment the agent got (Slurm's, the user's); ``final``: the rank's
    environment after the pinning plan added its variables; ``planned``: the CUDA indices (PCI
    order, all of the host's GPUs) the plan gave the rank.

    - CPU ranks (the layout requests no GPU): ``cpu``, even on a host that has GPUs.
    - The agent narrowed CUDA_VISIBLE_DEVICES to the rank's own GPUs (topology.gpu_visibility=rank,
      nothing set before): the rank's GPU is the first visible one, ``cuda:0``.
    - CUDA_VISIBLE_DEVICES came from outside (Slurm sets it for a GPU job; it is never narrowed
      then): the rank's block among what is visible. Its entries may be renumbered by Slurm's
      cgroup, so they are counted, never matched against host indices.
    - Nothing restricts visibility: the planned host index when CUDA numbers devices in PCI
      order as the plan does, else the rank's block among the job's GPUs.
    """
    if gpus_per_node <= 0:
        return "cpu"
    outside = inherited.get(CUDA_VISIBLE_DEVICES)
    mine = final.get(CUDA_VISIBLE_DEVICES)
    if outside is None and mine is not None:
        if visible_count(mine) < 1:
            raise ContractError(f"{CUDA_VISIBLE_DEVICES}={mine!r} for local rank {local_rank}",
                                "at least one GPU per rank when the layout requests GPUs",
                                "set topology.gpu_visibility=all or check the node's GPUs with "
                                "`python -m slurmkit.topo plan`")
        return "cuda:0"
    if outside is not None:
        return f"cuda:{block_index(local_rank, local_world, visible_count(outside))}"
    if planned and final.get(CUDA_DEVICE_ORDER) == "PCI_BUS_ID":
        return f"cuda:{planned[0]}"
    return f"cuda:{block_index(local_rank, local_world, gpus_per_node)}"


@dataclass(frozen=True)
class DeviceChoice:
    """What a rank reads back from ``SLURMKIT_DEVICE``."""

    kind: str  # "cpu" or "cuda"
    index: int | None  # the CUDA index among the rank's visible devices


def parse_device(value: str) -> DeviceChoice:
    text = value.strip()
    if text == "cpu":
        return DeviceChoice("cpu", None)
    kind, _, index = text.partition(":")
    if kind == "cuda" and index.isdigit() and len(index) <= 4:
        return DeviceChoice("cuda", int(index))
    raise ContractError(f"{DEVICE}={value!r}", "'cpu' or 'cuda:<index>', as the node agent sets it",
                        f"start ranks through the node agent, or unset {DEVICE} to fall back to LOCAL_RANK")


def device_of(env: Mapping[str, str]) -> DeviceChoice | None:
    """The agent's choice for this rank, or None when no agent made one (torchrun, tests)."""
    value = env.get(DEVICE)
    return None if value is None else parse_device(value)


class _Shape(Protocol):
    """The parts of slurmkit.layout.Layout a device choice needs."""

    @property
    def ranks_per_node(self) -> int: ...
    @property
    def gpus_per_node(self) -> int: ...


def device_env(local_rank: int, layout: _Shape, inherited: Mapping[str, str], final: Mapping[str, str],
               plan: object | None = None) -> dict[str, str]:
    """``{SLURMKIT_DEVICE: ...}`` for one rank: :func:`choose_device` over the frozen layout and
    the rank's pinning plan (a slurmkit.topology RankPlan, or None when pinning is off)."""
    planned = tuple(int(i) for i in getattr(plan, "gpu_indices", ()))
    return {DEVICE: choose_device(local_rank=local_rank, local_world=layout.ranks_per_node,
                                  gpus_per_node=layout.gpus_per_node, inherited=inherited, final=final,
                                  planned=planned)}
