"""Helpers shared by the topology tests: write fake machines, tweak them, plan them."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

from slurmkit.topology import NodeTopology, RankPlan, TopologyConfig, discover, plan_node
from slurmkit.topology.cpulist import format_cpulist
from slurmkit.topology.fake import MACHINES, FakeMachine, write_tree

_counter = [0]


def tree(base: str, machine: FakeMachine | str) -> str:
    """Write ``machine`` (a FakeMachine or a name from MACHINES) under ``base``; returns root."""
    spec = MACHINES[machine]() if isinstance(machine, str) else machine
    _counter[0] += 1
    return write_tree(spec, os.path.join(base, f"{spec.name}-{_counter[0]}"))


def topo_of(base: str, machine: FakeMachine | str, **kw: object) -> NodeTopology:
    return discover(tree(base, machine), **kw)  # type: ignore[arg-type]


def plans_of(
    base: str, machine: FakeMachine | str, local_size: int, cfg: TopologyConfig | None = None
) -> list[RankPlan]:
    return plan_node(topo_of(base, machine), local_size, cfg or TopologyConfig())


def summary(plans: list[RankPlan]) -> list[tuple[str, str, tuple[int, ...], tuple[str, ...]]]:
    """(GPU bus, cpulist, memory nodes, NICs) per rank: the shape of the reference tables."""
    return [
        (",".join(p.gpus), format_cpulist(p.cpus), p.mem_nodes, p.nics) for p in plans
    ]


def modify(name: str, change: Callable[[FakeMachine], dict[str, object]]) -> FakeMachine:
    spec = MACHINES[name]()
    return dataclasses.replace(spec, **change(spec))  # type: ignore[arg-type]
