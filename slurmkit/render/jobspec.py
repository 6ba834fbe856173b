"""JobSpec: the composed config reduced to exactly what the batch script needs, validated."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from slurmkit.config.envnames import check_env_names, risky
from slurmkit.config.schema import SlurmkitConfig
from slurmkit.config.secrets import (
    check_config_secrets,
    check_env_secrets,
    check_image_secrets,
    check_text_secrets,
)
from slurmkit.errors import ConfigError
from slurmkit.layout import Layout, resolve_layout
from slurmkit.render.values import check_printable, check_slurm_names
from slurmkit.slurm.hostlist import compress_hostlist, expand_hostlist
from slurmkit.slurm.timelimit import format_time_limit, parse_time_limit

log = logging.getLogger(__name__)
STORE_URIS = ("nvme_uri", "lustre_uri", "object_uri")


@dataclass(frozen=True)
class JobSpec:
    """One Slurm job: one node agent task per node, which starts the node's ranks."""

    name: str
    run_dir: str  # absolute; on a file system every node sees
    # From the run's Layout (slurmkit.layout), the one answer the agent and planner also use.
    nodes: int  # allocated, spares included
    train_nodes: int  # nodes that run ranks
    ranks_per_node: int
    gpus_per_node: int
    gpu_type: str | None
    cpus_per_task: int | None
    mem_gb: float | None
    time_limit: str  # Slurm format, e.g. 2-00:00:00
    time_limit_s: int | None  # None: UNLIMITED
    signal_lead_s: int
    requeue: bool
    exclusive: bool
    exclude: tuple[str, ...]
    singleton: bool
    partition: str | None
    account: str | None
    qos: str | None
    constraint: str | None
    container_image: str | None
    container_mounts: tuple[str, ...]
    setup: tuple[str, ...]
    env: tuple[tuple[str, str], ...]  # sorted (name, value)
    srun_args: tuple[str, ...]
    no_kill: bool = False  # spare nodes: a node failure must not end the job (--no-kill)
    # A sweep: Slurm's --array value ("0-3" or "0-3%2"); run_dir is then the sweep directory and
    # array task i runs in <run_dir>/<i> (slurmkit/sweepdir.py).
    array: str | None = None
    # Admin options, none by default: --reservation, --wckey, --switches=<count>[@<max-time>],
    # --segment=N.
    reservation: str | None = None
    wckey: str | None = None
    switches: str | None = None
    segment: int | None = None
    # sha256 of the frozen config.yaml, exported to the agents ($SLURMKIT_CONFIG_SHA256), which
    # refuse a changed one (slurmkit/rundir.py); None: not checked (sweeps, a dry run)
    config_sha256: str | None = None
    # Nodes per srun step of the agents' launch (launch.nodes_per_step, resolved: >= 1).
    nodes_per_step: int = 1
    # --requeue=expedite instead of --requeue: set at submit where the site probe found it
    # enabled (Slurm 25.11+, SlurmctldParameters=enable_expedited_requeue).
    requeue_expedite: bool = False

    @property
    def world_size(self) -> int:
        return self.train_nodes * self.ranks_per_node


def _check_env(cfg: SlurmkitConfig) -> None:
    """The schema refuses reserved names already; again here for a config built in code
    (dataclasses.replace), and the warnings, which belong to a submission, not to every load."""
    for where, env in (("cluster.env", cfg.cluster.env), ("job.env", cfg.job.env)):
        check_env_names(where, env)
        for name in env:
            why = risky(name)
            if why:
                log.warning("%s.%s is set, and %s: every agent and rank of the job runs with "
                            "it. Make sure that is meant", where, name, why)


def _more_values(cfg: SlurmkitConfig) -> list[tuple[str, str | None]]:
    """Values that reach the job other than through the JobSpec: the command every rank runs,
    the store URIs (paths on every node), the run root (the sweep directory's parent)."""
    out: list[tuple[str, str | None]] = [("job.command", a) for a in cfg.job.command]
    out += [(f"store.{k}", getattr(cfg.store, k)) for k in STORE_URIS]
    out.append(("submit.run_root", cfg.submit.run_root))
    return out


def _check_secrets(cfg: SlurmkitConfig, spec: JobSpec) -> None:
    check_env_secrets(spec.env)
    check_text_secrets("a cluster.setup line", spec.setup)
    check_text_secrets("job.command", cfg.job.command, arguments=True)
    check_image_secrets("cluster.container_image", spec.container_image)
    check_text_secrets("cluster.container_mounts", spec.container_mounts)
    for key in STORE_URIS:
        check_text_secrets(f"store.{key}", [getattr(cfg.store, key)])
    check_config_secrets(cfg)


