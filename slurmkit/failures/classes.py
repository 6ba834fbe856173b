"""Failure classes and what each one means for recovery."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class FailureClass(str, Enum):
    NCCL_TIMEOUT = "nccl_timeout"
    NCCL_ERROR = "nccl_error"  # async/remote error: a peer died or the network failed
    NCCL_SYNC = "nccl_sync"  # DistBackendError raised in Python
    WATCHDOG_STUCK = "watchdog_stuck"
    HANG = "hang"  # no log line; the step heartbeat stopped
    RANK_CRASH = "rank_crash"  # a rank died on a signal or exited non-zero without a reason
    GPU_OOM = "gpu_oom"
    HOST_OOM = "host_oom"
    USER_ERROR = "user_error"  # a Python exception in the training code
    CONFIG_ERROR = "config_error"
    TIME_LIMIT = "time_limit"
    PREEMPTION = "preemption"
    NODE_LOSS = "node_loss"
    PEER_FAILURE = "peer_failure"  # a rank saw a peer disappear: a symptom, never the cause
    PREFLIGHT = "preflight"  # the node failed its pre-flight checks (slurmkit.health) before its ranks
    # The node's hardware failed under a rank: a GPU Xid of health's bad list, an uncorrectable
    # ECC error, a GPU off the bus, an uncorrected host memory error, a fatal event of the NIC.
    GPU_FAULT = "gpu_fault"
    # A fatal CUDA error that a bug can cause as well as a GPU (an illegal memory access, an
    # unspecified launch failure): the node is suspect, excluded when it happens there again.
    CUDA_ERROR = "cuda_error"
    # Node 0 stopped the generation itself, right after a checkpoint newer than the naming was
    # committed, to move a node that stays slow onto a spare (health.straggler_action=replace).
    STRAGGLER = "straggler"


@dataclass(frozen=True)
class ClassInfo:
    restartable: bool  # restarting the same code on the same nodes can help
    suspect_node: bool  # the failing rank's node is suspect (exclude it when it repeats)
    secondary: bool = False  # a symptom of another rank's failure
    bad_node: bool = False  # the node is bad at once: exclude it without waiting for a repeat


CLASS_INFO: dict[FailureClass, ClassInfo] = {
    FailureClass.NCCL_TIMEOUT: ClassInfo(True, True),
    FailureClass.NCCL_ERROR: ClassInfo(True, True),
    FailureClass.NCCL_SYNC: ClassInfo(True, True),
    FailureClass.WATCHDOG_STUCK: ClassInfo(True, True),
    FailureClass.HANG: ClassInfo(True, True),
    FailureClass.RANK_CRASH: ClassInfo(True, False),
    FailureClass.GPU_OOM: ClassInfo(False, False),
    FailureClass.HOST_OOM: ClassInfo(False, False),
    FailureClass.USER_ERROR: ClassInfo(True, False),  # may be transient; a crash loop stops it
    FailureClass.CONFIG_ERROR: ClassInfo(False, False),
    FailureClass.TIME_LIMIT: ClassInfo(False, False),
    FailureClass.PREEMPTION: ClassInfo(False, False),
    FailureClass.NODE_LOSS: ClassInfo(True, True),
    FailureClass.PEER_FAILURE: ClassInfo(True, False, secondary=True),
    FailureClass.PREFLIGHT: ClassInfo(True, True, bad_node=True),
    FailureClass.GPU_FAULT: ClassInfo(True, True, bad_node=True),  # out on the first one
    FailureClass.CUDA_ERROR: ClassInfo(True, True),
    # Not bad_node: slow is not broken (its own load, a neighbour's job), so it never leaves a
    # requeue's node list; it only gives its slot to a spare when one is there (policy.decide).
    FailureClass.STRAGGLER: ClassInfo(True, False),
}
