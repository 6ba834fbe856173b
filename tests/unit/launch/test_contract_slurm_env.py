"""Ranks see Slurm's task variables for their place in the training world, not the agent's
one-task srun step: real NodeAgents start real rank processes, and submitit's own
JobEnvironment (a third-party reader of those variables) is asked inside each rank."""

from __future__ import annotations

import json
import sys

import pytest

from slurmkit import contract
from slurmkit.config import compose
from slurmkit.launch.agent import NodeAgent
from slurmkit.launch.context import NodeContext
from slurmkit.ledger.ledger import Ledger

NODES = ("n0", "n1", "n2")  # n2: the spare
# What srun gives the single task of a one-node step (the agent), on the node of slot ``1``:
# inherited by every rank before the agent set its own view.
STEP_ENV = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "n[0-2]", "SLURM_JOB_NUM_NODES": "3",
            "SLURM_NTASKS": "1", "SLURM_NPROCS": "1", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
            "SLURM_NODEID": "0", "SLURM_NNODES": "1", "SLURM_NTASKS_PER_NODE": "1",
            "SLURM_TASKS_PER_NODE": "1", "SLURM_STEP_NUM_TASKS": "1", "SLURM_STEP_NUM_NODES": "1",
            "SLURM_STEP_TASKS_PER_NODE": "1", "SLURM_NODELIST": "n1", "SLURM_GTIDS": "0",
            "SLURM_JOB_NAME": "tiny", "SUBMITIT_EXECUTOR": "slurm", "SLURM_CPUS_PER_TASK": "8"}
# Asked inside each rank: submitit's reading of Slurm's variables, and the variables
# PyTorch Lightning's SLURMEnvironment reads (world size, global/local/node rank, the main
# address from the first host of SLURM_NODELIST, and SLURM_NTASKS_PER_NODE, without which it
# refuses SLURM_NTASKS > 1).
PROBE = ("import json, os, submitit; e = submitit.JobEnvironment(); "
         "keys = [k for k in os.environ if k.startswith('SLURM')]; "
         "print('PROBE ' + json.dumps({'submitit': [e.global_rank, e.local_rank, e.num_tasks, e.node, e.job_id], "
         "'env': {k: os.environ[k] for k in keys}, 'X': os.environ.get('X')}))")


def agent(tmp_path, node_rank: int, extra: list[str] = ()) -> NodeAgent:
    cfg = compose(["+exp=tiny", "health=off", "topology.enabled=false", "supervisor.spare_nodes=1",
                   f"job.command=[python,-c,\"{PROBE}\"]", *extra])
    ctx = NodeContext(node_rank=node_rank, num_nodes=len(NODES), node_name=NODES[node_rank], nodes=NODES,
                      job_id="4242", restart_count=0, master_addr="10.0.0.7", executor="slurm")
    env = {**STEP_ENV, "SLURMKIT_NODE_LOCAL_DIR": str(tmp_path / "local"), "PATH": "/usr/bin:/bin",
           "PYTHONPATH": ":".join(p for p in sys.path if p)}
    (tmp_path / "local").mkdir(exist_ok=True)
    ledger = Ledger(str(tmp_path / "run" / "ledger.jsonl"), source=f"agent:{NODES[node_rank]}")
    return NodeAgent(str(tmp_path / "run"), cfg, ctx, env, ledger)


def probes(node: NodeAgent) -> dict[int, dict]:
    """Each rank's PROBE line, once the rank has exited (waits on the processes, no sleeps)."""
    out = {}
    for p in node.procs:
        assert p.proc.wait() == 0, open(p.log_path).read()
        p.reader.join()
        lines = [ln for ln in open(p.log_path).read().splitlines() if ln.startswith("PROBE ")]
        out[p.rank] = json.loads(lines[-1][len("PROBE "):])
    return out


def test_every_rank_sees_its_place_in_the_training_world(tmp_path) -> None:
    (tmp_path / "run").mkdir()
    # Slot 1 runs on allocation node 2 (a spare that replaced a node): node id = the slot.
    seen: dict[int, dict] = {}
    for node_rank, slot in ((0, 0), (2, 1)):
        node = agent(tmp_path, node_rank)
        node.start(gen=0, slot=slot, port=29511, master_addr="10.0.0.7")
        seen.update(probes(node))
    assert sorted(seen) == [0, 1, 2, 3]
    for rank, got in seen.items():
        slot, local = divmod(rank, 2)
        assert got["submitit"] == [rank, local, 4, slot, "4242"]
        env = got["env"]
        assert env["SLURM_PROCID"] == str(rank) and env["SLURM_LOCALID"] == str(local)
        assert env["SLURM_NODEID"] == str(slot)
        assert env["SLURM_NTASKS"] == env["SLURM_NPROCS"] == env["SLURM_STEP_NUM_TASKS"] == "4"
        assert env["SLURM_NTASKS_PER_NODE"] == "2"
        assert env["SLURM_TASKS_PER_NODE"] == env["SLURM_STEP_TASKS_PER_NODE"] == "2(x2)"
        assert env["SLURM_NNODES"] == env["SLURM_STEP_NUM_NODES"] == "2"  # train nodes, not the spare
        assert env["SLURM_NODELIST"].split(",")[0] == "10.0.0.7"  # Lightning's main address = MASTER_ADDR
        assert env["SLURM_GTIDS"] == f"{2 * slot},{2 * slot + 1}"
        assert env["SLURM_CPUS_PER_TASK"] == "4"  # its share of the agent task's 8 CPUs
        # The allocation's own variables are left as Slurm set them.
        assert (env["SLURM_JOB_ID"], env["SLURM_JOB_NODELIST"], env["SLURM_JOB_NUM_NODES"]) == ("4242", "n[0-2]", "3")


