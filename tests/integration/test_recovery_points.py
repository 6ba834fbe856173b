"""Every committed save is a recovery point for every rank, on the real local cluster.

A 2-node x 2-rank job (+exp=tiny) with conf/store/tiered.yaml: NVMe every save, the shared
tier every 4th save, so most saves live on NVMe only. Each fault lands right after such a
save committed; the run must resume from exactly that save (not from the older one on the
shared tier) and end bit for bit equal to the uninterrupted run. One job takes two faults in
turn (issue 35: one multi-fault job where two tests each paid a job):
  * one rank SIGKILLed: its node's NVMe holds everything it reads (buddy copies, .metadata);
  * then one node lost with its NVMe (``tools/local-cluster kill-node``), a spare takes its
    slot and fetches the lost node's files from the buddy copy on the surviving node;
  * the time-limit warning: the stop checkpoint reaches the shared tier before exit 95, and
    the requeued job resumes from it.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import time

import pytest

from tests.integration.faults import COMMON as FAULT_COMMON
from tests.integration.faults import STEPS as FAULT_STEPS
from tests.integration.faults import (
    events, final, finish, kill_node, mark_fault, rank_pid, restore_node, submit, wait_for_step,
)
from tests.integration.helpers import slurm_env

pytestmark = pytest.mark.integration
#: Training as faults.COMMON trains (the session's ``reference`` digest: a save changes no
#: parameter, so neither the checkpoint interval nor the store does), saving every 4 steps:
#: saves at 4, 8, ..., 40; the shared tier gets steps 16 and 32.
STEPS, INTERVAL, EVERY = FAULT_STEPS, 4, 4
STORE = ["store=tiered", "store.nvme_uri=$SLURMKIT_RUN_DIR/ckpt/nvme",
         "store.lustre_uri=$SLURMKIT_RUN_DIR/ckpt/shared", "store.object_uri=",
         f"store.lustre_every_saves={EVERY}", "store.stagger_s=0"]
COMMON = [*(a for a in FAULT_COMMON if not a.startswith(("train.ckpt_interval_steps=", "+job.env.SLURMKIT_STEP_DELAY_S="))),
          f"train.ckpt_interval_steps={INTERVAL}", *STORE]
DELAY = "+job.env.SLURMKIT_STEP_DELAY_S=0.5"
NVME_ONLY = 20  # the 5th save: committed on NVMe, never promoted


@pytest.fixture(scope="module")
def env(cluster_env) -> dict[str, str]:
    return slurm_env(cluster_env)


def wait_saved(run_dir: str, step: int, timeout_s: float = 300) -> None:
    """Until rank 0 recorded the commit of ``step`` (every rank committed it)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(e["step"] == step for e in events(run_dir, "ckpt_saved")):
            return
        time.sleep(0.05)
    raise AssertionError(f"step {step} was never saved in {run_dir}")


