"""Node 0's succession when the successor itself dies, and node 0's done marker.

The protocol on a recorded clock (slurmkit.supervise.exits.succession.succeed): a claim that stops
moving is taken over by the node rank above its claimant; one that moves is not; planted files
are refused. Then the loop in one process (scripted agents over one real in-process store and
the fake Slurm, the harness of test_loop): the successor dies after claiming and the
next agent records the failure and requeues; a successor whose requeue landed before it died is
not requeued after; an agent later than node 0's exit barrier does not take the closed store for
node 0's loss."""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from slurmkit.slurm.client import SlurmClient
from slurmkit.slurm.retry import RetryPolicy
from slurmkit.supervise import endings, loop
from slurmkit.supervise.exits.succession import (Claim, Done, Watched, claim_path, done_path, read_claim, read_done,
                                           succeed, write_done)
from testkit.fakeslurm import FakeSlurm
from testkit.fakeslurm.jobs import FakeJob
from tests.unit.supervise.test_loop import Cluster, DyingStore, Script
from tests.unit.supervise.test_succession import Clock

RUN = "7-0"


def run_succession(tmp_path: Path, node_rank: int, t: Clock, n_nodes: int = 4) -> Claim | Watched:
    return succeed(str(tmp_path), RUN, node_rank, f"n{node_rank}", n_nodes, grace_s=1.0, stall_s=2.0,
                   clock=t.clock, sleep=t.sleep)


# ------------------------------------------------------------------ the protocol, recorded clock
def test_a_claim_that_stops_moving_is_taken_over_by_the_rank_above_its_claimant(tmp_path: Path) -> None:
    first = run_succession(tmp_path, 1, Clock())
    assert isinstance(first, Claim) and first.generation == 0  # n1 claimed, then died: never refreshed
    t = Clock()
    second = run_succession(tmp_path, 2, t)
    assert isinstance(second, Claim) and second.generation == 1
    assert 2.0 <= t.now < 3.0  # the stall (2 s), no stagger: n2 is just above the claimant n1
    assert read_claim(claim_path(str(tmp_path), RUN, 1)) == "n2 (node rank 2)"
    assert first.superseded() and not second.superseded()

    # n3 comes later: it skips the given-up generation, watches n2's (which moves) and leaves
    # once n2's done marker is there.
    def n2_works(now: float) -> None:
        second.refresh()
        if now >= 30.0:
            write_done(str(tmp_path), RUN, Done("requeueing", 0, "n2", 2))

    t3 = Clock(n2_works)
    third = run_succession(tmp_path, 3, t3)
    assert isinstance(third, Watched) and third.done == Done("requeueing", 0, "n2", 2)
    assert t3.now >= 30.0 and not os.path.lexists(claim_path(str(tmp_path), RUN, 2))


def test_a_claim_that_moves_is_never_taken_over(tmp_path: Path) -> None:
    first = run_succession(tmp_path, 1, Clock())
    assert isinstance(first, Claim)

    def works(now: float) -> None:
        first.refresh()
        if now >= 100.0:
            write_done(str(tmp_path), RUN, Done("stopped", 93, "n1", 1))

    for nr in (2, 3):
        result = run_succession(tmp_path, nr, Clock(works))
        assert isinstance(result, Watched) and result.done.exit_code == 93
    assert not os.path.lexists(claim_path(str(tmp_path), RUN, 1))


def test_with_the_next_rank_gone_too_the_one_above_it_takes_over_a_grace_later(tmp_path: Path) -> None:
    assert isinstance(run_succession(tmp_path, 1, Clock()), Claim)
    t = Clock()
    claim = run_succession(tmp_path, 3, t)  # n2 is lost as well
    assert isinstance(claim, Claim) and claim.generation == 1
    assert 3.0 <= t.now < 4.0  # the stall, then one grace for n2


