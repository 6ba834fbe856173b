"""Node 0's successor: the election through the run directory (a recorded clock), and the loop
with node 0 and node rank 1 lost together, where node rank 2 must act (scripted agents over one
real in-process store, the harness of test_loop)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from slurmkit.slurm.client import SlurmClient
from slurmkit.supervise.exits.succession import claim_path, elect, read_claim
from testkit.fakeslurm import FakeSlurm
from tests.unit.supervise.test_loop import Cluster, DyingStore, Script


class Clock:
    def __init__(self, on_sleep=lambda now: None) -> None:  # noqa: ANN001
        self.now, self.on_sleep = 0.0, on_sleep

    def clock(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s
        self.on_sleep(self.now)


def test_node_rank_1_claims_at_once(tmp_path: Path) -> None:
    path = claim_path(str(tmp_path), "7-0")
    t = Clock()
    assert elect(path, 1, "n1", grace_s=3.0, clock=t.clock, sleep=t.sleep)
    assert t.now == 0.0 and read_claim(path) == "n1 (node rank 1)"
    assert os.stat(path).st_mode & 0o777 == 0o600


def test_a_higher_rank_leaves_when_a_lower_one_claims_within_its_grace(tmp_path: Path) -> None:
    path = claim_path(str(tmp_path), "7-0")
    os.makedirs(os.path.dirname(path))
    # node rank 1 claims 2 s in, inside node rank 3's wait of 2 x 3 s
    t = Clock(lambda now: now >= 2.0 and not os.path.exists(path) and elect(path, 1, "n1", grace_s=3.0))
    assert not elect(path, 3, "n3", grace_s=3.0, clock=t.clock, sleep=t.sleep)
    assert read_claim(path) == "n1 (node rank 1)" and t.now < 3.0


def test_with_no_lower_claim_the_rank_claims_after_its_grace(tmp_path: Path) -> None:
    path = claim_path(str(tmp_path), "7-0")
    t = Clock()
    assert elect(path, 3, "n3", grace_s=3.0, clock=t.clock, sleep=t.sleep)
    assert t.now == pytest.approx(6.0) and read_claim(path) == "n3 (node rank 3)"


def test_of_many_that_claim_at_once_exactly_one_wins(tmp_path: Path) -> None:
    path = claim_path(str(tmp_path), "7-0")
    start = threading.Barrier(16)
    won: list[int] = []

    def run(nr: int) -> None:
        start.wait()
        if elect(path, 1, f"n{nr}", grace_s=0.0):
            won.append(nr)

    threads = [threading.Thread(target=run, args=(nr,)) for nr in range(16)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(won) == 1 and read_claim(path) == f"n{won[0]} (node rank 1)"


def test_a_requeued_attempt_elects_again(tmp_path: Path) -> None:
    assert elect(claim_path(str(tmp_path), "7-0"), 1, "n1", grace_s=0.0)
    assert elect(claim_path(str(tmp_path), "7-1"), 1, "n2", grace_s=0.0)


def test_node0_and_node_rank_1_lost_together_node_rank_2_records_and_requeues(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    requeued: list[tuple[str, tuple[str, ...]]] = []
    monkeypatch.setattr("slurmkit.supervise.endings.requeue_now",
                        lambda client, job, exclude, **kw: requeued.append((job, tuple(exclude))))
    gate = threading.Event()
    c = Cluster(tmp_path, [Script(gate=gate) for _ in range(4)], node_timeout_s=0.3,
                slurm=SlurmClient(FakeSlurm({"debug": "n[0-3]"})))
    dying = {nr: DyingStore(c.store) for nr in (2, 3)}
    for nr, d in dying.items():
        c.sups[nr].channel.store = d
        c.sups[nr].probe_slurmd = lambda addr, port: False  # the nodes died: their slurmd too
    c.sups[0].channel.post_port(0, 12345)  # node 0 started generation 0; then n0 and n1 died

    def kill_once_running() -> None:
        while not all(c.nodes[nr].started for nr in (2, 3)):
            threading.Event().wait(0.01)
        for d in dying.values():
            d.dead.set()

    threading.Thread(target=kill_once_running, daemon=True).start()
    codes = c.run(agents=[2, 3])  # n1's agent never runs: lost with node 0
    assert codes == {2: 0, 3: 1}
    (failure,) = c.ledger.of("failure")
    assert failure["cls"] == "node_loss" and failure["node"] == "n0"
    assert "recorded by n2, node rank 2" in failure["evidence"]
    (decision,) = c.ledger.of("decision")
    assert decision["action"] == "requeue" and decision["exclude"] == ["n0"]
    assert requeued == [("7", ("n0",))]
    assert read_claim(claim_path(str(tmp_path), "7-0")) == "n2 (node rank 2)"