def _check_resources(cfg: SlurmkitConfig, nodes: int, cpus: int | None) -> None:
    c, j = cfg.cluster, cfg.job
    if c.max_nodes and nodes > c.max_nodes:
        raise ConfigError(
            f"{nodes} nodes ({j.nodes} + {cfg.supervisor.spare_nodes} spare) on cluster '{c.name}' "
            f"with {c.max_nodes} nodes", f"at most {c.max_nodes} nodes",
            "lower job.nodes or supervisor.spare_nodes")
    if cpus is not None and c.cpus_per_node and cpus > c.cpus_per_node:
        raise ConfigError(f"job.cpus_per_task={cpus} on nodes with {c.cpus_per_node} CPUs",
                          f"at most {c.cpus_per_node}", f"set job.cpus_per_task={c.cpus_per_node}")
    if j.mem_gb is not None and c.mem_gb_per_node and j.mem_gb > c.mem_gb_per_node:
        raise ConfigError(f"job.mem_gb={j.mem_gb} on nodes with {c.mem_gb_per_node} GB",
                          f"at most {c.mem_gb_per_node} GB per node",
                          f"set job.mem_gb={c.mem_gb_per_node} or less")


#: launch.nodes_per_step=0 keeps at most this many srun steps for the agents (node 0's and the
#: others'): one node per step up to this many nodes, then groups that grow with the job.
#: Measured on the local cluster (64 emulated nodes, tools/bench/launch_scale.py): starting all
#: agents took 3.0-3.2 s in one step, 3.35 s in 9, 5.44 s in 33 and 6.7-7.5 s in 64, about 65 ms
#: per step; 17 steps stay within about 1 s of one step while a shared step that srun ends
#: leaves node 0 at most N/16 agents to relaunch (128 at 2,048 nodes).
AUTO_STEPS = 17


def nodes_per_step(nodes: int, configured: int) -> int:
    """The nodes of each agents' srun step but node 0's (which has one of its own).

    ``configured`` >= 1 is taken as given; 0 chooses from the job's size: one per node while
    that is at most AUTO_STEPS steps, else the smallest group that keeps the steps at
    AUTO_STEPS (128 nodes per step at 2,049 nodes: 17 step creates instead of 2,049)."""
    if configured >= 1:
        return configured
    others = max(nodes - 1, 0)
    return max(1, -(-others // (AUTO_STEPS - 1)))


def array_spec(count: int, parallelism: int) -> str:
    """Slurm's --array value for ``count`` variants, at most ``parallelism`` at once (0: all)."""
    expr = f"0-{count - 1}"
    return f"{expr}%{parallelism}" if 0 < parallelism < count else expr


def build_jobspec(cfg: SlurmkitConfig, run_dir: str, srun_args: list[str] | None = None,
                  array: str | None = None, layout: Layout | None = None) -> JobSpec:
    """Validate ``cfg`` against its cluster and reduce it to a JobSpec. Raises ConfigError.

    ``array``: the job runs a sweep (``run_dir`` is its sweep directory), see :func:`array_spec`.
    ``layout``: the run's resolved layout (slurmkit.layout), resolved from ``cfg`` when not given;
    the nodes, ranks and GPUs the script asks Slurm for are exactly the ones the agent will use.
    """
    j, c = cfg.job, cfg.cluster
    layout = resolve_layout(cfg) if layout is None else layout
    seconds = parse_time_limit(j.time)
    if seconds is not None and seconds <= j.signal_lead_s:
        raise ConfigError(f"job.time={j.time!r} ({seconds} s) with job.signal_lead_s={j.signal_lead_s}",
                          "a time limit longer than the warning lead",
                          "raise job.time or lower job.signal_lead_s")
    nodes = layout.nodes
    # An exclusive job already holds every CPU of its nodes and its steps use them all; asking
    # for the whole node with --cpus-per-task fails where the site reserves cores (CoreSpecCount).
    cpus = j.cpus_per_task if j.cpus_per_task is not None else (
        None if c.exclusive else (c.cpus_per_node or None))
    _check_resources(cfg, nodes, cpus)
    exclude: list[str] = []
    for expr in j.exclude:
        exclude.extend(expand_hostlist(expr))
    _check_env(cfg)
    env = {**c.env, **j.env}
    spec = JobSpec(
        name=j.name, run_dir=os.path.abspath(run_dir), nodes=nodes, train_nodes=layout.train_nodes,
        ranks_per_node=layout.ranks_per_node, gpus_per_node=layout.gpus_per_node, gpu_type=c.gpu_type, cpus_per_task=cpus,
        mem_gb=j.mem_gb, time_limit=format_time_limit(seconds), time_limit_s=seconds,
        signal_lead_s=j.signal_lead_s, requeue=j.requeue, exclusive=c.exclusive,
        exclude=tuple(sorted(set(exclude))), singleton=j.singleton, partition=c.partition,
        account=c.account, qos=c.qos, constraint=c.constraint, container_image=c.container_image,
        container_mounts=tuple(c.container_mounts), setup=tuple(c.setup),
        env=tuple(sorted(env.items())), srun_args=tuple(srun_args or ()),
        no_kill=layout.spare_nodes > 0, array=array,
        reservation=c.reservation, wckey=c.wckey, switches=c.switches, segment=c.segment,
        nodes_per_step=nodes_per_step(nodes, cfg.launch.nodes_per_step),
    )
    # Nothing is written before these pass (submit renders before it creates the run directory).
    _check_secrets(cfg, spec)  # first: the printable check quotes what it refuses
    check_printable(spec, _more_values(cfg))
    check_slurm_names(spec)
    return spec


def exclude_expr(spec: JobSpec) -> str | None:
    return compress_hostlist(spec.exclude) if spec.exclude else None
