"""Applying a RankPlan to the current process (before exec) and checking it from inside a rank."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Mapping

from slurmkit.errors import SlurmkitError

from .cpulist import format_cpulist, parse_cpulist
from .mempolicy import MemPolicyError, get_mempolicy, set_mempolicy
from .rankplan import RankPlan

log = logging.getLogger(__name__)

GetAffinity = Callable[[], set[int]]
GetMemPolicy = Callable[[], tuple[str, tuple[int, ...]]]


class PinningError(SlurmkitError):
    """The rank does not run where its plan says (verify=fail)."""


def _own_affinity() -> set[int]:
    return set(os.sched_getaffinity(0))


def apply_plan(plan: RankPlan) -> None:
    """Set this process's CPU affinity and NUMA memory policy to the plan.

    Meant for the child between fork and exec (subprocess ``preexec_fn``) or for the pin
    wrapper; both settings are inherited by the program that is exec'd next.
    """
    if plan.bind_cpus and plan.cpus:
        os.sched_setaffinity(0, plan.cpus)
    if plan.mem_mode != "none" and plan.mem_nodes:
        set_mempolicy(plan.mem_mode, plan.mem_nodes)


def verify_current(
    plan: RankPlan,
    get_affinity: GetAffinity = _own_affinity,
    get_policy: GetMemPolicy = get_mempolicy,
) -> list[str]:
    """Differences between the plan and what this process really has; [] when it matches."""
    return _check(
        plan.cpus if plan.bind_cpus else None, plan.mem_mode, plan.mem_nodes, get_affinity, get_policy
    )


def _check(
    cpus: tuple[int, ...] | None,
    mem_mode: str,
    mem_nodes: tuple[int, ...],
    get_affinity: GetAffinity,
    get_policy: GetMemPolicy,
) -> list[str]:
    problems = []
    if cpus is not None:
        actual = get_affinity()
        if actual != set(cpus):
            problems.append(
                f"CPU affinity is {format_cpulist(actual)} but the plan says {format_cpulist(cpus)}"
            )
    if mem_mode != "none" and mem_nodes:
        try:
            mode, nodes = get_policy()
        except MemPolicyError as exc:
            problems.append(f"cannot read the memory policy: {exc}")
        else:
            # An empty mask for "preferred" means "the local node": only compare real masks.
            if mode != mem_mode or (nodes and set(nodes) != set(mem_nodes)):
                problems.append(
                    f"memory policy is {mode} {list(nodes)} but the plan says "
                    f"{mem_mode} {list(mem_nodes)}"
                )
    return problems


def verify_from_env(
    environ: Mapping[str, str],
    mode: str = "warn",
    get_affinity: GetAffinity = _own_affinity,
    get_policy: GetMemPolicy = get_mempolicy,
) -> list[str]:
    """Called by the rank itself: compare its affinity and memory policy with SLURMKIT_*.

    ``mode`` "warn" logs each problem, "fail" raises PinningError, "off" only returns them.
    Returns [] when the rank was not started with a plan (no SLURMKIT_CPUS).
    """
    if "SLURMKIT_CPUS" not in environ:
        return []
    bind = environ.get("SLURMKIT_CPU_BIND", "1") != "0"
    cpus = parse_cpulist(environ["SLURMKIT_CPUS"]) if bind else None
    mem_nodes = parse_cpulist(environ.get("SLURMKIT_MEM_NODES", ""))
    problems = _check(
        cpus, environ.get("SLURMKIT_MEM_POLICY", "none"), mem_nodes, get_affinity, get_policy
    )
    if problems and mode == "fail":
        raise PinningError("pinning differs from the plan: " + "; ".join(problems))
    if mode == "warn":
        for problem in problems:
            log.warning("pinning differs from the plan: %s", problem)
    return problems


def pin_command(
    plan: RankPlan, argv: list[str], verify: str = "warn", method: str = "auto"
) -> list[str]:
    """``argv`` wrapped so that the pin wrapper applies the plan, verifies it, then execs.

    ``method``: "auto" (numactl for the memory policy when on PATH), "numactl" or "syscall".
    """
    return [
        sys.executable,
        "-m",
        "slurmkit.topology.pin",
        "--plan-json",
        plan.to_json(),
        "--verify",
        verify,
        "--method",
        method,
        "--",
        *argv,
    ]
