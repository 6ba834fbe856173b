"""Synthetic edge cases: machines the planner has never seen."""

from __future__ import annotations

import dataclasses
import os

from slurmkit.topology import TopologyConfig, discover, plan_node, rank_env
from slurmkit.topology.cpulist import format_cpulist
from slurmkit.topology.fake import FakeNode, FakePort
from slurmkit.topology.fake.spec import nodes_by_range, smt_cpus

from .trees import modify, plans_of, summary, topo_of, tree

CFG = TopologyConfig()


def _disjoint(plans) -> bool:
    seen: set[int] = set()
    for p in plans:
        if seen & set(p.cpus):
            return False
        seen |= set(p.cpus)
    return True


def test_smt_off(tmp_path):
    def change(m):
        cpus = smt_cpus(2, 56, 1)
        return {"cpus": cpus, "nodes": nodes_by_range(cpus, 56, 2, 1 << 30), "allowed_cpus": "0-111"}

    plans = plans_of(str(tmp_path), modify("dgx_h100", change), 8)
    assert [format_cpulist(p.cpus) for p in plans][:2] == ["0-13", "14-27"]
    assert format_cpulist(plans[4].cpus) == "56-69" and plans[4].cores == 14


def test_offline_cpus_are_never_planned(tmp_path):
    spec = modify("dgx_h100", lambda m: {"offline": frozenset({5, 117, 6})})
    topo = discover(tree(str(tmp_path), spec))
    assert 5 not in topo.online_cpus and 6 not in topo.online_cpus
    plans = plan_node(topo, 8, CFG)
    used = {c for p in plans for c in p.cpus}
    assert not used & {5, 117, 6}
    assert 118 in used  # the online sibling of offline CPU 6 is still a usable core
    assert _disjoint(plans)
    assert sorted(p.cores for p in plans[:4]) == [13, 14, 14, 14]


