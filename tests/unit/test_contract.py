"""The agent/rank contract: exit codes in one place, the rank environment, and which GPU a rank
uses, checked on fake machines through the real topology planner and pinning environment."""

from __future__ import annotations

import pytest

import slurmkit
from slurmkit import contract
from slurmkit.contract import (
    CUDA_VISIBLE_DEVICES,
    DEVICE,
    ContractError,
    DeviceChoice,
    choose_device,
    device_env,
    device_of,
    parse_device,
    rank_identity,
    visible_count,
)
from slurmkit.errors import ConfigError
from slurmkit.layout import Layout
from slurmkit.topology import RankPlan, TopologyConfig, rank_env
from slurmkit.train.config import TrainConfig
from slurmkit.train.parallel import select_runtime
from tests.unit.topology.trees import plans_of

SLURM_ALL_EIGHT = {"SLURM_JOB_ID": "7", CUDA_VISIBLE_DEVICES: "0,1,2,3,4,5,6,7"}


def layout(ranks: int, gpus: int, nodes: int = 2) -> Layout:
    return Layout(nodes=nodes, train_nodes=nodes, spare_nodes=0, ranks_per_node=ranks, gpus_per_node=gpus)


def rank_envs(tmp_path, machine: str, ranks: int, gpus: int, inherited: dict[str, str],
              visibility: str = "rank") -> list[dict[str, str]]:
    """What the node agent hands each local rank: its environment, the pinning variables of the
    real planner's plan for ``machine`` on top (kept out where already set), then SLURMKIT_DEVICE."""
    cfg = TopologyConfig(gpu_visibility=visibility)
    plans: list[RankPlan] = plans_of(str(tmp_path), machine, ranks, cfg)
    out = []
    for lr in range(ranks):
        before = {**inherited, "LOCAL_RANK": str(lr)}
        env = {**before, **rank_env(plans[lr], plans, before, cfg)}
        env.update(device_env(lr, layout(ranks, gpus), before, env, plans[lr]))
        out.append(env)
    return out


def cuda_index(env: dict[str, str]) -> int:
    choice = parse_device(env[DEVICE])
    assert choice.kind == "cuda" and choice.index is not None
    return choice.index


# ------------------------------------------------------------------ exit codes
def test_exit_codes_have_one_home() -> None:
    from slurmkit.launch import monitor
    from slurmkit.train import signals

    assert contract.EXIT_NO_REQUEUE == 93 and contract.EXIT_CHECKPOINTED_ON_SIGNAL == 95
    assert contract.EXIT_CONFIG_ERROR == 2
    assert slurmkit.EXIT_NO_REQUEUE is contract.EXIT_NO_REQUEUE
    assert signals.EXIT_CHECKPOINTED_ON_SIGNAL is monitor.EXIT_CHECKPOINTED_ON_SIGNAL \
        is contract.EXIT_CHECKPOINTED_ON_SIGNAL
    codes = [contract.EXIT_OK, contract.EXIT_FAILED, contract.EXIT_CONFIG_ERROR,
             contract.EXIT_NO_REQUEUE, contract.EXIT_CHECKPOINTED_ON_SIGNAL]
    assert len(set(codes)) == len(codes)


# ------------------------------------------------------------------ rank environment
def test_rank_identity_is_contiguous_per_node_and_torchrun_shaped() -> None:
    seen = []
    for slot in range(3):
        for lr in range(4):
            who = rank_identity(slot, lr, ranks_per_node=4, train_nodes=3, master_addr="n0", master_port=29500)
            env = who.env()
            assert env == {"RANK": str(slot * 4 + lr), "LOCAL_RANK": str(lr), "WORLD_SIZE": "12",
                           "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": str(slot), "MASTER_ADDR": "n0",
                           "MASTER_PORT": "29500"}
            seen.append(who.rank)
    assert seen == list(range(12))
    with pytest.raises(ValueError):
        rank_identity(0, 4, ranks_per_node=4, train_nodes=3, master_addr="n0", master_port=1)
    with pytest.raises(ValueError):
        rank_identity(3, 0, ranks_per_node=4, train_nodes=3, master_addr="n0", master_port=1)


