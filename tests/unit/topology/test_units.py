"""Small pure pieces: cpulists, bus ids, PCI distance, RankPlan JSON, config, srun arguments."""

from __future__ import annotations

import os

import pytest
from omegaconf import OmegaConf

from slurmkit.errors import ConfigError
from slurmkit.topology import RankPlan, TopologyConfig, slurm_prebound, srun_binding_args
from slurmkit.topology.cpulist import format_cpulist, normalize_bdf, parse_cpulist
from slurmkit.topology.enrich import parse_nccl_topo_xml
from slurmkit.topology.model import NodeTopology, NumaNode
from slurmkit.topology.pcidist import PathClass, path_distance


def test_cpulist_round_trip():
    assert parse_cpulist("0-3,8,10-11\n") == (0, 1, 2, 3, 8, 10, 11)
    assert parse_cpulist("0-7:2") == (0, 2, 4, 6)
    assert parse_cpulist("") == ()
    assert format_cpulist([11, 0, 1, 2, 8, 10]) == "0-2,8,10-11"
    with pytest.raises(ConfigError):
        parse_cpulist("0-x")


def test_bus_ids_are_normalised():
    assert normalize_bdf("00000000:1B:00.0") == "0000:1b:00.0"
    assert normalize_bdf("1b:00.0") == "0000:1b:00.0"
    with pytest.raises(ConfigError):
        normalize_bdf("nonsense")


def test_pci_distance_classes():
    topo = NodeTopology((), (NumaNode(0, (0,), 1, (10, 21)), NumaNode(1, (1,), 1, (21, 10))), (), (), (0, 1), (0, 1))
    sw = ("pci0000:15", "0000:15:01.0", "0000:16:00.0")
    pix = path_distance((*sw, "a"), (*sw, "b"), 0, 0, topo)
    pxb = path_distance((*sw, "0000:17:00.0", "a"), (*sw, "0000:17:01.0", "b"), 0, 0, topo)
    phb = path_distance(("pci0000:15", "x", "a"), ("pci0000:15", "y", "b"), 0, 0, topo)
    node = path_distance(("pci0000:15", "a"), ("pci0000:25", "b"), 0, 0, topo)
    sys_ = path_distance(("pci0000:15", "a"), ("pci0000:95", "b"), 0, 1, topo)
    assert [PathClass(k[0]) for k in (pix, pxb, phb, node, sys_)] == list(PathClass)
    assert pix < pxb < phb < node < sys_


def test_rank_plan_json_round_trip():
    plan = RankPlan(0, 1, ("0000:1b:00.0",), (0,), ("GPU-x",), (0, 112), 1, True, (0,), "preferred",
                    ("mlx5_0",), ("mlx5_0:1",), ("rdma",), ("mlx5_core",), 0, ("w",))
    assert RankPlan.from_json(plan.to_json()) == plan
    with pytest.raises(ConfigError):
        RankPlan.from_json('{"local_rank": 0}')
    with pytest.raises(ConfigError):
        RankPlan.from_json("[1]")


def test_config_validation_and_yaml_mirror():
    with pytest.raises(ConfigError, match="cpu_mode"):
        TopologyConfig(cpu_mode="everything")
    with pytest.raises(ConfigError):
        TopologyConfig(nic_kinds=["wifi"])
    yaml_path = os.path.join(os.path.dirname(__file__), "..", "..", "..", "conf", "topology",
                             "default.yaml")
    # The defaults live in the dataclass alone (tests/unit/config/test_defaults.py): the group's
    # default.yaml, merged over the schema, is exactly TopologyConfig().
    merged = OmegaConf.merge(OmegaConf.structured(TopologyConfig), OmegaConf.load(yaml_path))
    assert OmegaConf.to_object(merged) == TopologyConfig()


def test_srun_binding_args_and_prebound_detection():
    assert srun_binding_args(TopologyConfig()) == ["--cpu-bind=none"]
    assert srun_binding_args(TopologyConfig(binder="slurm")) == []
    topo = NodeTopology((), (NumaNode(0, (0, 1), 1, (10,)),), (), (), (0, 1), (0,))
    assert not slurm_prebound({"SLURM_CPU_BIND_TYPE": "none"}, topo)
    assert slurm_prebound({"SLURM_CPU_BIND_TYPE": "mask_cpu:"}, topo)
    assert not slurm_prebound({}, topo)


def test_nccl_xml_parsing():
    xml = ('<system version="1"><cpu numaid="2"><pci busid="ffff:ff:01.0">'
           '<pci busid="0001:00:00.0"/></pci></cpu></system>')
    found = parse_nccl_topo_xml(xml)
    assert found["0001:00:00.0"] == (("nccl-cpu2", "ffff:ff:01.0", "0001:00:00.0"), 2)
    with pytest.raises(ConfigError):
        parse_nccl_topo_xml("<system")
