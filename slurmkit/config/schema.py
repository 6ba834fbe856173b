"""Structured-config dataclasses: the schema, and the one place every default lives.

conf/<group>/*.yaml hold presets (a cluster, an experiment, a store layout) that differ from
these defaults; a group's default.yaml restates none of them (tests/unit/config/test_defaults.py,
docs/config.md). Each component validates its own fields in ``__post_init__`` (which
OmegaConf.to_object runs), so the rest of the code only ever sees checked, typed objects, never
a DictConfig. A field that holds one of a fixed set of words is listed in its class's
``CHOICES`` and checked by slurmkit.choices.check_choices.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from omegaconf import MISSING, DictConfig, OmegaConf

from slurmkit import adapters
from slurmkit.choices import check_choices
from slurmkit.config.envnames import check_env_names
from slurmkit.config.health import HealthConfig
from slurmkit.errors import ConfigError
from slurmkit.store.config import StoreConfig
from slurmkit.topology.config import TopologyConfig
from slurmkit.train.config import ModelConfig, ParallelConfig, TrainConfig

log = logging.getLogger(__name__)

CLUSTER_KINDS = ("auto", "slurm", "local")  # cluster.kind
SUBMIT_EMITS = ("", "sbatch")  # submit.emit
REQUIRE_HEARTBEAT = ("auto", "true", "false")  # supervisor.require_heartbeat
REQUEUE_AS = ("auto", "successor", "in_place")  # supervisor.requeue_as
EXIT0_AFTER_SIGNAL = ("auto", "completed", "left")  # supervisor.exit0_after_signal
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# Keys removed from the schema that nothing ever read: a config.yaml frozen into a run directory
# before their removal still carries them, and its requeue (or report) must still load it.
REMOVED_KEYS = ("topology.nccl_topo_file",)


def drop_removed_keys(frozen: Any) -> None:
    """Delete REMOVED_KEYS from a loaded frozen config (a DictConfig), where present."""
    for key in REMOVED_KEYS:
        section, _, name = key.rpartition(".")
        node = OmegaConf.select(frozen, section) if isinstance(frozen, DictConfig) else None
        if isinstance(node, DictConfig) and name in node:
            del node[name]


@dataclass
class ClusterConfig:
    """A site profile: what the machines are and how jobs reach them."""

    CHOICES: ClassVar[Mapping[str, tuple[str, ...]]] = {"kind": CLUSTER_KINDS}

    name: str = MISSING  # the profile's name (conf/cluster/<name>.yaml)
    # How jobs run: "slurm" (sbatch), "local" (the node agents as local processes, submitit's
    # local executor), "auto" (Slurm when sbatch reaches a controller, else local processes).
    kind: str = "auto"
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    gpus_per_node: int = 0  # GPUs in one node of this cluster (0: CPU only)
    gpu_type: str | None = None  # GRES type, e.g. h100 -> --gpus-per-node=h100:8
    cpus_per_node: int = 0  # 0: unknown, not checked
    mem_gb_per_node: float = 0  # 0: unknown, not checked
    gpu_mem_gb: float = 0  # memory of one GPU, for the planner
    gpu_peak_tflops: float = 0  # dense bf16 peak of one GPU, for MFU
    gpu_hour_cost: float = 0  # price of one GPU-hour, for the report's cost figures (0: unset)
    exclusive: bool = False
    setup: list[str] = field(default_factory=list)  # shell lines run before the agents start
    container_image: str | None = None  # pyxis --container-image
    container_mounts: list[str] = field(default_factory=list)  # pyxis --container-mounts
    kill_wait_s: int = 30  # Slurm's KillWait: SIGTERM -> SIGKILL
    max_nodes: int = 0  # 0: unknown, not checked
    env: dict[str, str] = field(default_factory=dict)
    # Admin options, none by default (slurmkit/render/values.py checks them at submit).
    reservation: str | None = None  # --reservation=NAME[,NAME]
    wckey: str | None = None  # --wckey=NAME (nothing hard-coded: the site's default applies)
    switches: str | None = None  # --switches=<count>[@<max-time>], e.g. 1@01:00:00
    segment: int | None = None  # --segment=N (Slurm 24.11+, topology/block): nodes per segment

    def __post_init__(self) -> None:
        check_choices("cluster", self, self.CHOICES)
        if self.segment is not None and self.segment < 1:
            raise ConfigError(f"cluster.segment={self.segment}", "at least 1 node per segment",
                              "set cluster.segment to the block size the site uses, or remove it")
        check_env_names("cluster.env", self.env)
        for name in ("gpus_per_node", "cpus_per_node", "max_nodes", "kill_wait_s", "gpu_hour_cost"):
            if getattr(self, name) < 0:
                raise ConfigError(f"cluster.{name}={getattr(self, name)}", "a value >= 0",
                                  f"fix cluster.{name} in the cluster profile")


@dataclass
class JobConfig:
    """What one experiment asks of the cluster, and what it runs."""

    CHOICES: ClassVar[Mapping[str, tuple[str, ...]]] = {"program": adapters.NAMES}
    name: str = "slurmkit"
    nodes: int = 1
    ranks_per_node: int | None = None  # None: the GPUs per node (1 on a CPU-only job)
    gpus_per_node: int | None = None  # None: all of the cluster's GPUs per node
    # the node agent's CPUs; None: the cluster's cpus_per_node, or with cluster.exclusive none
    # asked (the job holds the whole node; --cpus-per-task=<all> fails with CoreSpecCount)
    cpus_per_task: int | None = None
    mem_gb: float | None = None  # per node; None: Slurm's default (or all with exclusive)
    time: str = "01:00:00"  # Slurm time limit: MM, HH:MM:SS, D-HH:MM:SS
    signal_lead_s: int = 120  # --signal=B:USR1@lead: warning before the time limit
    requeue: bool = True
    exclude: list[str] = field(default_factory=list)
    singleton: bool = True  # --dependency=singleton with a stable job name
    command: list[str] = field(default_factory=lambda: ["python", "-m", "slurmkit.examples.allreduce"])
    env: dict[str, str] = field(default_factory=dict)
    # What slurmkit reads from a third-party program (slurmkit.adapters): auto (recognised from
    # the command), reference, torchtitan, lightning, torchrun or none (none also keeps slurmkit's
    # Lightning callback out of the program's Trainer). progress_pattern: a regex
    # with a named group ``step`` (and loss, tokens_per_s, mfu, mfu_pct, tflops) for rank 0's
    # lines; checkpoint_glob: where its finished saves are, with one {step}, e.g.
    # ckpt/snapshot-{step}.pt (relative to the run directory, the ranks' working directory).
    program: str = "auto"
    progress_pattern: str = ""
    checkpoint_glob: str = ""

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise ConfigError(f"job.nodes={self.nodes}", "at least 1 node", "set job.nodes=1 or more")
        if self.ranks_per_node is not None and self.ranks_per_node < 1:
            raise ConfigError(f"job.ranks_per_node={self.ranks_per_node}", "at least 1 rank per node",
                              "set job.ranks_per_node=1 or more, or null to use the GPUs per node")
        if self.gpus_per_node is not None and self.gpus_per_node < 0:
            raise ConfigError(f"job.gpus_per_node={self.gpus_per_node}", "a value >= 0",
                              "set job.gpus_per_node=0 or more")
        if not _NAME_RE.fullmatch(self.name):  # match() would let a trailing newline through
            raise ConfigError(f"job.name={self.name!r}",
                              "1-128 characters of letters, digits, '.', '_' or '-' starting with a "
                              "letter or digit (it names the run directory and the Slurm job)",
                              "choose a name such as job.name=llama70b-pretrain")
        if not self.command:
            raise ConfigError("job.command is empty", "a command to run on every rank",
                              "set job.command=[python,-m,slurmkit.train]")
        if self.signal_lead_s < 0:
            raise ConfigError(f"job.signal_lead_s={self.signal_lead_s}", "a value >= 0",
                              "set job.signal_lead_s=120")
        check_env_names("job.env", self.env)
        check_choices("job", self, self.CHOICES)
        if self.progress_pattern:
            adapters.compile_pattern(self.progress_pattern)  # ConfigError: what is wrong with it
        if self.checkpoint_glob:  # ConfigError: what is wrong with it
            adapters.compile_glob(adapters.split_glob(self.checkpoint_glob, ".")[1])


#: Where runs go when neither submit.run_root nor $SLURMKIT_RUN_ROOT says.
DEFAULT_RUN_ROOT = "~/slurmkit-runs"


def absolute_run_root(value: str, env: Mapping[str, str] | None = None) -> str:
    """submit.run_root as an absolute path: "" is $SLURMKIT_RUN_ROOT or ~/slurmkit-runs."""
    env = os.environ if env is None else env
    return os.path.abspath(os.path.expanduser(value or env.get("SLURMKIT_RUN_ROOT") or DEFAULT_RUN_ROOT))


@dataclass
class SubmitConfig:
    CHOICES: ClassVar[Mapping[str, tuple[str, ...]]] = {"emit": SUBMIT_EMITS}

    dry_run: bool = False  # print the exact sbatch script, submit nothing
    # "sbatch": write a standalone sbatch script into the run directory; "": submit through
    # submitit (its pickles in the run directory).
    emit: str = ""
    # Run directories are created below this, on a file system every node sees. "" (the
    # default): $SLURMKIT_RUN_ROOT, else ~/slurmkit-runs. Always made absolute at compose (a
    # relative root named another directory, and another user's runs, from every working
    # directory); submit prints the run directory it made.
    run_root: str = ""
    wait: bool = False  # block until the job ends (and exit with its status)
    timeout_s: float = 0  # with wait: give up after this long (0: no limit)
    array_parallelism: int = 0  # a sweep (-m): at most this many variants at once (0: no limit)
    # Retention: after a submission, remove this user's finished runs of the same job.name
    # beyond the newest N (`slurmkit clean --keep N` below <run_root>/<job.name>); 0 keeps all.
    keep_finished_runs: int = 0

    def __post_init__(self) -> None:
        check_choices("submit", self, self.CHOICES)
        self.run_root = absolute_run_root(self.run_root)
        if self.keep_finished_runs < 0:
            raise ConfigError(f"submit.keep_finished_runs={self.keep_finished_runs}", "a value >= 0",
                              "set submit.keep_finished_runs=0 (keep every run) or how many to keep")
        if self.array_parallelism < 0:
            raise ConfigError(f"submit.array_parallelism={self.array_parallelism}", "a value >= 0",
                              "set submit.array_parallelism=0 (no limit) or the most variants at once")


@dataclass
class LaunchConfig:
    """How the batch script starts the node agents (sbatch_templates/launch_agents.sh.j2)."""

    # Nodes per srun step. Node 0's agent always has a step of its own; the others share steps
    # of this many nodes, so a job of N nodes costs 1 + ceil((N-1)/nodes_per_step) step
    # creates and srun processes on the batch host per attempt. A lost node ends its whole
    # step: node 0 relaunches the agents of the step's healthy nodes. 0: chosen from the job's
    # size (slurmkit.render.jobspec.nodes_per_step: one node per step up to 17 nodes, then at
    # most 17 steps; 128 nodes per step at 2,049 nodes).
    nodes_per_step: int = 0

    def __post_init__(self) -> None:
        if self.nodes_per_step < 0:
            raise ConfigError(f"launch.nodes_per_step={self.nodes_per_step}", "0 (chosen from the job's size) "
                              "or a node count >= 1", "set launch.nodes_per_step=0")


@dataclass
class SupervisorConfig:
    """The node agents' supervisor: restart limits, spares and liveness deadlines.

    The supervisor always runs (the agent is how ranks start); ``enabled`` is a retired key that
    nothing ever read. It stays in the schema, unset (None), only so that a config that still
    sets it is answered precisely: ``true`` (in every config.yaml frozen before it was retired,
    which a requeued job reloads) is accepted with a deprecation message; ``false`` asked for a
    job without a supervisor, which slurmkit cannot run, and is refused.
    """

    CHOICES: ClassVar[Mapping[str, tuple[str, ...]]] = {
        "requeue_as": REQUEUE_AS, "require_heartbeat": REQUIRE_HEARTBEAT,
        "exit0_after_signal": EXIT0_AFTER_SIGNAL,
    }

    enabled: bool | None = None  # retired: see above
    max_restarts: int = 5  # restarts inside one allocation before requeueing
    max_restarts_without_progress: int = 3  # then stop with exit code 93
    max_requeues: int = 20  # requeues after failures (time-limit ones not counted), then exit 93
    # How the job requeues itself (slurmkit/supervise/exits/successor.py): "successor" (it submits the
    # job that takes over, excluding the bad nodes, and ends), "in_place" (scontrol requeue; with
    # nodes to exclude, requeuehold and a helper outside the job), "auto" (successor when nodes
    # are excluded or the site tracks processes in cgroups, where no helper outlives the job).
    requeue_as: str = "auto"
    heartbeat_timeout_s: float = 60.0  # no step advance for this long: a hang
    startup_timeout_s: float = 300.0  # first heartbeat must come within this (see require_heartbeat)
    # Whether a rank that has never beaten is a hang after startup_timeout_s: "auto" (only for
    # job.command = slurmkit.train, which beats every step), "true", "false" (a rank is judged
    # from its first beat on; a program that never beats is never taken for a hang by it).
    require_heartbeat: str = "auto"
    # What ranks that all exit 0 after a time-limit warning or a SIGTERM mean: "completed" (the
    # run is done), "left" (they left on the signal: requeued or handled as a preemption, and
    # resumed from the program's own checkpoint), "auto" (completed for slurmkit.train, which
    # exits 95 when it leaves on a signal; left for any other program, which may not).
    exit0_after_signal: str = "auto"
    spare_nodes: int = 0  # allocate nodes + spare_nodes, train on nodes
    poll_interval_s: float = 0.5  # how often agents look at their ranks and each other
    node_timeout_s: float = 3.0  # an agent silent this long is a lost node (beats every poll)
    heartbeat_ledger_interval_s: float = 10.0  # how often sampled heartbeats go to the ledger
    # A lost agent on a node Slurm still calls healthy: how many times node 0 relaunches that
    # node's agent (a new srun step) inside one allocation before it falls back to a spare or a
    # requeue keeping the node (slurmkit.supervise.relaunch). 0: never relaunched.
    agent_relaunches: int = 1
    # slurmkit.train's ranks start from warm standbys (slurmkit.launch.standby): processes that
    # imported the trainer ahead and wait; a restart inside the allocation then skips each rank's
    # Python and torch start-up. Generation 0's import while the agents meet; the next
    # generation's once the ranks have trained warm_standby_after_s (a job that never fails pays
    # one idle import per rank, and none in its first minute). Other programs always start cold.
    warm_standby: bool = True
    warm_standby_after_s: float = 60.0
    # With warm_standby: the ranks are forked from one process per node that imported the
    # trainer once (slurmkit.launch.forkserver), every generation, instead of a standby per rank
    # importing it again; per-rank standbys where it cannot fork (CUDA loaded before the fork).
    fork_ranks: bool = True

    def __post_init__(self) -> None:
        if self.enabled is False:
            raise ConfigError("supervisor.enabled=false, a retired key: the supervisor runs every "
                              "job (it is what starts, watches and restarts the ranks)",
                              "no supervisor.enabled (true is accepted and ignored)",
                              "remove supervisor.enabled from the config and the command line")
        if self.enabled is True:
            log.warning("supervisor.enabled is retired and ignored (the supervisor always runs); "
                        "remove it from your config")
        if self.spare_nodes < 0:
            raise ConfigError(f"supervisor.spare_nodes={self.spare_nodes}", "a value >= 0",
                              "set supervisor.spare_nodes=0 or more")
        if self.agent_relaunches < 0:
            raise ConfigError(f"supervisor.agent_relaunches={self.agent_relaunches}", "a value >= 0",
                              "set supervisor.agent_relaunches=1 (0: a lost agent's node takes a spare "
                              "or the job requeues keeping it)")
        if self.warm_standby_after_s < 0:
            raise ConfigError(f"supervisor.warm_standby_after_s={self.warm_standby_after_s}",
                              "a number of seconds >= 0",
                              "set supervisor.warm_standby_after_s=60 (or supervisor.warm_standby=false)")
        if self.max_requeues < 0:
            raise ConfigError(f"supervisor.max_requeues={self.max_requeues}", "a value >= 0",
                              "set supervisor.max_requeues=20 (0: never requeue after a failure)")
        if self.heartbeat_timeout_s <= 0:
            raise ConfigError(f"supervisor.heartbeat_timeout_s={self.heartbeat_timeout_s}",
                              "a positive number of seconds", "set supervisor.heartbeat_timeout_s=60")
        # A bool typed on the command line arrives as Python's str of it ("True"): these two
        # are taken in any case, as they always were.
        check_choices("supervisor", self, self.CHOICES, fold_case=("require_heartbeat", "exit0_after_signal"))


@dataclass
class SlurmkitConfig:
    cluster: ClusterConfig = MISSING
    job: JobConfig = field(default_factory=JobConfig)
    submit: SubmitConfig = field(default_factory=SubmitConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    store: StoreConfig = MISSING  # its default instance is invalid (no tier): conf/store/ fills it
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    supervisor: SupervisorConfig = field(default_factory=SupervisorConfig)
    health: HealthConfig = field(default_factory=HealthConfig)  # pre-flight checks (slurmkit.health)
