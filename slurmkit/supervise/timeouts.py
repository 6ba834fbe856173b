"""PyTorch/NCCL failure-handling variables, the agents' liveness timing, and a check that all
timeouts fit together.

Set by the node agent for every rank, never over a value the user set. The check runs at
submit (errors) and in the agent (warnings): the supervisor's hang detection must fire before
the process group's own timeout, and the time-limit warning must leave room for a final
checkpoint before Slurm's SIGKILL.

Liveness scales with the job: the agents' beat interval grows with N so that all beats
together stay under :data:`MAX_BEATS_PER_S` on node 0's store, and an agent is suspect after
:data:`KEEPALIVE_MISSES` missed beats at the interval node 0 measured for it (torchrun's
keep-alive is one beat every 5 s, 3 misses), never sooner than ``supervisor.node_timeout_s``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from slurmkit.config.schema import SlurmkitConfig
from slurmkit.errors import ConfigError
from slurmkit.runfiles import NCCL_TRACE_DIR


def failure_env(cfg: SlurmkitConfig, run_dir: str, base: Mapping[str, str]) -> dict[str, str]:
    """Variables to add for a rank (those already in ``base`` are left alone)."""
    pg_timeout = int(cfg.parallel.pg_timeout_s)
    wanted = {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
        # The flight recorder's ring buffer (torch >= 2.7 name; the old
        # TORCH_NCCL_TRACE_BUFFER_SIZE is deprecated and, if set, counts as the user's choice).
        "TORCH_FR_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        # Where the flight recorder's dumps go, under both names: torch >= 2.7 reads
        # TORCH_FR_DUMP_TEMP_FILE, older releases the TORCH_NCCL_ one.
        "TORCH_FR_DUMP_TEMP_FILE": os.path.join(run_dir, NCCL_TRACE_DIR, "rank_"),
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": os.path.join(run_dir, NCCL_TRACE_DIR, "rank_"),
        "TORCH_NCCL_PROPAGATE_ERROR": "1",
        # The watchdog's own heartbeat: longer than a collective may legally take.
        "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": str(max(480, pg_timeout + 60)),
    }
    if "NCCL_ASYNC_ERROR_HANDLING" in base:  # the old name counts as the user's choice
        wanted.pop("TORCH_NCCL_ASYNC_ERROR_HANDLING")
    if "TORCH_NCCL_TRACE_BUFFER_SIZE" in base:
        wanted.pop("TORCH_FR_BUFFER_SIZE")
    for new_name, old_name in (("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"),):
        if new_name in base or old_name in base:  # either name set by the user is their choice
            wanted.pop(new_name)
            wanted.pop(old_name)
    return {k: v for k, v in wanted.items() if k not in base}


KEEPALIVE_MISSES = 3
MAX_BEATS_PER_S = 2000.0  # all agents' beats together, on node 0's store
MAX_BEAT_INTERVAL_S = 5.0  # torchrun's keep-alive interval: slower would detect too late


def beat_interval_s(n_nodes: int, poll_interval_s: float) -> float:
    """How often each agent beats: every poll, or slower when N agents would flood the store."""
    return min(max(poll_interval_s, n_nodes / MAX_BEATS_PER_S), max(poll_interval_s, MAX_BEAT_INTERVAL_S))


def liveness_deadline_s(measured_interval_s: float, floor_s: float) -> float:
    """Silence after which an agent is suspect: 3 missed beats at its measured interval (which
    grew with N, see beat_interval_s), plus one interval of slack for node 0's own poll; at
    least ``floor_s``."""
    return max(floor_s, (KEEPALIVE_MISSES + 1) * measured_interval_s)


def check_timeouts(cfg: SlurmkitConfig) -> None:
    """Raise ConfigError when the timeouts contradict each other."""
    sup, pg = cfg.supervisor, cfg.parallel.pg_timeout_s
    if sup.heartbeat_timeout_s >= pg:
        raise ConfigError(
            f"supervisor.heartbeat_timeout_s={sup.heartbeat_timeout_s:g} >= parallel.pg_timeout_s={pg:g}",
            "the supervisor's hang detection fires before the process group's collective timeout "
            "(else a hang is only seen as a NCCL timeout, minutes later)",
            f"set supervisor.heartbeat_timeout_s below {pg:g} (e.g. {min(60.0, pg / 2):g})")
    lead, poll, kill_wait = cfg.job.signal_lead_s, sup.poll_interval_s, cfg.cluster.kill_wait_s
    if cfg.job.requeue and lead < poll * 4:
        # The fix names a value that passes this check: a fixed "120" fails when polls are slow.
        raise ConfigError(
            f"job.signal_lead_s={lead} with job.requeue=true and supervisor.poll_interval_s={poll:g}",
            "a time-limit warning at least 4 supervisor polls before the end, early enough to "
            "reach the ranks and save a final checkpoint",
            f"set job.signal_lead_s={max(120, _ceil(poll * 4))} or more")
    if cfg.job.requeue and lead + kill_wait < 2 * poll + 5:
        raise ConfigError(
            f"job.signal_lead_s={lead} + cluster.kill_wait_s={kill_wait} < "
            f"2 * supervisor.poll_interval_s + 5 s = {2 * poll + 5:g} s",
            "enough time between the warning and SIGKILL for one step and a checkpoint snapshot",
            f"set job.signal_lead_s={max(120, _ceil(2 * poll + 5 - kill_wait))} or more")


def _ceil(seconds: float) -> int:
    return int(-(-seconds // 1))
