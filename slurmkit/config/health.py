"""Schema of the pre-flight checks (conf/health/), which slurmkit.health runs.

In the config package (it was slurmkit.health.config) because the schema embeds it while the
health package reads the composed config (``python -m slurmkit.health``) and hands the
supervisor its evidence: config sits below health, and imports nothing from it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

from slurmkit.choices import check_choices
from slurmkit.errors import ConfigError
from slurmkit.gpufaults import DEFAULT_BAD_XIDS

# health.straggler_action (see HealthConfig.straggler_action).
STRAGGLER_ACTIONS = ("report", "replace", "off")
LINK_BACKENDS = ("auto", "gloo", "nccl")  # health.link_backend


@dataclass
class HealthConfig:
    """Pre-flight checks run on every node before each generation's ranks start.

    All checks run at the same time, so a pre-flight takes about the longest check: a few
    seconds. A check that passes its deadline gets its own timeout verdict (a hung GPU query is
    a bad node, a hung shared file system is ``wait``)."""

    CHOICES: ClassVar[Mapping[str, tuple[str, ...]]] = {
        "link_backend": LINK_BACKENDS, "straggler_action": STRAGGLER_ACTIONS,
    }

    enabled: bool = True
    timeout_s: float = 5.0  # deadline of each node check (GPUs, kernel log, NVMe, site commands)
    gpus: bool = True  # count the GPUs (and their uncorrected ECC errors) with nvidia-smi
    nvidia_smi: str = "nvidia-smi"  # the executable (a name on PATH or a path)
    # Kernel log read for Xid and hardware errors since the last check: /dev/kmsg, or a text
    # file (kern.log style, one message per line). "" = off. $VARS expand ($SLURMKIT_NODE too).
    kernel_log: str = "/dev/kmsg"
    kernel_log_lookback_s: float = 3600.0  # the first check of an agent looks back this far
    bad_xids: list[int] = field(default_factory=lambda: list(DEFAULT_BAD_XIDS))
    nvme_min_free_gb: float = 1.0  # free space the NVMe tier needs at least (also: newest save)
    nvme_probe_mb: float = 1.0  # MiB written and fsynced: the tier takes writes (and their speed)
    # Below this (twice) the NVMe is failing. 0 = no floor: the right floor depends on the drive
    # class, and a floor that a busy shared disk can miss would drop healthy nodes; set it for
    # data-center NVMe with health=datacenter (conf/health/datacenter.yaml).
    nvme_min_write_mb_s: float = 0.0
    shared_timeout_s: float = 5.0  # the shared tiers (lustre, object) answer within this, or: wait
    wait_max_s: float = 120.0  # re-check "wait" verdicts this long, then start the ranks anyway
    wait_retry_s: float = 5.0  # between those re-checks
    # Clock offset to node 0 (slurmkit.health.clock): beyond this many seconds, even at the edge of
    # the measurement's uncertainty, the node is bad. 1 s: nodes under NTP/chrony agree within
    # milliseconds, so a second means the node's time sync is broken, and the run's ledger, whose
    # events from every node are merged by time, would misorder failures. 0 = off.
    max_clock_offset_s: float = 1.0
    # Bandwidth among the train nodes (slurmkit.health.links): each exchanges link_probe_mb both
    # ways with its two ring neighbours; a node whose best link is below min_link_ratio times
    # the median of all is bad. Off for a single-node job. A missed link_timeout_s is "wait".
    links: bool = True
    link_timeout_s: float = 5.0
    link_probe_mb: float = 4.0
    min_link_ratio: float = 0.5
    link_backend: str = "auto"  # auto (nccl when CUDA is there, else gloo), gloo or nccl
    # Site health commands, each an argv list run without a shell (exit 0 = healthy node), e.g.
    # [[/opt/site/nodecheck, --quick]]. Their output is captured (the last output_max_bytes).
    extra_commands: list[list[str]] = field(default_factory=list)
    output_max_bytes: int = 4096
    # Straggler detection while training (slurmkit.supervise.stragglers): each rank's own work
    # per step (data wait + compute, the time it does not spend waiting for its peers) against
    # the job's median. "report": a node whose score (job median / own time, of its slowest
    # rank) stays below straggler_threshold for straggler_windows windows in a row is named in
    # the ledger (``straggler``) and in `slurmkit status`. "replace": named the same way, then
    # moved onto a spare at the next checkpoint committed after the naming (the generation stops
    # there and resumes from it on the spare; slurmkit.supervise.straggler_move); without a spare
    # it is reported only, never requeued for. "off": not measured.
    straggler_action: str = "report"
    straggler_threshold: float = 0.7  # relative score below which a window counts as slow
    straggler_windows: int = 3  # consecutive slow windows before a node is named
    straggler_window_samples: int = 10  # step-time samples per rank in one window (median)

    def __post_init__(self) -> None:
        check_choices("health", self, self.CHOICES)
        self._check_stragglers()
        self._check_network()
        for name in ("timeout_s", "shared_timeout_s", "wait_retry_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"health.{name}={getattr(self, name)}", "a positive number of seconds",
                                  f"set health.{name}=5")
        for name in ("kernel_log_lookback_s", "nvme_min_free_gb", "nvme_probe_mb",
                     "nvme_min_write_mb_s", "wait_max_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"health.{name}={getattr(self, name)}", "a value >= 0",
                                  f"set health.{name}=0 or more")
        if self.output_max_bytes < 1:
            raise ConfigError(f"health.output_max_bytes={self.output_max_bytes}", "at least 1 byte",
                              "set health.output_max_bytes=4096")
        for cmd in self.extra_commands:
            if not cmd or not all(isinstance(a, str) and a for a in cmd):
                raise ConfigError(f"health.extra_commands entry {cmd!r}",
                                  "a non-empty argv list of non-empty strings (run without a shell)",
                                  "write each command as a list, e.g. health.extra_commands=[[/opt/site/check,--quick]]")
            if any(any(ord(c) < 32 or ord(c) == 127 for c in a) for a in cmd):
                raise ConfigError(f"health.extra_commands entry {cmd!r} holds a control character",
                                  "plain arguments", "remove the control characters from the command")

    def _check_stragglers(self) -> None:
        if not 0 < self.straggler_threshold < 1:
            raise ConfigError(f"health.straggler_threshold={self.straggler_threshold}",
                              "a relative score between 0 and 1 (job median / own step time)",
                              "set health.straggler_threshold=0.7")
        if self.straggler_windows < 1:
            raise ConfigError(f"health.straggler_windows={self.straggler_windows}", "at least 1 window",
                              "set health.straggler_windows=3")
        if self.straggler_window_samples < 3:
            raise ConfigError(f"health.straggler_window_samples={self.straggler_window_samples}",
                              "at least 3 samples (a median of fewer follows one slow step)",
                              "set health.straggler_window_samples=10")

    def _check_network(self) -> None:
        if self.max_clock_offset_s < 0:
            raise ConfigError(f"health.max_clock_offset_s={self.max_clock_offset_s}", "a value >= 0 (0: off)",
                              "set health.max_clock_offset_s=1")
        if self.link_timeout_s <= 0 or self.link_probe_mb <= 0:
            raise ConfigError(f"health.link_timeout_s={self.link_timeout_s}, health.link_probe_mb={self.link_probe_mb}",
                              "positive numbers", "set health.link_timeout_s=5 and health.link_probe_mb=4")
        if not 0 < self.min_link_ratio < 1:
            raise ConfigError(f"health.min_link_ratio={self.min_link_ratio}",
                              "a ratio between 0 and 1 (a node's best link / the median of all)",
                              "set health.min_link_ratio=0.5")
