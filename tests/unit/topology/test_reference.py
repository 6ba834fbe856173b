"""The real machines of shared/reference/topologies.md, planned exactly as the reference says."""

from __future__ import annotations

import pytest

from slurmkit.topology import TopologyConfig, plan_node, rank_env

from .trees import plans_of, summary, topo_of

H100 = [
    ("0000:1b:00.0", "0-13,112-125", (0,), ("mlx5_0",)),
    ("0000:43:00.0", "14-27,126-139", (0,), ("mlx5_3",)),
    ("0000:52:00.0", "28-41,140-153", (0,), ("mlx5_4",)),
    ("0000:61:00.0", "42-55,154-167", (0,), ("mlx5_5",)),
    ("0000:9d:00.0", "56-69,168-181", (1,), ("mlx5_6",)),
    ("0000:c3:00.0", "70-83,182-195", (1,), ("mlx5_9",)),
    ("0000:d1:00.0", "84-97,196-209", (1,), ("mlx5_10",)),
    ("0000:df:00.0", "98-111,210-223", (1,), ("mlx5_11",)),
]
H100_HCA = "=mlx5_0,mlx5_3,mlx5_4,mlx5_5,mlx5_6,mlx5_9,mlx5_10,mlx5_11"

A100 = [
    ("0000:07:00.0", "48-55,176-183", (3,), ("mlx5_0",)),
    ("0000:0f:00.0", "56-63,184-191", (3,), ("mlx5_1",)),
    ("0000:47:00.0", "16-23,144-151", (1,), ("mlx5_2",)),
    ("0000:4e:00.0", "24-31,152-159", (1,), ("mlx5_3",)),
    ("0000:87:00.0", "112-119,240-247", (7,), ("mlx5_6",)),
    ("0000:90:00.0", "120-127,248-255", (7,), ("mlx5_7",)),
    ("0000:b7:00.0", "80-87,208-215", (5,), ("mlx5_8",)),
    ("0000:bd:00.0", "88-95,216-223", (5,), ("mlx5_9",)),
]

# (a): GPU0..3 PIX to NIC3..0, GPU4/5 PIX to NIC5/NIC4; GPU6/7 have only NODE-distance NICs
# (mlx5_6..9, numbered in reverse of their PCI addresses): the tie goes to the lowest address.
REVERSE_NICS = ["mlx5_3", "mlx5_2", "mlx5_1", "mlx5_0", "mlx5_5", "mlx5_4", "mlx5_9", "mlx5_8"]

NPS4 = [
    ("0000:05:00.0", "24-27,88-91", (3,), ("mlx5_1",)),
    ("0000:06:00.0", "28-31,92-95", (3,), ("mlx5_1",)),
    ("0000:45:00.0", "8-11,72-75", (1,), ("mlx5_0",)),
    ("0000:46:00.0", "12-15,76-79", (1,), ("mlx5_0",)),
    ("0000:85:00.0", "56-59,120-123", (7,), ("mlx5_5",)),
    ("0000:86:00.0", "60-63,124-127", (7,), ("mlx5_5",)),
    ("0000:c5:00.0", "40-43,104-107", (5,), ("mlx5_2",)),
    ("0000:c6:00.0", "44-47,108-111", (5,), ("mlx5_2",)),
]


def test_dgx_h100_plan_is_the_reference(tmp_path):
    plans = plans_of(str(tmp_path), "dgx_h100", 8)
    assert summary(plans) == H100
    assert [p.cores for p in plans] == [14] * 8
    env = rank_env(plans[0], plans, {}, TopologyConfig())
    assert env["NCCL_IB_HCA"] == H100_HCA
    assert env["UCX_NET_DEVICES"] == "mlx5_0:1"
    assert env["CUDA_VISIBLE_DEVICES"] == "0"
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert env["OMP_NUM_THREADS"] == "14"
    assert env["SLURMKIT_CPUS"] == "0-13,112-125"
    assert env["SLURMKIT_MEM_NODES"] == "0"
    assert env["SLURMKIT_GPUS"] == "0000:1b:00.0"
    assert env["SLURMKIT_NICS"] == "mlx5_0"


def test_dgx_h100_storage_nics_never_selected(tmp_path):
    plans = plans_of(str(tmp_path), "dgx_h100", 8)
    used = {n for p in plans for n in p.nics}
    assert not used & {"mlx5_1", "mlx5_2", "mlx5_7", "mlx5_8"}
    # Even with every GPU sharing, storage cards stay out.
    plans16 = plans_of(str(tmp_path), "dgx_h100", 16)
    assert {n for p in plans16 for n in p.nics} == used


def test_dgx_h100_discovery(tmp_path):
    topo = topo_of(str(tmp_path), "dgx_h100")
    assert len(topo.gpus) == 8  # the four NVSwitches (class 0x0680) are not GPUs
    assert [g.minor for g in topo.gpus] == list(range(8))
    assert topo.gpus[0].uuid.startswith("GPU-")
    assert topo.gpus[0].pci_path[:3] == ("pci0000:15", "0000:15:01.0", "0000:16:00.0")
    assert len(topo.cpus) == 224 and topo.cpu(112).siblings == (0, 112)  # type: ignore[union-attr]
    mlx = {n.name: n for n in topo.nics}
    assert mlx["mlx5_1"].ports[0].link_layer == "Ethernet"
    assert mlx["mlx5_0"].netdevs == ("ibp24s0",)
    assert mlx["eno3"].kind == "eth" and mlx["eno3"].driver == "igb"
    assert "lo" not in mlx
    assert topo.distance(0, 1) == 21


def test_dgx_a100_plan_is_the_reference(tmp_path):
    plans = plans_of(str(tmp_path), "dgx_a100", 8)
    assert summary(plans) == A100
    env = rank_env(plans[3], plans, {}, TopologyConfig())
    assert env["NCCL_IB_HCA"] == "=mlx5_0,mlx5_1,mlx5_2,mlx5_3,mlx5_6,mlx5_7,mlx5_8,mlx5_9"
    # Half of the cores (NUMA 0, 2, 4, 6) are near no GPU and stay unused.
    used = {c for p in plans for c in p.cpus}
    assert not used & set(range(0, 16)) and not used & set(range(32, 48))


def test_awkward_reverse_nics_follow_pci_not_names(tmp_path):
    plans = plans_of(str(tmp_path), "awkward_reverse", 8)
    assert [p.nics[0] for p in plans] == REVERSE_NICS
    assert summary(plans)[0][1] == "0-13,112-125"


def test_awkward_nps4_two_gpus_share_their_nic(tmp_path):
    plans = plans_of(str(tmp_path), "awkward_nps4", 8)
    assert summary(plans) == NPS4
    env = rank_env(plans[0], plans, {}, TopologyConfig())
    assert env["NCCL_IB_HCA"] == "=mlx5_1,mlx5_0,mlx5_5,mlx5_2"
    assert "mlx5_3" not in env["NCCL_IB_HCA"] and "mlx5_4" not in env["NCCL_IB_HCA"]


@pytest.mark.parametrize("name", ["dgx_h100", "dgx_a100", "awkward_reverse", "awkward_nps4"])
def test_plan_does_not_depend_on_directory_order(tmp_path, name):
    import random

    root_plans = plans_of(str(tmp_path), name, 8)
    rng = random.Random(7)

    def shuffled(path: str) -> list[str]:
        import os

        names = os.listdir(path)
        rng.shuffle(names)
        return names

    topo = topo_of(str(tmp_path), name, listdir=shuffled)
    assert plan_node(topo, 8, TopologyConfig()) == root_plans