def restored_after(run_dir: str, failure: dict, timeout_s: float = 300) -> dict:
    """Rank 0's first ``ckpt_restored`` after ``failure`` (the next generation's restore)."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = [e for e in events(run_dir, "ckpt_restored") if e["t"] > failure["t"] and e.get("rank", 0) == 0]
        if got:
            return got[0]
        assert time.monotonic() < deadline, f"no restore after {failure}\n{_story(run_dir)}"
        time.sleep(0.1)


def saved_before(run_dir: str, failure: dict) -> int:
    """The newest commit rank 0 recorded before the supervisor saw ``failure``."""
    return max(e["step"] for e in events(run_dir, "ckpt_saved") if e["t"] < failure["t"])


def wait_failures(run_dir: str, n: int, timeout_s: float = 300) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while len(events(run_dir, "failure")) < n:
        assert time.monotonic() < deadline, f"fewer than {n} failures recorded\n{_story(run_dir)}"
        time.sleep(0.1)
    return events(run_dir, "failure")


def assert_nvme_only(run_dir: str, step: int, restored: dict) -> None:
    """``step`` never reached the shared tier, and the restore read nothing from it."""
    assert step % (INTERVAL * EVERY), step
    shared = os.path.join(run_dir, "ckpt", "shared")
    assert not os.path.exists(os.path.join(shared, f"step_{step:010d}", "manifest.json")), step
    assert restored["step"] == step, (restored, step)
    assert restored["tier"] == "nvme" and not restored["bytes_by_tier"].get("lustre"), restored


def test_a_rank_killed_then_a_node_lost_each_resume_from_an_nvme_only_save(env, reference, tmp_path) -> None:
    """One job, one allocation, a spare: a rank SIGKILLed after the NVMe-only save of step 20
    restarts in the allocation from it (its node's NVMe holds everything it reads); then the
    node of train slot 1 is lost with its NVMe after a later NVMe-only save, and the spare in
    its slot fetches that save's files from the buddy copy on the surviving node. The run ends
    bit for bit equal to the uninterrupted one."""
    job, run_dir = submit([*COMMON, DELAY, "job.name=rp-faults", "supervisor.spare_nodes=1"],
                          env, str(tmp_path))
    wait_saved(run_dir, NVME_ONLY)
    mark_fault(run_dir, "sigkill", rank=3, step=NVME_ONLY)
    os.kill(rank_pid(run_dir, 3), signal.SIGKILL)
    kill = wait_failures(run_dir, 1)[0]
    assert (kill["cls"], kill["rank"]) == ("rank_crash", 3), kill
    first = restored_after(run_dir, kill)
    assert_nvme_only(run_dir, saved_before(run_dir, kill), first)

    # the next NVMe-only save after the restart, then the loss of slot 1's node
    (start,) = events(run_dir, "allocation_start")
    lost = str(start["train_nodes"][1])
    nvme = os.path.join(run_dir, "ckpt", "nvme", lost)
    later = next(s for s in range(first["step"] + INTERVAL, STEPS, INTERVAL) if s % (INTERVAL * EVERY))
    wait_saved(run_dir, later)
    assert os.path.isdir(nvme)
    mark_fault(run_dir, "node_loss", node=lost, step=later)
    try:
        kill_node(env, lost)
        assert not os.path.exists(nvme), "kill-node left the lost node's NVMe directory"
        state = finish(job, env, run_dir=run_dir)
    finally:
        restore_node(env, lost)
    log = os.path.join(run_dir, "logs", "rank0.log")
    assert state == "COMPLETED", (state, open(log).read()[-3000:] if os.path.exists(log) else "")
    assert final(run_dir)["param_sha256"] == reference, "resumed run diverged"
    kill, loss = events(run_dir, "failure")
    assert (loss["cls"], loss["node"]) == ("node_loss", lost), loss
    second = restored_after(run_dir, loss)
    step = saved_before(run_dir, loss)
    assert step >= later, (step, later)
    assert_nvme_only(run_dir, step, second)
    assert [d["action"] for d in events(run_dir, "decision")] == ["restart", "replace_node"]
    assert not events(run_dir, "requeue"), "a spare was there: the job continues in its allocation"
    started = events(run_dir, "ranks_started")
    assert lost not in {e["node"] for e in started if e["t"] > loss["t"]}, started
    spare = [e["node"] for e in started if e["t"] > loss["t"] and 2 in e["ranks"]]
    assert spare and spare[0] != lost, spare
    # ranks 2 and 3 (the lost node's slot) fetched its files from the surviving node (ranks 0-1)
    (fetched,) = [e for e in events(run_dir, "ckpt_fetched") if e["step"] == step]
    assert {"2", "3"} <= set(fetched["ranks"]), fetched
    for r in ("2", "3"):
        got = fetched["ranks"][r]
        assert got["files"] > 0 and set(got["from"]) <= {0, 1} and not got["problem"], got


def _story(run_dir: str) -> str:
    """The ledger without heartbeats: what happened, for a failure message."""
    from tests.integration.helpers import read_ledger

    rows = [e for e in read_ledger(run_dir) if e["event"] not in ("heartbeat", "state")]
    return "\n".join(str(e)[:300] for e in rows[-25:])


def _elapsed_s(job: str, env) -> int:
    from slurmkit.slurm.client import SlurmClient
    from slurmkit.slurm.runner import SubprocessRunner

    info = SlurmClient(SubprocessRunner(env=env)).job(job)
    assert info.run_time_s is not None, info
    return info.run_time_s


def _requeued_in_place(job: str, env, run_dir: str, timeout_s: float = 120) -> bool:
    """After the ``requeue`` event: False once node 0 says it handed the run to a successor job,
    True once it says it could not (``successor_refused``) or the job itself is queued again."""
    from slurmkit.slurm.client import SlurmClient
    from slurmkit.slurm.runner import SubprocessRunner

    client = SlurmClient(SubprocessRunner(env=env))
    deadline = time.monotonic() + timeout_s
    while True:
        if events(run_dir, "successor"):
            return False
        if events(run_dir, "successor_refused") or client.job_state(job).startswith(("PENDING", "REQUEUE")):
            return True
        assert time.monotonic() < deadline, f"neither a successor nor a requeue in place\n{_story(run_dir)}"
        time.sleep(0.2)


def _set_time_limit(job: str, env, minutes: int) -> None:
    """As an admin would, retried while a busy slurmctld does not answer (seen once in CI:
    exit 1); any other refusal fails with Slurm's own words."""
    import time

    for attempt in range(5):
        res = subprocess.run(["scontrol", "update", f"jobid={job}", f"timelimit={minutes}"], env=env,
                             capture_output=True, text=True, timeout=60)
        if res.returncode == 0:
            return
        transient = any(t in res.stderr for t in ("timed out", "Unable to contact", "try again", "busy"))
        assert transient and attempt < 4, f"scontrol update timelimit={minutes} of job {job}: {res.stderr}"
        time.sleep(2 ** attempt)


def test_the_time_limit_warning_saves_to_the_shared_tier_and_the_requeue_resumes_it(
        env, reference, tmp_path) -> None:
    """Slurm's own --signal=USR1@60 before the time limit, sent while the run trains.

    The job is submitted with a 10-minute limit; once rank 0 trains, the limit is cut to the
    next whole minute at least 60 s away, so slurmctld's time-limit check sends the warning
    within about a minute, whatever the machine's load made the start take (a fixed 2-minute
    limit signalled ranks still importing torch on a loaded CI machine, and every requeued
    attempt hit its limit again). The requeued job gets its 10 minutes back.

    The USR1 stop save is an NVMe save by the promotion interval, yet it must be on the shared
    tier before the ranks exit 95; the requeue resumes from exactly that step, with nothing
    recorded as a failure.
    """
    job, run_dir = submit([*COMMON, "job.name=rp-time", "job.time=00:10:00",
                           "job.signal_lead_s=60", "+job.env.SLURMKIT_STEP_DELAY_S=2"],
                          env, str(tmp_path))
    wait_for_step(run_dir, 0, 1, timeout_s=600)
    _set_time_limit(job, env, math.ceil((_elapsed_s(job, env) + 60) / 60))
    deadline = time.monotonic() + 300
    while not events(run_dir, "requeue"):
        assert time.monotonic() < deadline, f"no requeue 300 s after the time limit was cut\n{_story(run_dir)}"
        assert not events(run_dir, "end"), f"the run ended without a warning\n{_story(run_dir)}"
        time.sleep(0.5)
    if _requeued_in_place(job, env, run_dir):
        _set_time_limit(job, env, 10)  # the same job id runs again: give it its 10 minutes back
    # else a successor job took the run over, with the script's own 10 minutes; the old job may
    # already be gone (CI once lost the race: "Job has already finished").
    state = finish(job, env, timeout_s=600, run_dir=run_dir)
    assert state == "COMPLETED", (state, _story(run_dir))
    assert final(run_dir)["param_sha256"] == reference
    (saved, *_) = events(run_dir, "checkpointed_on_signal")
    assert saved["signal"] == "time_limit", saved
    stopped = events(run_dir, "train_stopped")[0]
    assert stopped["step"] == saved["step"] < STEPS, (stopped, saved)
    durable = [e for e in events(run_dir, "ckpt_durable")
               if e["step"] == stopped["step"] and e["tier"] == "lustre"]
    assert durable and durable[0]["t"] <= stopped["t"], (durable, stopped)
    requeues = events(run_dir, "requeue")
    assert "time limit" in requeues[0]["reason"], requeues
    restored = events(run_dir, "ckpt_restored")
    assert restored[0]["step"] == stopped["step"], (restored, stopped)
    assert not events(run_dir, "failure"), events(run_dir, "failure")