def test_rank_env_matches_the_contracts_identity(tmp_path) -> None:
    (tmp_path / "run").mkdir()
    node = agent(tmp_path, 1)
    env = node.rank_env(3, 1, 1, 29600, "10.0.0.9")
    who = contract.rank_identity(1, 1, ranks_per_node=2, train_nodes=2, master_addr="10.0.0.9", master_port=29600)
    assert {k: env[k] for k in who.full_env()} == who.full_env()
    assert env["RANK"] == env["SLURM_PROCID"] == "3" and env["WORLD_SIZE"] == env["SLURM_NTASKS"] == "4"


@pytest.mark.parametrize(("rpn", "nodes", "tasks_per_node"), [(1, 1, "1"), (8, 1, "8"), (4, 16, "4(x16)")])
def test_slurm_task_view_shapes(rpn: int, nodes: int, tasks_per_node: str) -> None:
    last = contract.rank_identity(nodes - 1, rpn - 1, ranks_per_node=rpn, train_nodes=nodes,
                                  master_addr="h0", master_port=1)
    env = last.slurm_env()
    assert env["SLURM_PROCID"] == str(rpn * nodes - 1) and env["SLURM_NTASKS"] == str(rpn * nodes)
    assert env["SLURM_TASKS_PER_NODE"] == tasks_per_node and env["SLURM_NODEID"] == str(nodes - 1)
    assert env["SLURM_GTIDS"].split(",") == [str((nodes - 1) * rpn + i) for i in range(rpn)]


@pytest.mark.parametrize(("inherited", "rpn", "want"), [
    ({"SLURM_CPUS_PER_TASK": "8"}, 2, {"SLURM_CPUS_PER_TASK": "4"}),
    ({"SLURM_CPUS_PER_TASK": "3"}, 8, {"SLURM_CPUS_PER_TASK": "1"}),  # never 0
    ({"SLURM_CPUS_PER_TASK": "96"}, 8, {"SLURM_CPUS_PER_TASK": "12"}),
    ({}, 2, {}), ({"SLURM_CPUS_PER_TASK": "x"}, 2, {}),  # nothing Slurm did not set
    # an exclusive job without --cpus-per-task: the step's CPUs on the node
    ({"SLURM_CPUS_ON_NODE": "224"}, 8, {"SLURM_CPUS_PER_TASK": "28"}),
    ({"SLURM_CPUS_PER_TASK": "8", "SLURM_CPUS_ON_NODE": "224"}, 2, {"SLURM_CPUS_PER_TASK": "4"}),
])
def test_rank_cpus_env(inherited: dict[str, str], rpn: int, want: dict[str, str]) -> None:
    assert contract.rank_cpus_env(inherited, rpn) == want


def test_a_module_planted_in_the_run_directory_does_not_shadow_the_real_one(tmp_path) -> None:
    """``python -c``/``-m`` ranks run in the run directory; with PYTHONSAFEPATH it is not on
    sys.path (Python 3.11+), so a planted json.py is not what ``import json`` finds."""
    if sys.version_info < (3, 11):
        pytest.skip("PYTHONSAFEPATH needs Python 3.11")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "json.py").write_text("raise SystemExit('planted json.py imported')\n")
    node = agent(tmp_path, 0)
    node.start(gen=0, slot=0, port=29512, master_addr="10.0.0.7")
    seen = probes(node)  # each rank exited 0 and printed its probe: the real json was imported
    assert sorted(seen) == [0, 1]


def test_flight_recorder_fifo_under_both_torch_names(tmp_path) -> None:
    # torch >= 2.7 reads only TORCH_FR_DEBUG_INFO_PIPE_FILE (with only the old name, torch 2.11
    # on an H200 made no FIFO); older releases read only TORCH_NCCL_DEBUG_INFO_PIPE_FILE.
    (tmp_path / "run").mkdir()
    env = agent(tmp_path, 1).rank_env(3, 1, 1, 29600, "10.0.0.9")
    stem = env["TORCH_FR_DEBUG_INFO_PIPE_FILE"]
    assert stem == env["TORCH_NCCL_DEBUG_INFO_PIPE_FILE"] and stem.startswith(str(tmp_path / "local"))
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"]
    mine = agent(tmp_path, 1, ["+job.env.TORCH_NCCL_DEBUG_INFO_PIPE_FILE=/scratch/p_"])
    env = mine.rank_env(3, 1, 1, 29600, "10.0.0.9")
    assert env["TORCH_FR_DEBUG_INFO_PIPE_FILE"] == env["TORCH_NCCL_DEBUG_INFO_PIPE_FILE"] == "/scratch/p_"
    assert mine._nccl_stems()[0] == "/scratch/p_"


@pytest.mark.parametrize("extra, program", [([], "auto"), (["job.program=none"], "none"),
                                            (["job.program=lightning"], "lightning")])
def test_the_rank_is_told_its_jobs_program_setting(tmp_path, extra: list[str], program: str) -> None:
    """What slurmkit's Lightning callback reads to stay out (job.program=none) of a Trainer: the
    setting as given (auto takes most scripts for "none", a Lightning one included)."""
    env = agent(tmp_path, 1, extra).rank_env(3, 1, 1, 29600, "10.0.0.9")
    assert env[contract.PROGRAM] == program
