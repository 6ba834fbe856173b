"""Exec wrapper: ``python -m slurmkit.topology.pin --plan-json JSON -- cmd args...``.

Applies the plan to itself (affinity, memory policy), checks it, then replaces itself with the
command, which inherits both. With numactl present (and --method auto/numactl) the memory
policy is set by exec'ing numactl in front of the command instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import shutil
import sys

from slurmkit.errors import SlurmkitError

from .apply import PinningError, apply_plan, verify_current
from .config import TopologyConfig
from .cpulist import format_cpulist
from .rankplan import RankPlan

log = logging.getLogger("slurmkit.topology.pin")

_NUMACTL_MEM = {"preferred": "--preferred", "bind": "--membind", "interleave": "--interleave"}


def numactl_prefix(plan: RankPlan, numactl: str) -> list[str]:
    """numactl arguments for the plan's memory policy (CPU affinity is already set)."""
    args = [numactl]
    if plan.mem_mode in _NUMACTL_MEM and plan.mem_nodes:
        nodes = format_cpulist(plan.mem_nodes)
        args.append(f"{_NUMACTL_MEM[plan.mem_mode]}={nodes}")
    return [*args, "--"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m slurmkit.topology.pin")
    parser.add_argument("--plan-json", required=True, help="RankPlan.to_json() of this rank")
    # topology.verify and topology.apply_method: the schema's choices and defaults
    parser.add_argument("--verify", choices=TopologyConfig.CHOICES["verify"], default=TopologyConfig.verify)
    parser.add_argument("--method", choices=TopologyConfig.CHOICES["apply_method"],
                        default=TopologyConfig.apply_method)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command after --")
    logging.basicConfig(level=logging.INFO, format="slurmkit.pin: %(message)s")
    try:
        plan = RankPlan.from_json(args.plan_json)
        numactl = shutil.which("numactl") if args.method != "syscall" else None
        if args.method == "numactl" and numactl is None:
            raise PinningError("--method numactl but numactl is not on PATH")
        if numactl:
            # numactl sets the memory policy at exec; only the affinity is applied here.
            apply_plan(dataclasses.replace(plan, mem_mode="none"))
            problems = verify_current(dataclasses.replace(plan, mem_mode="none"))
            command = [*numactl_prefix(plan, numactl), *command]
        else:
            apply_plan(plan)
            problems = verify_current(plan)
        report_problems(problems, args.verify)
    except (SlurmkitError, OSError) as exc:
        print(f"slurmkit.pin: {exc}", file=sys.stderr)
        return 2
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        print(f"slurmkit.pin: cannot run {command[0]!r}: {exc.strerror}", file=sys.stderr)
        return 127
    return 0  # not reached: execvp replaces the process


def report_problems(problems: list[str], verify: str) -> None:
    """What ``topology.verify`` asks for differences from the plan: raise, warn, or nothing."""
    if problems and verify == "fail":
        raise PinningError("pinning differs from the plan: " + "; ".join(problems))
    if verify == "warn":
        for problem in problems:
            log.warning("%s", problem)


if __name__ == "__main__":
    sys.exit(main())