# ------------------------------------------------------------------ which GPU: fake machines
def test_narrowed_visibility_without_slurm_puts_every_rank_on_its_only_visible_gpu(tmp_path) -> None:
    """The bug this settles: with gpu_visibility=rank and no Slurm, each rank sees one GPU, so
    cuda:LOCAL_RANK is invalid for every rank above 0; the agent now says cuda:0."""
    envs = rank_envs(tmp_path, "dgx_h100", 8, 8, {})
    visible = [e[CUDA_VISIBLE_DEVICES] for e in envs]
    assert [visible_count(v) for v in visible] == [1] * 8
    assert len(set(visible)) == 8  # narrowed to eight different GPUs
    for lr, env in enumerate(envs):
        assert env[DEVICE] == "cuda:0"
        assert cuda_index(env) < visible_count(env[CUDA_VISIBLE_DEVICES])
        if lr > 0:
            assert lr >= visible_count(env[CUDA_VISIBLE_DEVICES])  # what LOCAL_RANK would have asked


def test_narrowed_to_two_gpus_per_rank_uses_the_first(tmp_path) -> None:
    envs = rank_envs(tmp_path, "dgx_h100", 4, 8, {})
    assert [visible_count(e[CUDA_VISIBLE_DEVICES]) for e in envs] == [2] * 4
    assert [e[DEVICE] for e in envs] == ["cuda:0"] * 4


def test_slurms_visible_devices_are_never_narrowed_and_ranks_take_distinct_gpus(tmp_path) -> None:
    envs = rank_envs(tmp_path, "dgx_h100", 8, 8, SLURM_ALL_EIGHT)
    assert all(e[CUDA_VISIBLE_DEVICES] == "0,1,2,3,4,5,6,7" for e in envs)
    assert [cuda_index(e) for e in envs] == list(range(8))


def test_slurm_renumbered_subset_counts_positions_not_host_indices(tmp_path) -> None:
    """A job that got 4 of 8 GPUs: Slurm's cgroup renumbers them 0-3; four ranks, one each."""
    envs = rank_envs(tmp_path, "dgx_h100", 4, 4, {"SLURM_JOB_ID": "7", CUDA_VISIBLE_DEVICES: "0,1,2,3"})
    assert [cuda_index(e) for e in envs] == [0, 1, 2, 3]
    assert all(cuda_index(e) < 4 for e in envs)


