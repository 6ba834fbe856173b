"""A real third-party program on the real local Slurm cluster: a PyTorch Lightning ``Trainer``.

lightning_user_program.py (Lightning from PyPI, DDP over gloo, ``SLURMEnvironment(auto_requeue=
False)``, no slurmkit import) runs through ``job.command`` on 2 nodes x 2 ranks. Lightning must
see the world slurmkit describes (world size 4, global ranks 0-3, node rank and local rank of
each, one gloo group of all four). One rank is SIGKILLed after the program saved a Lightning
checkpoint: the supervisor must record the crash and restart, the new generation must resume
from the program's own checkpoint (not from step 0), and the job must complete.
"""

from __future__ import annotations

import json
import os
import re
import signal

import pytest

from tests.integration.faults import diagnose, events, finish, mark_fault, submit, wait_while_running
from tests.integration.helpers import slurm_env

pytestmark = pytest.mark.integration
PROGRAM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lightning_user_program.py")
OUT = "lightning"  # the program's directory, relative to its working directory (the run directory)
STEPS, EVERY, DELAY_S = 60, 5, 0.1
KILLED = 3  # a rank on the second node, not the one that writes the checkpoints
CKPT_RE = re.compile(r"step-(\d{6})\.ckpt")


def _require_lightning() -> None:
    try:
        import lightning  # noqa: F401
    except ImportError as exc:
        pytest.fail(f"lightning is not importable ({exc}): this test runs a real Lightning Trainer. "
                    "Install the dev extras: pip install -e '.[dev]' (tools/setup does)")


def _records(run_dir: str) -> list[dict]:
    """Every rank record the program wrote so far (one per rank process)."""
    d = os.path.join(run_dir, OUT, "ranks")
    out = []
    for name in sorted(os.listdir(d)) if os.path.isdir(d) else []:
        if name.endswith(".json"):
            with open(os.path.join(d, name)) as f:
                out.append(json.load(f))
    return out


def _by_generation(run_dir: str) -> dict[int, dict[int, dict]]:
    gens: dict[int, dict[int, dict]] = {}
    for r in _records(run_dir):
        gens.setdefault(int(r["generation"]), {})[int(r["global_rank"])] = r
    return gens


def _checkpoint_steps(run_dir: str) -> list[int]:
    d = os.path.join(run_dir, OUT, "ckpt")
    names = os.listdir(d) if os.path.isdir(d) else []
    return sorted(int(m.group(1)) for m in map(CKPT_RE.fullmatch, names) if m)


def _check_placement(ranks: dict[int, dict], run_dir: str) -> None:
    """Lightning's view of each rank is the one slurmkit describes: 2 nodes x 2 ranks, one group."""
    assert sorted(ranks) == [0, 1, 2, 3], ranks
    for rank, r in ranks.items():
        node_rank, local_rank = divmod(rank, 2)
        assert (r["world_size"], r["node_rank"], r["local_rank"]) == (4, node_rank, local_rank), r
        assert r["group_ranks"] == [0, 1, 2, 3] and r["dist_world_size"] == 4 and r["backend"] == "gloo", r
        assert r["environment"] == "SLURMEnvironment", r
    assert ranks[0]["node"] == ranks[1]["node"] != ranks[2]["node"] == ranks[3]["node"], ranks
    # The records came from the processes the agents started for this generation.
    gen = {r["generation"] for r in ranks.values()}
    started = {rank: pid for e in events(run_dir, "ranks_started") if {str(e["generation"])} == gen
               for rank, pid in zip(e["ranks"], e["pids"], strict=True)}
    assert started == {rank: r["pid"] for rank, r in ranks.items()}, (started, ranks)


def test_a_lightning_trainer_sees_its_world_survives_a_killed_rank_and_resumes(cluster_env, tmp_path) -> None:
    _require_lightning()
    env = slurm_env(cluster_env)
    job, run_dir = submit(["+exp=tiny", "job.name=lightning", "job.nodes=2", "job.ranks_per_node=2",
                           f"job.command=[python,{PROGRAM},'{STEPS}','{EVERY}','{DELAY_S}',{OUT}]"],
                          env, str(tmp_path))

    def first_generation_checkpointed() -> tuple[int, dict[int, dict], int] | None:
        gens = _by_generation(run_dir)
        steps = _checkpoint_steps(run_dir)
        if len(gens) > 1:  # a restart the test did not cause: no point waiting for the deadline
            raise AssertionError(f"generations {sorted(gens)} before the kill\n{diagnose(run_dir, job, env)}")
        if not gens or not steps:
            return None
        (gen, ranks), = gens.items()
        return (gen, ranks, steps[-1]) if len(ranks) == 4 else None
    # Generous: the job may queue behind other sessions' jobs on the shared cluster.
    gen0, ranks0, ckpt_step = wait_while_running("all four ranks' records and a Lightning checkpoint",
                                    first_generation_checkpointed, job, run_dir, env, timeout_s=300)
    _check_placement(ranks0, run_dir)
    assert all(r["start_step"] == 0 and r["resumed_from"] is None for r in ranks0.values()), ranks0
    mark_fault(run_dir, "sigkill", rank=KILLED, step=ckpt_step)
    os.kill(ranks0[KILLED]["pid"], signal.SIGKILL)

    state = finish(job, env, timeout_s=240, run_dir=run_dir)
    assert state == "COMPLETED", f"job {job} ended {state}\n{diagnose(run_dir, job, env)}"
    failures = events(run_dir, "failure")
    assert [(f["cls"], f["rank"]) for f in failures] == [("rank_crash", KILLED)], failures
    assert [d["action"] for d in events(run_dir, "decision")] == ["restart"], events(run_dir, "decision")
    end = events(run_dir, "end")[-1]
    assert end["status"] == "completed" and end["exit_code"] == 0, end

    gens = _by_generation(run_dir)
    assert sorted(gens)[0] == gen0 and len(gens) == 2, {g: sorted(r) for g, r in gens.items()}
    ranks1 = gens[max(gens)]
    _check_placement(ranks1, run_dir)
    # Every rank of the new generation resumed from the same Lightning checkpoint, one saved no
    # earlier than the one seen before the kill, and started from its step, not from 0.
    resumed = {r["resumed_from"] for r in ranks1.values()}
    assert len(resumed) == 1 and None not in resumed, ranks1
    (path,) = resumed
    m = CKPT_RE.fullmatch(os.path.basename(path))
    assert m and os.path.dirname(path) == os.path.join(run_dir, OUT, "ckpt"), path
    assert {r["start_step"] for r in ranks1.values()} == {int(m.group(1))}, ranks1
    assert ckpt_step <= int(m.group(1)) < STEPS, (ckpt_step, path)
    with open(os.path.join(run_dir, OUT, "final.json")) as f:
        final = json.load(f)
    assert final == {"global_step": STEPS, "resumed_from": path, "world_size": 4}, final