def test_numa_node_unknown_falls_back_to_local_cpulist(tmp_path):
    def change(m):
        pci = []
        for d in m.pci:
            if d.driver == "nvidia" and d.pci_class == 0x030200:
                node = next(n for n in m.nodes if n.id == d.numa_node)
                d = dataclasses.replace(d, numa_node=-1, local_cpulist=format_cpulist(node.cpus))
            pci.append(d)
        return {"pci": tuple(pci)}

    topo = topo_of(str(tmp_path), modify("dgx_h100", change))
    assert [g.numa_node for g in topo.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_numa_node_unknown_everywhere_still_fair(tmp_path):
    def change(m):
        return {"pci": tuple(dataclasses.replace(d, numa_node=-1) for d in m.pci)}

    topo = topo_of(str(tmp_path), modify("dgx_h100", change))
    assert all(g.numa_node == -1 for g in topo.gpus)
    plans = plan_node(topo, 8, CFG)
    assert _disjoint(plans) and all(p.cores == 14 for p in plans)
    assert all(p.mem_nodes for p in plans)
    # PCI paths still pair each GPU with the NIC on its switch.
    assert [p.nics[0] for p in plans] == ["mlx5_0", "mlx5_3", "mlx5_4", "mlx5_5", "mlx5_6", "mlx5_9", "mlx5_10", "mlx5_11"]


def test_memoryless_and_cpuless_nodes(tmp_path):
    def change(m):
        n0, n1 = m.nodes
        cxl = FakeNode(2, (), 1 << 30)  # CPU-less memory (CXL/HBM): never a preferred node
        return {
            "nodes": (n0, FakeNode(1, n1.cpus, 0), cxl),
            "distances": ((10, 21, 14), (21, 10, 14), (14, 14, 10)),
            "allowed_mems": "0-2",
        }

    plans = plans_of(str(tmp_path), modify("dgx_h100", change), 8)
    assert [p.mem_nodes for p in plans] == [(0,)] * 8
    inter = plans_of(str(tmp_path), modify("dgx_h100", change), 8, TopologyConfig(mem_mode="interleave"))
    assert inter[0].mem_nodes == (0,)


def test_half_node_allowed_by_cgroup(tmp_path):
    spec = modify("dgx_h100", lambda m: {"allowed_cpus": "0-55,112-167", "allowed_mems": "0"})
    plans = plans_of(str(tmp_path), spec, 8)
    node0 = set(range(0, 56)) | set(range(112, 168))
    assert all(set(p.cpus) <= node0 for p in plans)
    assert _disjoint(plans) and [p.cores for p in plans] == [7] * 8
    assert [p.mem_nodes for p in plans] == [(0,)] * 8
    assert plans[4].nics == ("mlx5_6",)  # the GPU and NIC do not move with the cores


def test_fewer_cores_than_gpus_on_a_node(tmp_path):
    spec = modify("dgx_h100", lambda m: {"allowed_cpus": "0-1,112-113,56-111,168-223"})
    plans = plans_of(str(tmp_path), spec, 8)
    assert format_cpulist(plans[0].cpus) == "0,112" and format_cpulist(plans[1].cpus) == "1,113"
    node1 = set(range(56, 112)) | set(range(168, 224))
    assert all(set(p.cpus) <= node1 for p in plans[2:])
    assert _disjoint(plans)
    assert sum(p.cores for p in plans[2:]) == 56


def test_two_ranks_per_gpu(tmp_path):
    plans = plans_of(str(tmp_path), "dgx_h100", 16)
    assert [p.gpus[0] for p in plans[:4]] == ["0000:1b:00.0"] * 2 + ["0000:43:00.0"] * 2
    assert [p.cores for p in plans] == [7] * 16 and _disjoint(plans)
    assert plans[0].nics == plans[1].nics == ("mlx5_0",)
    env = rank_env(plans[1], plans, {}, CFG)
    assert env["CUDA_VISIBLE_DEVICES"] == "0"


def test_fewer_ranks_than_gpus(tmp_path):
    plans = plans_of(str(tmp_path), "dgx_h100", 2)
    assert plans[0].gpu_indices == (0, 1, 2, 3) and plans[1].gpu_indices == (4, 5, 6, 7)
    assert plans[0].cores == 56 and plans[0].nics == ("mlx5_0", "mlx5_3", "mlx5_4", "mlx5_5")
    assert rank_env(plans[0], plans, {}, CFG)["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"


def test_nic_port_down_falls_back_to_a_gpu_nic_not_storage(tmp_path):
    def change(m):
        ibs = tuple(
            dataclasses.replace(i, ports=(FakePort("1: DOWN"),)) if i.name == "mlx5_3" else i for i in m.ibs
        )
        return {"ibs": ibs}

    plans = plans_of(str(tmp_path), modify("dgx_h100", change), 8)
    assert plans[1].nics == ("mlx5_0",)
    hca = rank_env(plans[0], plans, {}, CFG)["NCCL_IB_HCA"]
    assert hca == "=mlx5_0,mlx5_4,mlx5_5,mlx5_6,mlx5_9,mlx5_10,mlx5_11"
    assert any("mlx5_3" in w and "no active port" in w for w in plans[0].warnings)


def test_prebound_slurm_mask_is_respected(tmp_path):
    spec = modify("dgx_h100", lambda m: {"allowed_cpus": "56-69,168-181"})
    topo = discover(tree(str(tmp_path), spec))
    env = {"SLURM_CPU_BIND_TYPE": "mask_cpu:", "SLURM_CPU_BIND_LIST": "0x3fff", "SLURM_JOB_ID": "7"}
    (plan,) = plan_node(topo, 1, CFG, env)
    assert format_cpulist(plan.cpus) == "56-69,168-181"
    assert plan.gpus == ("0000:9d:00.0",) and plan.nics == ("mlx5_6",) and plan.mem_nodes == (1,)
    # Without Slurm's word the PCI order would have handed out GPU0, far from these cores.
    (unbound,) = plan_node(topo, 1, CFG, {})
    assert unbound.gpu_indices[0] == 0 and set(unbound.cpus) == set(plan.cpus)


def test_cpu_first_order_takes_gpus_near_the_cores(tmp_path):
    spec = modify("dgx_h100", lambda m: {"allowed_cpus": "56-111,168-223"})
    plans = plans_of(str(tmp_path), spec, 4, TopologyConfig(gpu_order="cpu_first"))
    assert [p.gpu_indices for p in plans] == [(4,), (5,), (6,), (7,)]
    full = plans_of(str(tmp_path), "dgx_h100", 8, TopologyConfig(gpu_order="cpu_first"))
    assert summary(full) == summary(plans_of(str(tmp_path), "dgx_h100", 8))


def test_gpus_found_by_pci_class_without_the_driver(tmp_path):
    spec = modify("dgx_h100", lambda m: {"nvidia_proc": False})
    topo = topo_of(str(tmp_path), spec)
    assert len(topo.gpus) == 8 and topo.gpus[0].uuid == "" and topo.gpus[0].minor == -1
    assert summary(plan_node(topo, 8, CFG)) == summary(plans_of(str(tmp_path), "dgx_h100", 8))


def test_missing_status_means_every_online_cpu(tmp_path):
    spec = modify("dgx_a100", lambda m: {"allowed_cpus": None, "offline": frozenset({255})})
    topo = topo_of(str(tmp_path), spec)
    assert topo.allowed_cpus == tuple(range(255)) and topo.allowed_mems == tuple(range(8))
    assert any("status" in n for n in topo.notes)


def test_kernel_without_numa(tmp_path):
    spec = modify("cpu_only", lambda m: {"numa_in_sysfs": False})
    topo = topo_of(str(tmp_path), spec)
    assert [n.id for n in topo.nodes] == [0] and len(topo.nodes[0].cpus) == 32
    plans = plan_node(topo, 4, CFG)
    assert _disjoint(plans) and [p.cores for p in plans] == [4] * 4


def test_cpu_only_node_gets_fair_slices_and_no_gpu_or_nic_variables(tmp_path):
    plans = plans_of(str(tmp_path), "cpu_only", 4)
    assert [format_cpulist(p.cpus) for p in plans] == ["0-3,16-19", "4-7,20-23", "8-11,24-27", "12-15,28-31"]
    assert [p.mem_nodes for p in plans] == [(0,), (0,), (1,), (1,)]
    env = rank_env(plans[2], plans, {}, CFG)
    assert not {"CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "NCCL_IB_HCA", "UCX_NET_DEVICES",
                "SLURMKIT_GPUS", "SLURMKIT_NICS"} & set(env)
    assert env["OMP_NUM_THREADS"] == "4" and env["SLURMKIT_MEM_NODES"] == "1"


def test_more_ranks_than_cpus_share_round_robin(tmp_path):
    def change(m):
        cpus = smt_cpus(1, 2, 1)
        return {"cpus": cpus, "nodes": nodes_by_range(cpus, 2, 1, 1 << 20),
                "distances": ((10,),), "allowed_cpus": "0-1", "allowed_mems": "0"}

    plans = plans_of(str(tmp_path), modify("cpu_only", change), 5)
    assert [p.cpus for p in plans] == [(0,), (1,), (0,), (1,), (0,)]
    assert all(any("round-robin" in w for w in p.warnings) for p in plans)
    assert [p.cores for p in plans] == [1] * 5


def test_flat_vm_uses_nccl_topology_xml(tmp_path):
    root = tree(str(tmp_path), "flat_vm")
    plain = plan_node(discover(root), 8, CFG)
    topo = discover(root, nccl_topo_file=os.path.join(root, "nccl-topo.xml"))
    assert [g.numa_node for g in topo.gpus] == [0, 0, 1, 1, 2, 2, 3, 3]
    plans = plan_node(topo, 8, CFG)
    assert [p.nics[0] for p in plans] == ["mlx5_4", "mlx5_5", "mlx5_6", "mlx5_7", "mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"]
    assert [p.nics[0] for p in plain] != [p.nics[0] for p in plans]
    assert format_cpulist(plans[1].cpus) == "12-23" and plans[1].mem_nodes == (0,)


def test_cpu_mem_and_nic_modes(tmp_path):
    topo = topo_of(str(tmp_path), "dgx_h100")
    numa = plan_node(topo, 8, TopologyConfig(cpu_mode="numa"))
    assert format_cpulist(numa[1].cpus) == "0-55,112-167" and numa[1].cores == 56
    sock = plan_node(topo, 8, TopologyConfig(cpu_mode="socket"))
    assert format_cpulist(sock[5].cpus) == "56-111,168-223"
    none = plan_node(topo, 8, TopologyConfig(cpu_mode="none", mem_mode="none", nic_mode="none"))
    assert not none[0].bind_cpus and none[0].mem_nodes == () and none[0].nics == ()
    env = rank_env(none[0], none, {}, TopologyConfig())
    assert "NCCL_IB_HCA" not in env and env["SLURMKIT_CPU_BIND"] == "0"
    bind = plan_node(topo, 8, TopologyConfig(mem_mode="bind"))
    assert bind[6].mem_nodes == (1,) and bind[6].mem_mode == "bind"
    inter = plan_node(topo, 8, TopologyConfig(mem_mode="interleave"))
    assert inter[0].mem_nodes == (0, 1)
    every = plan_node(topo, 8, TopologyConfig(nic_mode="all"))
    assert len(every[0].nics) == 12  # every RDMA device, storage cards included: the user asked


def test_nic_include_and_exclude_patterns(tmp_path):
    topo = topo_of(str(tmp_path), "dgx_h100")
    only = plan_node(topo, 8, TopologyConfig(nic_include=["mlx5_0"]))
    assert {p.nics for p in only} == {("mlx5_0",)}
    assert rank_env(only[3], only, {}, CFG)["NCCL_IB_HCA"] == "=mlx5_0"
    eth = plan_node(topo, 8, TopologyConfig(nic_kinds=["eth"]))
    assert eth[0].nics == ("eno3",)
    env = rank_env(eth[0], eth, {}, CFG)
    assert env["NCCL_SOCKET_IFNAME"] == "=eno3" and "NCCL_IB_HCA" not in env


def test_user_values_are_never_overridden_and_efa_is_left_alone(tmp_path):
    plans = plans_of(str(tmp_path), "dgx_h100", 8)
    base = {"OMP_NUM_THREADS": "3", "NCCL_IB_HCA": "mlx5_0", "CUDA_VISIBLE_DEVICES": "7"}
    env = rank_env(plans[2], plans, base, CFG)
    assert not set(base) & set(env) and env["UCX_NET_DEVICES"] == "mlx5_4:1"
    efa = rank_env(plans[2], plans, {"FI_PROVIDER": "efa"}, CFG)
    assert "NCCL_IB_HCA" not in efa and "UCX_NET_DEVICES" not in efa
    efa_plans = [dataclasses.replace(p, nic_drivers=("efa",)) for p in plans]
    assert "NCCL_IB_HCA" not in rank_env(efa_plans[0], efa_plans, {}, CFG)
    assert rank_env(plans[0], plans, {}, TopologyConfig(enabled=False)) == {}
    assert "CUDA_VISIBLE_DEVICES" not in rank_env(plans[0], plans, {}, TopologyConfig(gpu_visibility="all"))


def test_single_gpu_cloud_vm_as_seen_on_a_real_h200_node(tmp_path):
    """Recorded on a real H200 VM: one node, 16 CPUs, GPU 0000:00:06.0 with numa_node -1."""
    from slurmkit.topology.fake import FakeMachine
    from slurmkit.topology.fake.machines import gpu

    cpus = smt_cpus(1, 16, 1)
    dev, g = gpu(0x00, ("pci0000:00",), -1, 0, "NVIDIA H200")
    dev = dataclasses.replace(dev, bdf="0000:00:06.0")
    g = dataclasses.replace(g, bdf="0000:00:06.0")
    spec = FakeMachine(
        name="h200_vm", cpus=cpus, nodes=(FakeNode(0, tuple(range(16)), 4550128),), distances=((10,),),
        pci=(dev,), gpus=(g,), allowed_cpus="0-15", allowed_mems="0",
    )
    topo = topo_of(str(tmp_path), spec)
    assert topo.gpus[0].numa_node == 0 and topo.gpus[0].minor == 0
    plans = plan_node(topo, 2, CFG)
    assert [format_cpulist(p.cpus) for p in plans] == ["0-7", "8-15"]
    env = rank_env(plans[1], plans, {}, CFG)
    assert env["CUDA_VISIBLE_DEVICES"] == "0" and env["OMP_NUM_THREADS"] == "8" and "NCCL_IB_HCA" not in env
