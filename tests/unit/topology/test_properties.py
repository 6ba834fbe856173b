"""Property tests on random machines: the planner's invariants hold on layouts nobody wrote down."""

from __future__ import annotations

import os
import random
import tempfile
from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slurmkit.topology import TopologyConfig, discover, plan_node
from slurmkit.topology.cpulist import format_cpulist
from slurmkit.topology.fake import FakeEth, FakeMachine, FakeNode, FakePort, write_tree
from slurmkit.topology.fake.machines import gpu, ib
from slurmkit.topology.fake.spec import smt_cpus, socket_distances
from slurmkit.topology.nics import _nearest
from slurmkit.topology.pcidist import path_distance


@st.composite
def machines(draw: st.DrawFn) -> FakeMachine:
    sockets = draw(st.integers(1, 2))
    per_socket = draw(st.integers(1, 3))
    cores_per_node = draw(st.integers(1, 6))
    threads = draw(st.integers(1, 2))
    n_nodes = sockets * per_socket
    cpus = smt_cpus(sockets, per_socket * cores_per_node, threads)
    nodes = []
    for n in range(n_nodes):
        ids = tuple(sorted(c.id for c in cpus if n * cores_per_node <= c.siblings[0] < (n + 1) * cores_per_node))
        nodes.append(FakeNode(n, ids, draw(st.sampled_from([0, 1 << 20, 1 << 20]))))
    if all(node.mem_kb == 0 for node in nodes):
        nodes[0] = FakeNode(0, nodes[0].cpus, 1 << 20)
    all_ids = [c.id for c in cpus]
    allowed = draw(st.sets(st.sampled_from(all_ids), min_size=1)) if draw(st.booleans()) else set(all_ids)
    switches = draw(st.integers(1, 5))
    parts = []
    for i in range(draw(st.integers(0, 8))):
        sw = draw(st.integers(0, switches - 1))
        numa = draw(st.sampled_from([*range(n_nodes), -1]))
        parts.append(gpu(0x10 * (sw + 1) + 8 + i, ("pci0000:%02x" % (0x10 * (sw + 1)), "0000:%02x:01.0" % (0x10 * (sw + 1))), numa, i, "G"))
    for k in range(draw(st.integers(0, 6))):
        sw = draw(st.integers(0, switches))  # switches = a NIC on its own root
        numa = draw(st.sampled_from(range(n_nodes)))
        state = draw(st.sampled_from(["4: ACTIVE", "4: ACTIVE", "1: DOWN"]))
        root = 0x10 * (sw + 1)
        parts.append(ib(f"mlx5_{k}", "0000:%02x:00.%d" % (root + 1, k % 8), ("pci0000:%02x" % root, "0000:%02x:01.0" % root), numa, ports=(FakePort(state),)))
    from slurmkit.topology.fake.spec import FakeGpu, FakeIb

    return FakeMachine(
        name="random",
        cpus=cpus,
        nodes=tuple(nodes),
        distances=socket_distances(n_nodes, per_socket, 12, 32),
        pci=tuple(p for p, _ in parts),
        gpus=tuple(x for _, x in parts if isinstance(x, FakeGpu)),
        ibs=tuple(x for _, x in parts if isinstance(x, FakeIb)),
        eths=(FakeEth("lo"),),
        allowed_cpus=format_cpulist(allowed),
        allowed_mems=format_cpulist(n.id for n in nodes),
    )


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(machines(), st.integers(1, 20), st.sampled_from(["pci", "cpu_first"]), st.randoms(use_true_random=False))
def test_planner_invariants(machine: FakeMachine, local_size: int, order: str, rng: random.Random) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = write_tree(machine, tmp)
        topo = discover(root)

        def shuffled(path: str) -> list[str]:
            names = os.listdir(path)
            rng.shuffle(names)
            return names

        cfg = TopologyConfig(gpu_order=order)
        plans = plan_node(topo, local_size, cfg)
        assert plan_node(discover(root, listdir=shuffled), local_size, cfg) == plans
    allowed = set(topo.allowed_cpus)
    assert len(plans) == local_size
    for p in plans:
        assert p.cpus and set(p.cpus) <= allowed and p.cores >= 1
        for node_id in p.mem_nodes:
            node = topo.node(node_id)
            assert node is not None and node.has_memory and node_id in topo.allowed_mems
        if topo.gpus:
            assert p.gpus
    if local_size <= len(allowed):
        flat = [c for p in plans for c in p.cpus]
        assert len(flat) == len(set(flat)), "exclusive slices overlap"
    else:
        assert any("round-robin" in w for w in plans[0].warnings)
    # Every GPU's NIC is one of its nearest NICs when all NICs are up.
    by_bus = {g.bdf: g for g in topo.gpus}
    nics = {n.name: n for n in topo.nics}
    if all(n.active_ports for n in topo.nics):
        for p in plans:
            for bus, name in zip(p.gpus, p.nics):
                assert nics[name] in _nearest(topo, by_bus[bus], list(topo.nics))


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 8), st.integers(1, 6), st.integers(1, 16))
def test_nic_load_is_balanced_within_one_when_all_nics_are_equally_near(
    n_gpus: int, n_nics: int, local_size: int
) -> None:
    cpus = smt_cpus(1, 16, 1)
    parts = [gpu(0x20 + i, ("pci0000:10", "0000:10:01.0"), 0, i, "G") for i in range(n_gpus)]
    parts += [ib(f"mlx5_{k}", "0000:%02x:00.0" % (0x80 - k), ("pci0000:70", "0000:70:01.0"), 0) for k in range(n_nics)]
    from slurmkit.topology.fake.spec import FakeGpu, FakeIb

    machine = FakeMachine(
        name="flat", cpus=cpus, nodes=(FakeNode(0, tuple(range(16)), 1 << 20),), distances=((10,),),
        pci=tuple(p for p, _ in parts), gpus=tuple(x for _, x in parts if isinstance(x, FakeGpu)),
        ibs=tuple(x for _, x in parts if isinstance(x, FakeIb)), allowed_cpus="0-15",
    )
    with tempfile.TemporaryDirectory() as tmp:
        topo = discover(write_tree(machine, tmp))
    plans = plan_node(topo, local_size, TopologyConfig())
    per_gpu = {bus: nic for p in plans for bus, nic in zip(p.gpus, p.nics)}
    load = Counter(per_gpu.values())
    counts = [load.get(f"mlx5_{k}", 0) for k in range(n_nics)]
    assert max(counts) - min(counts) <= 1 or len(per_gpu) < n_nics and max(counts) == 1
    g0 = topo.gpus[0]
    assert {path_distance(g0.pci_path, n.pci_path, 0, 0, topo) for n in topo.nics} == {
        path_distance(g0.pci_path, topo.nics[0].pci_path, 0, 0, topo)
    }
