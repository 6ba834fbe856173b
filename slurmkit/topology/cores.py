"""Splitting the allowed CPUs between local ranks: exclusive slices near each rank's home node.

A "unit" is what is never split between ranks: the allowed hardware threads of one physical
core (SMT siblings together) or a single CPU when siblings may be separated.
"""

from __future__ import annotations

from collections import Counter

from .model import NodeTopology

Unit = tuple[int, ...]


def build_units(topo: NodeTopology, keep_smt: bool) -> list[Unit]:
    """Allowed online CPUs grouped by physical core, ordered by their lowest CPU id."""
    allowed = set(topo.allowed_cpus)
    groups: dict[tuple[int, ...], list[int]] = {}
    for cpu in topo.cpus:
        if not cpu.online or cpu.id not in allowed:
            continue
        key = tuple(cpu.siblings) if keep_smt else (cpu.id,)
        groups.setdefault(key, []).append(cpu.id)
    return sorted((tuple(sorted(g)) for g in groups.values()), key=lambda u: u[0])


def split_fair(units: list[Unit], parts: int) -> list[list[Unit]]:
    """Contiguous slices whose sizes differ by at most one, the larger ones first."""
    size, extra = divmod(len(units), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + size + (1 if i < extra else 0)
        out.append(units[start:end])
        start = end
    return out


def majority_node(topo: NodeTopology, cpus: tuple[int, ...]) -> int:
    """The NUMA node holding most of ``cpus`` (lowest id on a tie), -1 for none."""
    node_of = {c.id: c.node for c in topo.cpus}
    counts = Counter(node_of.get(c, -1) for c in cpus)
    counts.pop(-1, None)
    if not counts:
        return -1
    return min(counts, key=lambda n: (-counts[n], n))


def exclusive_slices(
    topo: NodeTopology, homes: list[int], keep_smt: bool
) -> tuple[list[tuple[int, ...]], list[str]]:
    """One disjoint CPU set per rank, taken from the rank's home NUMA node when it can be.

    ``homes[r]`` is rank r's preferred node (-1: none). A node is split fairly among the ranks
    homed on it; ranks that do not fit on their node move to the nearest node with spare cores;
    ranks without a home fill the spare cores, packed in node order. With more ranks than cores
    SMT siblings are split, and with more ranks than CPUs the CPUs are shared round-robin.
    """
    warnings: list[str] = []
    units = build_units(topo, keep_smt)
    if len(homes) > len(units) and keep_smt:
        threads = build_units(topo, keep_smt=False)
        if len(threads) > len(units):
            warnings.append(
                f"{len(homes)} ranks but {len(units)} allowed cores: SMT siblings split "
                "between ranks"
            )
        units = threads
    if len(homes) > len(units):
        cpus = [u[0] for u in units]
        warnings.append(
            f"{len(homes)} ranks but {len(cpus)} allowed CPUs: CPUs shared round-robin, "
            "ranks are not exclusive"
        )
        return [(cpus[r % len(cpus)],) for r in range(len(homes))], warnings
    by_node: dict[int, list[Unit]] = {}
    for unit in units:
        by_node.setdefault(majority_node(topo, unit), []).append(unit)
    if all(h < 0 for h in homes) and len(homes) < len(by_node):
        # Fewer ranks than nodes and no GPU to anchor them: each rank takes whole nodes.
        groups = split_fair([(n,) for n in sorted(by_node)], len(homes))
        return [tuple(sorted(c for (n,) in g for u in by_node[n] for c in u)) for g in groups], warnings
    placed = _place_ranks(topo, homes, {n: len(u) for n, u in by_node.items()})
    slices: list[tuple[int, ...]] = [() for _ in homes]
    for node, ranks in placed.items():
        for rank, chunk in zip(ranks, split_fair(by_node[node], len(ranks))):
            slices[rank] = tuple(sorted(c for unit in chunk for c in unit))
    return slices, warnings


def _place_ranks(topo: NodeTopology, homes: list[int], cap: dict[int, int]) -> dict[int, list[int]]:
    """Node -> the ranks (in rank order) that take their cores from it. Needs len(homes) <= cores."""
    placed: dict[int, list[int]] = {n: [] for n in cap}
    movers: list[int] = []
    homeless: list[int] = []
    for rank, home in enumerate(homes):
        if home < 0:
            homeless.append(rank)
        elif home in cap and len(placed[home]) < cap[home]:
            placed[home].append(rank)
        else:
            movers.append(rank)
    spare = {n: cap[n] - len(placed[n]) for n in cap}
    for rank in movers:
        home = homes[rank]
        node = min((n for n in spare if spare[n] > 0), key=lambda n: (topo.distance(home, n), n))
        placed[node].append(rank)
        spare[node] -= 1
    # Ranks without a home spread over the nodes in proportion to their spare cores, then are
    # packed in node order so that neighbouring ranks share a node.
    targets: list[int] = []
    for _ in homeless:
        node = max(
            (n for n in spare if spare[n] > 0),
            key=lambda n: (cap[n] / (len(placed[n]) + targets.count(n) + 1), -n),
        )
        targets.append(node)
        spare[node] -= 1
    for rank, node in zip(homeless, sorted(targets)):
        placed[node].append(rank)
    return {n: sorted(r) for n, r in placed.items() if r}


def widen(topo: NodeTopology, cpus: tuple[int, ...], mode: str) -> tuple[int, ...]:
    """For cpu_mode numa/socket: every allowed CPU of the nodes/packages ``cpus`` touch."""
    allowed = set(topo.allowed_cpus)
    info = {c.id: c for c in topo.cpus}
    if mode == "numa":
        nodes = {info[c].node for c in cpus if c in info}
        return tuple(sorted(c for c in allowed if c in info and info[c].node in nodes))
    packages = {info[c].package_id for c in cpus if c in info}
    return tuple(sorted(c for c in allowed if c in info and info[c].package_id in packages))


def physical_cores(topo: NodeTopology, cpus: tuple[int, ...]) -> int:
    """Number of distinct physical cores among ``cpus`` (at least 1 when cpus is not empty)."""
    info = {c.id: c for c in topo.cpus}
    cores = {tuple(info[c].siblings) if c in info else (c,) for c in cpus}
    return len(cores)
