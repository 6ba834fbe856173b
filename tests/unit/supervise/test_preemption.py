"""A SIGTERM that is Slurm's preemption of a requeueable job is answered with a requeue
(slurmkit/supervise/exits/preemption.py): a job that checkpoints and ends inside GraceTime is never
requeued by Slurm itself (seen on the local cluster: it ended COMPLETED). The fake controller
(22.05's text formats) behind the real client; the loop in the one-process cluster."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurmkit.slurm.client import SlurmClient
from slurmkit.slurm.retry import RetryPolicy
from slurmkit.contract import EXIT_CHECKPOINTED_ON_SIGNAL
from slurmkit.supervise.policy import Action
from slurmkit.supervise.exits.preemption import requeue_after_preemption
from testkit.fakeslurm import FakeSlurm
from tests.unit.supervise.test_loop import Cluster, Script


def running(tmp_path: Path, mode: str | None, requeue: bool = True) -> tuple[FakeSlurm, SlurmClient, str]:
    fake = FakeSlurm({"debug": "node[1-4]"}, config={"PreemptMode": mode} if mode else None)
    script = tmp_path / "job.sh"
    script.write_text(f"#!/bin/bash\n#SBATCH {'--requeue' if requeue else '--no-requeue'}\n#SBATCH -N 2\nx\n")
    job = fake.run(["sbatch", "--parsable", str(script)]).stdout.strip()
    fake.start(job, ["node1", "node2"])
    return fake, SlurmClient(fake, retry=RetryPolicy(max_attempts=1, jitter_s=0)), job


def test_a_preemption_that_slurm_would_requeue_is_requeued_now(tmp_path: Path) -> None:
    fake, client, job = running(tmp_path, "REQUEUE")
    fake.preempt(job)
    why = requeue_after_preemption(client, job)
    assert why is not None and "PreemptMode=REQUEUE" in why and "GraceTime" in why


@pytest.mark.parametrize("mode, requeue, preempted", [
    ("REQUEUE", True, False),  # scancel / an admin / a node shutdown: the same SIGTERM
    ("CANCEL", True, True),  # the site cancels preempted jobs: its choice stands
    ("OFF", True, True),
    ("REQUEUE", False, True),  # --no-requeue: never requeued
])
def test_other_sigterms_are_not_requeued(tmp_path: Path, mode: str, requeue: bool,
                                         preempted: bool) -> None:
    fake, client, job = running(tmp_path, mode, requeue=requeue)
    if preempted:
        fake.preempt(job)
    assert requeue_after_preemption(client, job) is None


def test_slurm_unreachable_is_no_requeue(tmp_path: Path) -> None:
    fake, client, job = running(tmp_path, "REQUEUE")
    fake.preempt(job)
    fake.fail_next(10)
    assert requeue_after_preemption(client, job) is None


def test_node0_requeues_after_every_rank_saved_on_a_preemption(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    requeued: list[tuple[str, tuple[str, ...]]] = []
    monkeypatch.setattr("slurmkit.supervise.endings.requeue_now",
                        lambda client, job, exclude, **kw: requeued.append((job, tuple(exclude))))
    monkeypatch.setattr("slurmkit.supervise.endings.requeue_after_preemption",
                        lambda client, job: f"preempted (job {job})")
    saved = [Script(exit_code=EXIT_CHECKPOINTED_ON_SIGNAL) for _ in range(2)]  # every rank: 95
    c = Cluster(tmp_path, saved, extra=("job.requeue=true",),
                slurm=SlurmClient(FakeSlurm({"debug": "n[0-1]"})))
    for n in c.nodes:
        n.signal_kind = "preemption"
    assert c.run() == {0: 0, 1: 0}
    assert requeued == [("7", ())]
    (req,) = c.ledger.of("requeue")
    assert req["reason"] == "preempted (job 7)"
    assert not [d for d in c.decisions() if d[1] == Action.STOP]