def test_more_ranks_than_slurm_gpus_share_neighbouring_devices(tmp_path) -> None:
    envs = rank_envs(tmp_path, "dgx_h100", 16, 8, SLURM_ALL_EIGHT)
    assert [cuda_index(e) for e in envs] == [lr // 2 for lr in range(16)]


def test_fewer_ranks_than_slurm_gpus_take_the_first_of_their_block(tmp_path) -> None:
    envs = rank_envs(tmp_path, "dgx_h100", 4, 8, SLURM_ALL_EIGHT)
    assert [cuda_index(e) for e in envs] == [0, 2, 4, 6]


def test_visibility_all_without_slurm_uses_the_planned_gpu(tmp_path) -> None:
    """Nothing narrows: the rank uses its planned GPU, numbered in PCI order (as the plan is)."""
    for machine in ("dgx_h100", "awkward_reverse"):
        cfg = TopologyConfig(gpu_visibility="all")
        plans = plans_of(str(tmp_path), machine, 8, cfg)
        envs = rank_envs(tmp_path, machine, 8, 8, {}, visibility="all")
        assert all(CUDA_VISIBLE_DEVICES not in e for e in envs)
        assert all(e["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID" for e in envs)
        assert [cuda_index(e) for e in envs] == [p.gpu_indices[0] for p in plans]
        assert sorted(cuda_index(e) for e in envs) == list(range(8))


def test_cpu_layout_on_a_gpu_host_stays_on_the_cpu(tmp_path) -> None:
    """job.gpus_per_node=0 on an 8-GPU node: CPU ranks, whatever the host has."""
    for inherited in ({}, SLURM_ALL_EIGHT):
        envs = rank_envs(tmp_path, "dgx_h100", 2, 0, inherited)
        assert [e[DEVICE] for e in envs] == ["cpu", "cpu"]


def test_no_pinning_plan_deals_blocks_of_the_jobs_gpus() -> None:
    shape = layout(4, 8)
    assert [device_env(lr, shape, {}, {})[DEVICE] for lr in range(4)] == ["cuda:0", "cuda:2", "cuda:4", "cuda:6"]
    user = {CUDA_VISIBLE_DEVICES: "3"}
    assert [device_env(lr, layout(2, 8), user, user)[DEVICE] for lr in range(2)] == ["cuda:0", "cuda:0"]


def test_a_user_device_order_is_not_matched_against_pci_indices() -> None:
    final = {"CUDA_DEVICE_ORDER": "FASTEST_FIRST"}
    assert choose_device(local_rank=1, local_world=2, gpus_per_node=2, inherited=final, final=final,
                         planned=(7,)) == "cuda:1"


def test_narrowing_to_nothing_is_refused() -> None:
    with pytest.raises(ContractError, match="Detected: CUDA_VISIBLE_DEVICES=''"):
        choose_device(local_rank=0, local_world=1, gpus_per_node=8, inherited={},
                      final={CUDA_VISIBLE_DEVICES: ""})


# ------------------------------------------------------------------ the rank's side
@pytest.mark.parametrize("text, want", [("cpu", DeviceChoice("cpu", None)), ("cuda:0", DeviceChoice("cuda", 0)),
                                        (" cuda:12 ", DeviceChoice("cuda", 12))])
def test_parse_device(text: str, want: DeviceChoice) -> None:
    assert parse_device(text) == want


@pytest.mark.parametrize("text", ["", "gpu:0", "cuda:", "cuda:-1", "cuda:1x", "cuda:99999", "cuda:0\n; rm"])
def test_parse_device_refuses_what_the_agent_never_writes(text: str) -> None:
    with pytest.raises(ContractError) as err:
        parse_device(text)
    assert isinstance(err.value, ConfigError) and "Requirement:" in str(err.value) and "Fix:" in str(err.value)


def test_device_of_is_none_without_an_agent() -> None:
    assert device_of({"LOCAL_RANK": "3"}) is None
    assert device_of({DEVICE: "cuda:0"}) == DeviceChoice("cuda", 0)


def test_select_runtime_follows_the_agents_choice(tmp_path) -> None:
    t = TrainConfig()
    envs = rank_envs(tmp_path, "dgx_h100", 8, 8, {})
    for lr, env in enumerate(envs):
        # Each rank sees exactly one device: the agent's choice fits, LOCAL_RANK would not.
        rt = select_runtime(t, lr, device=device_of(env), cuda=True, device_count=1)
        assert (rt.device.type, rt.device.index, rt.backend) == ("cuda", 0, "nccl")
        if lr > 0:
            with pytest.raises(ContractError, match=f"GPU {lr} \\(LOCAL_RANK={lr}\\) but 1 GPU"):
                select_runtime(t, lr, cuda=True, device_count=1)
    rt = select_runtime(t, 5, device=DeviceChoice("cpu", None), cuda=True, device_count=8)
    assert (rt.device.type, rt.backend) == ("cpu", "gloo")
    # An emulated GPU cluster without CUDA: the GPU choice computes on the CPU.
    rt = select_runtime(t, 1, device=DeviceChoice("cuda", 1), cuda=False)
    assert (rt.device.type, rt.backend) == ("cpu", "gloo")
    with pytest.raises(ContractError, match="SLURMKIT_DEVICE=cuda:3"):
        select_runtime(t, 0, device=DeviceChoice("cuda", 3), cuda=True, device_count=2)
    # Without an agent (torchrun), LOCAL_RANK still picks the GPU.
    assert select_runtime(t, 3, cuda=True, device_count=8).device.index == 3
