"""torchtitan from PyPI, unmodified, on the real local Slurm cluster: 2 nodes x 2 ranks as the
ordinary user, on CPU.

torchtitan 0.3.0 (``tools/setup --cluster`` installs it into an environment of its own,
``.venv-titan``, beside the project's) trains its ``llama3_debugmodel`` through
``titan_launcher.py``: a test-only launcher that patches three things in memory for a CPU-only
torch and runs ``torchtitan.train`` as ``-m`` would (its docstring says what and why; no
torchtitan file is changed). Its tokenizer and dataset are made here (``titan_assets.py``): the
wheel ships none and CI reaches nothing beyond PyPI.

With ``supervisor.max_restarts_without_progress=1``, a rank is SIGKILLed five times, each time
after torchtitan saved a DCP checkpoint in that generation: the saves its adapter finds in
``<dump folder>/checkpoint/step-N`` are the progress that keeps the run going, every new
generation resumes from torchtitan's own newest checkpoint ("Loading the checkpoint from
.../step-N", "Training starts at step N+1"), and the job completes. What status and the report
show comes from torchtitan's own lines: its step, loss and length (``--training.steps``), the
steps each failure lost as its log shows them, and a goodput within 5 points of the one computed
from its logged step times.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from collections.abc import Callable
from datetime import datetime
from typing import Any

import pytest

from slurmkit.ledger.ledger import read_ledger
from slurmkit.ledger.summary import summarize
from slurmkit.runview import build_view
from slurmkit.userapi import marker_path
from tests.integration.faults import (completed_after_restarts, diagnose, events, finish, kill_node, mark_fault,
                                      rank_pid, restore_node, submit, wait_while_running)
from tests.integration.helpers import slurm_env
from tests.integration.titan_assets import write_assets

pytestmark = pytest.mark.integration
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
LAUNCHER = os.path.join(HERE, "titan_launcher.py")
#: The torchtitan environment's interpreter (tools/setup --cluster makes it).
TITAN_PYTHON = os.environ.get("SLURMKIT_TITAN_PYTHON") or os.path.join(REPO, ".venv-titan", "bin", "python")
STEPS, EVERY = 40, 2
KILLS = (3, 1, 2, 0, 3)  # ranks, one per generation: five failures, max_restarts_without_progress=1
OUT = "titan"  # --dump-folder, relative to the ranks' working directory (the run directory)
# torchtitan's logger: "[titan] 2026-12-07 17:43:02,178 - root - INFO - " before each line
_STAMP = r"^\[titan\] (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) - root - INFO - "
_STEP_LINE = re.compile(_STAMP + r"(?:\x1b\[[0-9;]*m)?step:\s+(\d+)\s+(?:\x1b\[[0-9;]*m)?loss:\s+(\S+)", re.M)
_STARTS = re.compile(_STAMP + r"Training starts at step (\d+)", re.M)
_LOADS = re.compile(_STAMP + r"Loading the checkpoint from (\S+?)\.?$", re.M)


def _require_torchtitan() -> None:
    found = subprocess.run([TITAN_PYTHON, "-c", "import importlib.metadata as m; print(m.version('torchtitan'))"],
                           capture_output=True, text=True) if os.path.exists(TITAN_PYTHON) else None
    if found is None or found.returncode != 0 or found.stdout.strip() != "0.3.0":
        pytest.fail(f"Detected: no torchtitan 0.3.0 at {TITAN_PYTHON} "
                    f"({found.stderr.strip()[-300:] if found is not None else 'no such interpreter'}). "
                    "Requirement: this test runs torchtitan from PyPI in an environment of its own. "
                    "Fix: tools/setup --cluster (or set SLURMKIT_TITAN_PYTHON to an interpreter that has it)")


def _command(assets: dict) -> str:
    args = [TITAN_PYTHON, LAUNCHER, "--module", "llama3", "--config", "llama3_debugmodel",
            "--training.steps", str(STEPS), "--training.seq-len", "32", "--training.local-batch-size", "1",
            "--parallelism.spmd-backend", "partial_dtensor", "--parallelism.data-parallel-replicate-degree", "4",
            "--parallelism.data-parallel-shard-degree", "1", "--loss.num-chunks", "1", "--debug.seed", "42",
            "--checkpoint.enable", "--checkpoint.interval", str(EVERY), "--checkpoint.keep-latest-k", "3",
            "--metrics.log-freq", "1", "--dump-folder", OUT, "--hf-assets-path", assets["hf_assets_path"],
            "--dataloader.dataset-path", assets["dataset_path"], "activation-checkpoint:none"]
    return "job.command=[" + ",".join(f"'{a}'" for a in args) + "]"


def _stamp(text: str) -> float:
    return datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").timestamp()  # the node's local time


def _log(run_dir: str) -> str:
    with open(os.path.join(run_dir, "logs", "rank0.log"), errors="replace") as f:
        return f.read()


def _generations(run_dir: str) -> list[dict[str, Any]]:
    """Rank 0's log cut at each start: per start, the step it resumed from, the checkpoint it
    loaded, and {step: (loss, time)} of its metric lines."""
    text = _log(run_dir)
    starts = list(_STARTS.finditer(text))
    out = []
    for i, m in enumerate(starts):
        end = starts[i + 1].start() if i + 1 < len(starts) else len(text)
        before = text[starts[i - 1].end() if i else 0:m.start()]
        loaded = [x.group(2) for x in _LOADS.finditer(before)]
        steps = {int(s.group(2)): (float(s.group(3)), _stamp(s.group(1))) for s in _STEP_LINE.finditer(text, m.end(), end)}
        gen: dict[str, Any] = {"resumed": int(m.group(2)) - 1, "loaded": loaded[-1] if loaded else None,
                               "steps": steps}
        out.append(gen)
    return out


def test_torchtitan_from_pypi_survives_kills_past_the_limit_and_is_accounted(cluster_env, tmp_path) -> None:
    _require_torchtitan()
    assets = write_assets(str(tmp_path / "assets"))
    env = slurm_env(cluster_env)
    job, run_dir = submit(["+exp=tiny", "job.name=titan", "job.nodes=2", "job.ranks_per_node=2",
                           "job.program=torchtitan", _command(assets), "+job.env.HF_HOME=hf",
                           "supervisor.max_restarts_without_progress=1", "supervisor.heartbeat_ledger_interval_s=2"],
                          env, str(tmp_path))

    def credited_in(generation: int) -> Callable[[], int | None]:
        """A save torchtitan finished in ``generation``, recorded by its adapter: its step."""
        def check() -> int | None:
            try:
                with open(marker_path(run_dir)) as f:
                    m = json.load(f)
            except (OSError, ValueError):
                return None
            ok = m.get("by") == "adapter:torchtitan" and m.get("generation") == generation
            return int(m["step"]) if ok else None
        return check
    for gen, rank in enumerate(KILLS):
        # Generous: the job may queue behind other jobs, and four ranks start on two cores.
        wait_while_running(f"a torchtitan save recorded in generation {gen}", credited_in(gen), job, run_dir, env,
                           timeout_s=300)
        mark_fault(run_dir, "sigkill", rank=rank)
        os.kill(rank_pid(run_dir, rank), signal.SIGKILL)

    story = completed_after_restarts(job, env, run_dir, KILLS, timeout_s=300)

    # torchtitan resumed from its own newest checkpoint at each restart, never from step 0.
    gens = _generations(run_dir)
    n = len(KILLS) + 1
    assert len(gens) == n and gens[0]["resumed"] == 0 and gens[0]["loaded"] is None, (gens, story)
    folder = os.path.join(run_dir, OUT, "checkpoint")
    for g in range(1, n):
        loaded = os.path.join(run_dir, gens[g]["loaded"])  # it says it relative to its working directory
        assert os.path.normpath(loaded) == os.path.join(folder, f"step-{gens[g]['resumed']}"), gens[g]["loaded"]
    resumed = [g["resumed"] for g in gens]
    assert resumed == sorted(set(resumed)) and resumed[-1] < STEPS and max(gens[-1]["steps"]) == STEPS, gens
    # The adapter's records: torchtitan's saves as the program's tier, and each start's step.
    saved = [e for e in events(run_dir, "ckpt_saved") if e.get("tier") == "user"]
    assert saved and all(e["uri"] == os.path.join(folder, f"step-{e['step']}") for e in saved), saved
    assert set(resumed[1:]) <= {e["step"] for e in saved}, saved
    assert [(e["generation"], e["step"]) for e in events(run_dir, "train_started")] == \
        [(g, gens[g]["resumed"]) for g in range(n)], events(run_dir, "train_started")
    # The report: steps lost per failure as the log shows them (the last step printed in that
    # generation less the step the next one resumed from), and goodput within 5 points of the
    # one computed from torchtitan's own timestamps.
    report = summarize(read_ledger(os.path.join(run_dir, "ledger.jsonl")))
    last = [max(g["steps"]) for g in gens]
    assert [f.steps_lost for f in report.failures] == [last[g] - resumed[g + 1] for g in range(n - 1)], \
        (report.failures, last, resumed)
    kept = [min(last[g], resumed[g + 1]) for g in range(n - 1)] + [last[-1]]
    productive = 0.0
    for each, k in zip(gens, kept, strict=True):
        first = min(each["steps"])
        productive += each["steps"][max(k, first)][1] - each["steps"][first][1]
    assert report.goodput is not None and abs(report.goodput - productive / report.wall_s) <= 0.05, \
        (report.goodput, productive, report.wall_s)
    # status: torchtitan's length, its last step, and the loss it printed at the newest sample's step
    view = build_view(run_dir, list(read_ledger(os.path.join(run_dir, "ledger.jsonl"))), full=True)
    assert view.total_steps == STEPS and view.step == STEPS, view
    sampled = [e for e in events(run_dir, "heartbeat") if e.get("metrics")]
    assert sampled, story
    newest = sampled[-1]
    printed = gens[-1]["steps"] if newest["generation"] == n - 1 else {}
    assert view.loss is not None and view.loss == newest["metrics"]["loss"], (view.loss, newest)
    assert abs(view.loss - printed[newest["steps"]["0"]][0]) < 1e-5, (view.loss, newest)


ADOPT_STEPS, ADOPT_EVERY = 12, 4


def _newest_save(folder: str) -> int | None:
    """The newest step torchtitan finished in ``folder`` (its mark: DCP's .metadata)."""
    steps = [int(n[5:]) for n in os.listdir(folder) if re.fullmatch(r"step-\d+", n)] if os.path.isdir(folder) else []
    return max((s for s in steps if os.path.exists(os.path.join(folder, f"step-{s}", ".metadata"))), default=None)


def _printed(run_dir: str) -> int:
    steps = [int(m.group(2)) for m in _STEP_LINE.finditer(_log(run_dir))]
    return max(steps, default=0)


def test_torchtitan_saves_adopted_into_both_tiers_are_put_back_on_a_spare_after_a_node_loss(cluster_env,
                                                                                           tmp_path) -> None:
    """store.adopt=true: each save torchtitan finishes reaches the shared tier and the object store
    (S3), copied by each node's agent and committed with a manifest; then one of its shards is
    damaged in torchtitan's own folder (a flipped byte: what a bad disk or a stray write leaves)
    while the node holding those ranks is lost. The spare that takes the node's slot finds its
    ranks' file no longer the adopted bytes and puts the verified copy back before its ranks start;
    torchtitan resumes from that step and prints, step for step, the losses it printed before."""
    from slurmkit.store.catalog import check_step, read_latest, read_manifest
    from slurmkit.store.tier import make_tier

    _require_torchtitan()
    assets = write_assets(str(tmp_path / "assets"))
    env = slurm_env(cluster_env)
    object_uri = f"s3://{env['SLURMKIT_S3_BUCKET']}/adopt-{os.path.basename(str(tmp_path))}-{os.getpid()}"
    command = _command(assets).replace(f"'{STEPS}'", f"'{ADOPT_STEPS}'", 1).replace(
        f"'--checkpoint.interval','{EVERY}'", f"'--checkpoint.interval','{ADOPT_EVERY}'")
    assert f"'{ADOPT_STEPS}'" in command and f"'--checkpoint.interval','{ADOPT_EVERY}'" in command, command
    job, run_dir = submit(["+exp=tiny", "job.name=titan-adopt", "job.nodes=2", "job.ranks_per_node=2",
                           "supervisor.spare_nodes=1", "health=off", "job.program=torchtitan", command,
                           "+job.env.HF_HOME=hf", "store.adopt=true", "store.lustre_uri=$SLURMKIT_RUN_DIR/ckpt/shared",
                           f"store.object_uri={object_uri}", "store.object_every_saves=1", "store.object_every_min=0",
                           # (rank 0 stays stopped while the agents adopt the save: not a hang)
                           "supervisor.heartbeat_timeout_s=120", "supervisor.heartbeat_ledger_interval_s=2"],
                          env, str(tmp_path))
    folder = os.path.join(run_dir, OUT, "checkpoint")

    def adopted(tier: str) -> set[int]:
        return {int(e["step"]) for e in events(run_dir, "ckpt_adopted") if e.get("tier") == tier}

    # A save torchtitan finished and a step it printed past it: rank 0 is stopped there (no further
    # save can finish without it; released and tried again where the moment was missed), and the
    # save is adopted on both tiers meanwhile (by the agents, not the ranks).
    pid0, saved = 0, None
    for _ in range(4):
        want = wait_while_running("a save and a step printed past it", lambda: (
            (lambda s: s if s is not None and s < _printed(run_dir) < s + ADOPT_EVERY else None)(_newest_save(folder))),
            job, run_dir, env, timeout_s=300)
        pid0 = rank_pid(run_dir, 0)
        os.kill(pid0, signal.SIGSTOP)
        if _newest_save(folder) == want and _printed(run_dir) < want + ADOPT_EVERY:
            saved = want
            break
        os.kill(pid0, signal.SIGCONT)
    assert saved is not None, diagnose(run_dir, job, env)
    wait_while_running(f"step {saved} adopted on both tiers", lambda: saved in adopted("lustre") & adopted("object")
                       or None, job, run_dir, env, timeout_s=120)
    assert saved is not None, diagnose(run_dir, job, env)
    printed_before = _printed(run_dir)
    (start,) = events(run_dir, "allocation_start")
    lost, spare = str(start["train_nodes"][1]), str(start["spares"][0])
    shards = [os.path.join(folder, f"step-{saved}", f"__{r}_0.distcp") for r in (2, 3)]
    damaged = max(shards, key=os.path.getsize)
    with open(damaged, "r+b") as f:
        f.seek(os.path.getsize(damaged) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x5A]))
    mark_fault(run_dir, "node_loss", node=lost, step=printed_before)
    try:
        kill_node(env, lost)
        os.kill(pid0, signal.SIGCONT)
        state = finish(job, env, run_dir=run_dir)
        assert state == "COMPLETED", f"job {job} ended {state}\n{diagnose(run_dir, job, env)}"
    finally:
        restore_node(env, lost)
    story = diagnose(run_dir, job, env)

    # Both tiers hold committed, checksum-verified copies of torchtitan's saves.
    for kind, uri in (("lustre", os.path.join(run_dir, "ckpt", "shared")), ("object", object_uri)):
        tier = make_tier(kind, uri, env)
        newest = read_latest(tier)
        # torchtitan's last save (step ADOPT_STEPS) too: adopted before the agents left
        assert newest == ADOPT_STEPS, (kind, newest, story)
        m = read_manifest(tier, newest)
        assert m.origin == "program:torchtitan" and {e.name for e in m.files} >= {".metadata", "__0_0.distcp"}, m
        assert check_step(tier, newest, deep=True).ok, (kind, newest)
    # The spare, in the lost node's slot, put the damaged shard back from the shared tier.
    back = [e for e in events(run_dir, "ckpt_put_back") if e["node"] == spare]
    assert back and back[0]["step"] == saved and back[0]["damaged"] == [os.path.basename(damaged)] \
        and back[0]["files"] == back[0]["damaged"] and back[0]["tier"] == "lustre", (back, story)
    assert not [e for e in events(run_dir, "ckpt_put_back") if e["node"] != spare], story
    # torchtitan resumed from that save and trained the same steps to the same losses.
    gens = _generations(run_dir)
    assert len(gens) == 2 and gens[1]["resumed"] == saved, (gens, story)
    assert os.path.normpath(os.path.join(run_dir, gens[1]["loaded"])) == os.path.join(folder, f"step-{saved}")
    again = sorted(set(gens[0]["steps"]) & set(gens[1]["steps"]))
    assert again and again[0] == saved + 1, (again, saved)
    assert [gens[1]["steps"][s][0] for s in again] == [gens[0]["steps"][s][0] for s in again], (gens, story)
    assert max(gens[1]["steps"]) == ADOPT_STEPS
    ran = {e["node"] for e in events(run_dir, "ranks_started") if e["generation"] == 1}
    assert spare in ran and lost not in ran, story
