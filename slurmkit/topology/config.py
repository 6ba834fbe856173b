"""Schema of the per-rank pinning policy (conf/topology/). Owned by the topology package."""

from __future__ import annotations

from dataclasses import dataclass, field

from slurmkit.errors import ConfigError

_CHOICES: dict[str, tuple[str, ...]] = {
    "gpu_order": ("pci", "cpu_first"),
    "cpu_mode": ("exclusive", "numa", "socket", "none"),
    "mem_mode": ("preferred", "bind", "interleave", "none"),
    "nic_mode": ("closest", "all", "none"),
    "gpu_visibility": ("rank", "all"),
    "binder": ("slurmkit", "slurm"),
    "verify": ("warn", "fail", "off"),
    "apply_method": ("auto", "numactl", "syscall"),
}
_NIC_KINDS = ("rdma", "eth")


@dataclass
class TopologyConfig:
    """How each local rank is pinned to GPUs, cores, NUMA memory and NICs."""

    # False: no pinning, no topology variables; ranks inherit the task's affinity.
    enabled: bool = True
    # Which GPU a local rank gets: "pci" = rank i -> i-th GPU in PCI order (torchrun's habit);
    # "cpu_first" = split the cores first, then give each rank the GPU nearest its cores
    # (what Slurm's --gpu-bind=closest does).
    gpu_order: str = "pci"
    # GPUs per rank; 0 = automatic (1, or GPUs // ranks when there are fewer ranks than GPUs).
    gpus_per_rank: int = 0
    # "exclusive": a disjoint slice of the cores of the GPU's NUMA node; "numa": every allowed
    # CPU of that node (shared); "socket": every allowed CPU of that package; "none": no binding.
    cpu_mode: str = "exclusive"
    # Keep SMT siblings (hyperthreads of one core) in the same rank.
    keep_smt_siblings: bool = True
    # NUMA memory policy: "preferred" (fall back to other nodes when full), "bind" (never),
    # "interleave" (across all allowed memory nodes), "none".
    mem_mode: str = "preferred"
    # "closest": the NIC(s) nearest the rank's GPU by PCI path; "all": every selected NIC.
    nic_mode: str = "closest"
    # Kinds of adapter NCCL may use: "rdma" (InfiniBand/RoCE verbs devices), "eth" (sockets).
    nic_kinds: list[str] = field(default_factory=lambda: ["rdma"])
    # fnmatch patterns on NIC names; empty include = all. Exclude storage NICs here if the
    # planner could otherwise pick them (it never does when a compute NIC is nearer).
    nic_include: list[str] = field(default_factory=list)
    nic_exclude: list[str] = field(default_factory=list)
    # "rank": CUDA_VISIBLE_DEVICES = the rank's GPU(s); "all": every GPU stays visible.
    gpu_visibility: str = "rank"
    # Who binds: "slurmkit" (srun --cpu-bind=none, the node agent pins each rank) or "slurm"
    # (Slurm binds; slurmkit respects the mask it finds and only picks GPUs/NICs inside it).
    binder: str = "slurmkit"
    # What the rank does when its real affinity differs from the plan.
    verify: str = "warn"
    # How the pin wrapper sets the memory policy: numactl when present ("auto") or syscalls.
    apply_method: str = "auto"
    # NCCL topology XML for VMs whose PCI tree is flat; "" = take NCCL_TOPO_FILE from the env.
    nccl_topo_file: str = ""

    def __post_init__(self) -> None:
        for name, choices in _CHOICES.items():
            value = getattr(self, name)
            if value not in choices:
                raise ConfigError(
                    detected=f"topology.{name}={value!r}",
                    requirement=f"one of {', '.join(choices)}",
                    fix=f"set topology.{name} to one of them",
                )
        if self.gpus_per_rank < 0:
            raise ConfigError(
                detected=f"topology.gpus_per_rank={self.gpus_per_rank}",
                requirement="0 (automatic) or a positive number",
                fix="set topology.gpus_per_rank=0",
            )
        bad = [k for k in self.nic_kinds if k not in _NIC_KINDS]
        if bad or not self.nic_kinds:
            raise ConfigError(
                detected=f"topology.nic_kinds={list(self.nic_kinds)}",
                requirement=f"a non-empty list of {', '.join(_NIC_KINDS)}",
                fix="set topology.nic_kinds=[rdma]",
            )


def register_configs(cs: object | None = None) -> None:
    """Register TopologyConfig as the schema of the ``topology`` group in Hydra's ConfigStore."""
    from hydra.core.config_store import ConfigStore

    store = cs if cs is not None else ConfigStore.instance()
    store.store(group="topology", name="schema", node=TopologyConfig)  # type: ignore[attr-defined]