def test_a_claim_planted_as_a_link_is_refused_and_taken_over(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = claim_path(str(tmp_path), RUN)
    os.makedirs(os.path.dirname(path))
    target = tmp_path / "elsewhere"
    target.write_text('{"node": "n1", "node_rank": 1}')
    os.symlink(target, path)  # nobody can create the claim; nothing behind it ever acts
    t = Clock()
    with caplog.at_level(logging.ERROR):
        claim = run_succession(tmp_path, 1, t)
    assert isinstance(claim, Claim) and claim.generation == 1 and 2.0 <= t.now < 3.0
    refused = [r.getMessage() for r in caplog.records if "Detected:" in r.getMessage()]
    assert refused and path in refused[0] and "Fix: remove" in refused[0]
    assert target.read_text() == '{"node": "n1", "node_rank": 1}'  # the link was never followed


@pytest.mark.parametrize("planted", ["link", "garbage", "bad_code", "dir", "foreign"])
def test_a_done_marker_that_cannot_be_trusted_counts_as_absent(
        tmp_path: Path, planted: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    path = done_path(str(tmp_path), RUN)
    os.makedirs(os.path.dirname(path))
    if planted == "link":
        (tmp_path / "fake").write_text('{"outcome": "completed", "exit_code": 0, "node": "n0", "node_rank": 0}')
        os.symlink(tmp_path / "fake", path)
    elif planted == "dir":
        os.mkdir(path)
    elif planted == "foreign":
        write_done(str(tmp_path), RUN, Done("completed", 0, "n0", 0))
    else:
        Path(path).write_text("\x00garbage" if planted == "garbage" else
                              '{"outcome": "completed", "exit_code": 999, "node": "n0", "node_rank": 0}')
    with caplog.at_level(logging.ERROR):
        if planted == "foreign":  # a good marker, but this agent runs as another user than its owner
            uid = os.getuid() + 1
            monkeypatch.setattr(os, "getuid", lambda: uid)
        assert read_done(str(tmp_path), RUN) is None
        monkeypatch.undo()
    assert any("Detected:" in r.getMessage() and "Fix:" in r.getMessage() for r in caplog.records)


def test_the_done_marker_is_written_atomically_and_privately(tmp_path: Path) -> None:
    write_done(str(tmp_path), RUN, Done("completed", 0, "n0", 0))
    assert read_done(str(tmp_path), RUN) == Done("completed", 0, "n0", 0)
    assert os.stat(done_path(str(tmp_path), RUN)).st_mode & 0o777 == 0o600
    assert sorted(os.listdir(tmp_path / "rdzv")) == [f"{RUN}.done"]  # no temporary left


# ------------------------------------------------------------------ the loop
def fake_slurm_running_job_7(nodes: list[str]) -> FakeSlurm:
    fake = FakeSlurm({"debug": f"n[0-{len(nodes)}]"})  # one node more than the job: n0 can be excluded
    fake.jobs["7"] = FakeJob("7", "train", "debug", len(nodes), "agent", "/tmp", True, None, 0.0, None)
    fake.start("7", nodes)
    return fake


class LedgerDying:
    """One agent's view of the ledger: it dies (an I/O error, so the agent fails) at ``event``."""

    def __init__(self, ledger: Any, event: str) -> None:
        self.ledger, self.event = ledger, event

    def append(self, event: str, **fields: Any) -> Any:
        if event == self.event:
            raise OSError(5, "Input/output error")
        return self.ledger.append(event, **fields)


def node0_dies_once_running(c: Cluster, agents: list[int]) -> None:
    dying = {nr: DyingStore(c.store) for nr in agents}
    for nr, d in dying.items():
        c.sups[nr].channel.store = d
        c.sups[nr].probe_slurmd = lambda addr, port: False  # node 0's node died: its slurmd too
    c.sups[0].channel.post_port(0, 12345)  # node 0 started generation 0, then its node died

    def kill() -> None:
        while not all(c.nodes[nr].started for nr in agents):
            threading.Event().wait(0.01)
        for d in dying.values():
            d.dead.set()

    threading.Thread(target=kill, daemon=True).start()


def reporting(sup: loop.Supervisor) -> None:
    """The agent's entry point (agent_main calls run_or_report); Cluster calls run()."""
    run = sup.run

    def run_or_report() -> int:
        try:
            return run()
        except Exception as exc:  # noqa: BLE001 - what agent_main does
            return sup.agent_error(exc)

    sup.run = run_or_report  # type: ignore[method-assign]


def test_the_successor_dies_after_claiming_and_the_next_agent_takes_over(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    requeued: list[tuple[str, tuple[str, ...]]] = []

    def requeue_now(client: SlurmClient, job: str, exclude: tuple[str, ...], **kw: Any) -> None:
        requeued.append((job, tuple(exclude)))
        client.requeue(job, hold=bool(exclude))

    monkeypatch.setattr("slurmkit.supervise.endings.requeue_now", requeue_now)
    names = ["n0", "n1", "n2", "n3"]
    fake = fake_slurm_running_job_7(names)
    c = Cluster(tmp_path, [Script(gate=threading.Event()) for _ in names], node_timeout_s=0.3,
                slurm=SlurmClient(fake, retry=RetryPolicy(max_attempts=1, jitter_s=0)))
    c.sups[1].ledger = LedgerDying(c.ledger, "failure")  # n1 claims, then fails before recording
    reporting(c.sups[1])
    node0_dies_once_running(c, [1, 2, 3])
    codes = c.run(agents=[1, 2, 3])
    assert codes == {1: 1, 2: 0, 3: 1}
    assert [e["node"] for e in c.ledger.of("agent_error")] == ["n1"]
    (failure,) = c.ledger.of("failure")
    assert failure["cls"] == "node_loss" and failure["node"] == "n0"
    assert "successor claim 0 made no progress: taken over by n2, node rank 2" in failure["evidence"]
    (decision,) = c.ledger.of("decision")
    assert decision["action"] == "requeue" and decision["exclude"] == ["n0"]
    assert requeued == [("7", ("n0",))] and fake.jobs["7"].restarts == 1
    assert read_claim(claim_path(str(tmp_path), RUN)) == "n1 (node rank 1)"
    assert read_claim(claim_path(str(tmp_path), RUN, 1)) == "n2 (node rank 2)"
    assert read_done(str(tmp_path), RUN) == Done("requeueing", 0, "n2", 2)


def test_a_successor_whose_requeue_landed_before_it_died_is_not_requeued_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    requeued: list[str] = []

    def requeue_then_die(client: SlurmClient, job: str, exclude: tuple[str, ...], **kw: Any) -> None:
        requeued.append(threading.current_thread().name)
        client.requeue(job, hold=bool(exclude))
        raise OSError(5, "Input/output error")  # n1 dies before its done marker

    monkeypatch.setattr("slurmkit.supervise.endings.requeue_now", requeue_then_die)
    names = ["n0", "n1", "n2"]
    fake = fake_slurm_running_job_7(names)
    c = Cluster(tmp_path, [Script(gate=threading.Event()) for _ in names], node_timeout_s=0.3,
                slurm=SlurmClient(fake, retry=RetryPolicy(max_attempts=1, jitter_s=0)))
    reporting(c.sups[1])
    node0_dies_once_running(c, [1, 2])
    codes = c.run(agents=[1, 2])
    assert codes == {1: 1, 2: 0}
    assert len(requeued) == 1 and fake.jobs["7"].restarts == 1  # n2 saw Slurm's requeue and left
    assert [e["node"] for e in c.ledger.of("failure")] == ["n0"]  # n1's record only
    assert read_done(str(tmp_path), RUN) == Done("requeueing", 0, "n2", 2)


def test_an_agent_later_than_node0s_exit_barrier_does_not_requeue_the_finished_job(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    requeued: list[tuple[str, ...]] = []
    monkeypatch.setattr("slurmkit.supervise.endings.requeue_now",
                        lambda client, job, exclude, **kw: requeued.append(tuple(exclude)))
    monkeypatch.setattr(endings, "EXIT_WAIT_S", 0.2)  # node 0 waits this long for a slow agent, then leaves
    fake = fake_slurm_running_job_7(["n0", "n1", "n2"])
    stalled = threading.Event()  # the train nodes' ranks finish once the spare's loop stalls
    c = Cluster(tmp_path, [Script(gate=stalled), Script(gate=stalled), Script()], train_nodes=2, spare_nodes=1,
                node_timeout_s=0.3, slurm=SlurmClient(fake, retry=RetryPolicy(max_attempts=1, jitter_s=0)),
                push=False)  # the stall is injected into the polling loop's sleep
    spare = c.sups[2]
    store = DyingStore(c.store)
    spare.channel.store = store

    def stalls_until_node0_left(s: float) -> None:
        # The spare's loop stalls (its beats go on) past node 0's barrier; node 0's process
        # exits and its store with it.
        if not stalled.is_set():
            stalled.set()
            while 0 not in c.codes:
                threading.Event().wait(0.01)
            store.dead.set()
        time.sleep(s)

    spare.sleep = stalls_until_node0_left  # type: ignore[method-assign]
    codes = c.run()
    assert codes == {0: 0, 1: 0, 2: 0}
    assert [e["status"] for e in c.ledger.of("end")] == ["completed"]
    assert c.ledger.of("failure") == [] and c.ledger.of("decision") == [] and requeued == []
    assert fake.jobs["7"].restarts == 0
    assert not os.path.lexists(claim_path(str(tmp_path), RUN))
    assert read_done(str(tmp_path), RUN) == Done("completed", 0, "n0", 0)
    assert store.dead.is_set() and c.sups[2].decisions == []  # it did find the store gone
