"""Schema of the per-rank pinning policy and its defaults (conf/topology/ restates none of
them). Owned by the topology package."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

from slurmkit.choices import check_choices
from slurmkit.errors import ConfigError


@dataclass
class TopologyConfig:
    """How each local rank is pinned to GPUs, cores, NUMA memory and NICs."""

    # field -> its allowed values (the field comments below say what each means)
    CHOICES: ClassVar[Mapping[str, tuple[str, ...]]] = {
        "gpu_order": ("pci", "cpu_first"),
        "cpu_mode": ("exclusive", "numa", "socket", "none"),
        "mem_mode": ("preferred", "bind", "interleave", "none"),
        "nic_mode": ("closest", "all", "none"),
        "nic_kinds": ("rdma", "eth"),  # each entry of the list
        "gpu_visibility": ("rank", "all"),
        "binder": ("slurmkit", "slurm"),
        "verify": ("warn", "fail", "off"),
        "apply_method": ("auto", "numactl", "syscall"),
    }

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
    # "closest": the NIC(s) nearest the rank's GPU by PCI path; "all": every selected NIC;
    # "none": no NIC for the rank (no NIC variables; NCCL chooses).
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
    # What the pin wrapper does when the rank's real affinity differs from the plan: "warn" (a
    # warning in the rank's log), "fail" (exit 2 instead of starting the rank), "off" (nothing).
    verify: str = "warn"
    # How the pin wrapper sets the memory policy: "numactl" (exec numactl in front of the
    # command), "syscall" (set_mempolicy itself), "auto" (numactl when on PATH, else syscall).
    apply_method: str = "auto"

    def __post_init__(self) -> None:
        check_choices("topology", self, self.CHOICES)
        if self.gpus_per_rank < 0:
            raise ConfigError(
                detected=f"topology.gpus_per_rank={self.gpus_per_rank}",
                requirement="0 (automatic) or a positive number",
                fix="set topology.gpus_per_rank=0",
            )
        if not self.nic_kinds:
            raise ConfigError(
                detected="topology.nic_kinds=[]",
                requirement=f"a non-empty list of {', '.join(self.CHOICES['nic_kinds'])}",
                fix="set topology.nic_kinds=[rdma]",
            )


def register_configs(cs: object | None = None) -> None:
    """Register TopologyConfig as the schema of the ``topology`` group in Hydra's ConfigStore."""
    from hydra.core.config_store import ConfigStore

    store = cs if cs is not None else ConfigStore.instance()
    store.store(group="topology", name="schema", node=TopologyConfig)  # type: ignore[attr-defined]
