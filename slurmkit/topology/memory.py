"""Which NUMA memory node(s) a rank's allocations go to."""

from __future__ import annotations

from .model import NodeTopology


def memory_nodes(topo: NodeTopology, home: int, mode: str) -> tuple[int, ...]:
    """Memory nodes for ``mode``: the home node, or the nearest allowed node with memory.

    Never a CPU-less node (HBM, CXL or GPU memory exposed as NUMA) unless it is the only memory
    the task may use. ``interleave`` spreads over every allowed node with memory and CPUs.
    """
    if mode == "none":
        return ()
    allowed = set(topo.allowed_mems)
    candidates = [n for n in topo.nodes if n.id in allowed and n.has_memory and n.has_cpus]
    if not candidates:
        candidates = [n for n in topo.nodes if n.id in allowed and n.has_memory]
    if not candidates:
        return ()
    if mode == "interleave":
        return tuple(sorted(n.id for n in candidates))
    if home < 0:
        return (min(n.id for n in candidates),) if len(candidates) == 1 else ()
    best = min(candidates, key=lambda n: (topo.distance(home, n.id), n.id))
    return (best.id,)
