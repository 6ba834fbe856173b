"""The supervisor after a stop signal (time-limit warning, SIGTERM): no restart loop in an
allocation that ends. Scripted nodes over a real in-process store; Slurm is the fake controller."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from slurmkit import EXIT_NO_REQUEUE
from slurmkit.slurm.client import SlurmClient
from slurmkit.supervise.cancel_request import write_cancel_request
from slurmkit.failures.classes import FailureClass
from slurmkit.supervise.policy import Action
from testkit.fakeslurm import FakeSlurm
from tests.unit.supervise.test_loop import Cluster, Script

F = FailureClass


def _requeues(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, ...]]:
    requeued: list[tuple[str, ...]] = []
    monkeypatch.setattr("slurmkit.supervise.endings.requeue_now",
                        lambda client, job, exclude, **kw: requeued.append(tuple(exclude)))
    return requeued


def _warned(c: Cluster, kind: str) -> Cluster:
    for n in c.nodes:
        n.signal_kind = kind
    return c


def test_a_rank_that_dies_after_a_sigterm_ends_the_allocation_without_restart_or_requeue(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A preemption's (or scancel's) SIGTERM killed a rank of a program without a handler. A
    # restart would be signalled again while starting (a loop into 93 that eats the grace
    # time); a requeue from here could bring back a job its user cancelled.
    requeued = _requeues(monkeypatch)
    c = _warned(Cluster(tmp_path, [Script(), Script(fail={0: F.RANK_CRASH})], extra=("job.requeue=true",),
                        slurm=SlurmClient(FakeSlurm({"debug": "n[0-1]"}))), "preemption")
    assert c.run() == {0: EXIT_NO_REQUEUE, 1: EXIT_NO_REQUEUE}
    assert c.decisions() == [(0, Action.STOP, ())] and requeued == []
    assert all(n.started == [(0, i, 12345)] for i, n in enumerate(c.nodes))  # no generation 1
    (failure,) = c.ledger.of("failure")
    assert failure["cls"] == "preemption" and "was rank_crash" in failure["evidence"]
    (decision,) = c.ledger.of("decision")
    assert "SIGTERM" in decision["reason"]


def test_a_failure_after_the_warning_with_requeue_off_stops_instead_of_restarting(tmp_path: Path) -> None:
    # job.requeue=false: nothing continues the job, and a restart would only be killed by the
    # forwarded warning while starting up (restarts -> 93 with the time limit at hand).
    c = _warned(Cluster(tmp_path, [Script(), Script(fail={0: F.RANK_CRASH})], extra=("job.requeue=false",),
                        slurm=SlurmClient(FakeSlurm({"debug": "n[0-1]"}))), "time_limit")
    assert c.run() == {0: EXIT_NO_REQUEUE, 1: EXIT_NO_REQUEUE}
    assert c.decisions() == [(0, Action.STOP, ())]
    assert all(len(n.started) == 1 for n in c.nodes)
    (failure,) = c.ledger.of("failure")
    assert failure["cls"] == "time_limit"


def test_a_failure_after_a_checkpoint_cancel_request_is_never_requeued(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # slurmkit cancel --checkpoint sends the same SIGUSR1 as the time limit: a rank that died
    # of it must not turn the cancel into a requeue.
    requeued = _requeues(monkeypatch)
    write_cancel_request(str(tmp_path), job_id="7", by="test", time_s=time.time())
    c = _warned(Cluster(tmp_path, [Script(), Script(fail={0: F.RANK_CRASH})], extra=("job.requeue=true",),
                        slurm=SlurmClient(FakeSlurm({"debug": "n[0-1]"}))), "time_limit")
    assert c.run() == {0: EXIT_NO_REQUEUE, 1: EXIT_NO_REQUEUE}
    assert c.decisions() == [(0, Action.STOP, ())] and requeued == []



@pytest.mark.parametrize(("command", "choice", "completed"), [
    ("[python,user_train.py]", "auto", False),  # any other program may save and exit 0 on the signal
    ("[python,-m,slurmkit.train]", "auto", True),  # the reference trainer exits 95 when it leaves
    ("[python,user_train.py]", "completed", True),  # a program that exits 0 only when done, said so
    ("[python,-m,slurmkit.train]", "left", False),
])
def test_exit_0_after_the_warning_is_completion_only_from_a_program_that_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str, choice: str, completed: bool) -> None:
    # A user program that saves its own checkpoint on SIGUSR1 and exits 0: read as completed,
    # the run would end for good at its first time limit. Read as leaving on the warning, the
    # job requeues and resumes (a program that had finished exits 0 at once next time).
    requeued = _requeues(monkeypatch)
    c = _warned(Cluster(tmp_path, [Script(), Script()],
                        extra=("job.requeue=true", f"job.command={command}",
                               f"supervisor.exit0_after_signal={choice}"),
                        slurm=SlurmClient(FakeSlurm({"debug": "n[0-1]"}))), "time_limit")
    assert c.run() == {0: 0, 1: 0}
    assert c.decisions() == []  # nothing failed either way
    (end,) = c.ledger.of("end") or [None]
    if completed:
        assert requeued == [] and end is not None and end["status"] == "completed"
        assert c.ledger.of("checkpointed_on_signal") == []
    else:
        assert requeued == [()] and end is None  # requeued for the time limit, not ended
        assert [e["signal"] for e in c.ledger.of("checkpointed_on_signal")] == ["time_limit"]
        assert [e["reason"] for e in c.ledger.of("requeue")] == ["time limit warning: final checkpoint saved"]


def test_exit0_after_signal_is_checked() -> None:
    from slurmkit.config import compose
    from slurmkit.errors import ConfigError
    with pytest.raises(ConfigError, match="exit0_after_signal"):
        compose(["+exp=tiny", "cluster=local", "supervisor.exit0_after_signal=maybe"])
