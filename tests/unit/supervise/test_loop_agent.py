"""An agent that dies (its own exception, or killed while its node stays healthy) and the
requeue caps, in the one-process supervisor cluster of test_loop: a real in-process
store, the fake Slurm controller behind the real client, the decisions read from the ledger."""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path

import pytest

from slurmkit import EXIT_NO_REQUEUE
from slurmkit.slurm.client import SlurmClient
from slurmkit.slurm.retry import RetryPolicy
from slurmkit.failures.classify import Evidence
from slurmkit.supervise.policy import Action
from testkit.fakeslurm import FakeSlurm
from tests.unit.supervise.test_loop import Cluster, Script, ScriptedNode, open_gate_on_event


class FailingAgentNode(ScriptedNode):
    """Its agent (not a rank) fails while watching generation ``gen``: e.g. a heartbeat JSON
    without "step" that the monitor cannot read."""

    def __init__(self, name: str, script: Script, gen: int = 0) -> None:
        super().__init__(name, script)
        self.fail_gen = gen
        self.stops = 0

    def poll(self, gen: int) -> Evidence | None:
        if gen == self.fail_gen:
            raise ValueError("heartbeat JSON without 'step'")
        return super().poll(gen)

    def stop(self) -> list[Evidence]:
        self.stops += 1
        return []


def client(fake: FakeSlurm) -> SlurmClient:
    return SlurmClient(fake, retry=RetryPolicy(max_attempts=1, jitter_s=0))


def slurmd(c: Cluster, answers: bool) -> list[tuple[str, int]]:
    """Every agent's probe of a lost node's slurmd answers ``answers``; returns the probes made
    (the fake controller's nodes have no daemon behind their ports)."""
    probes: list[tuple[str, int]] = []

    def probe(addr: str, port: int) -> bool:
        probes.append((addr, port))
        return answers

    for s in c.sups:
        s.probe_slurmd = probe
    return probes


def guarded(c: Cluster) -> Cluster:
    """The agents run as agent_main runs them: an exception becomes agent_error."""
    def run(nr: int) -> None:
        try:
            c.codes[nr] = c.sups[nr].run_or_report()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            c.errors.append(exc)

    c._run = run  # type: ignore[method-assign]
    return c


def with_failing(c: Cluster, nr: int, gen: int = 0) -> FailingAgentNode:
    node = FailingAgentNode(c.names[nr], c.nodes[nr].script, gen)
    c.nodes[nr] = node
    c.sups[nr].node = node
    return node


@pytest.fixture
def requeued(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, tuple[str, ...]]]:
    calls: list[tuple[str, tuple[str, ...]]] = []
    monkeypatch.setattr("slurmkit.supervise.endings.requeue_now",
                        lambda client, job, exclude, **kw: calls.append((job, tuple(exclude))))
    return calls


def test_an_agent_error_stops_its_ranks_tells_node0_at_once_and_keeps_the_node(
        tmp_path: Path, requeued: list[tuple[str, tuple[str, ...]]]) -> None:
    # A liveness deadline of minutes: only the agent's own report can end this test quickly.
    gate = threading.Event()
    c = guarded(Cluster(tmp_path, [Script(gate=gate), Script()], node_timeout_s=120.0,
                        slurm=client(FakeSlurm({"debug": "n[0-1]"}))))
    bad = with_failing(c, 1)
    slurmd(c, answers=False)  # the agent's own word is enough: Slurm does not call the node dead
    assert c.run() == {0: 0, 1: 1}
    assert bad.stops == 1  # its ranks were stopped before it left
    (err,) = c.ledger.of("agent_error")
    assert err["node"] == "n1" and "ValueError: heartbeat JSON without 'step'" in err["error"]
    (failure,) = c.ledger.of("failure")
    assert failure["cls"] == "node_loss" and failure["node"] == "n1" and "agent on n1 failed" in failure["evidence"]
    (kept,) = c.ledger.of("node_kept")
    assert kept["node"] == "n1" and "reported its own error" in kept["why"] and kept["slurm_state"] == "IDLE"
    assert c.decisions() == [(0, Action.REQUEUE, ())]
    assert requeued == [("7", ())]
    assert not c.ledger.of("exclusion")


def test_an_agent_error_with_a_spare_gives_the_slot_to_the_spare(tmp_path: Path) -> None:
    gate = threading.Event()
    c = guarded(Cluster(tmp_path, [Script(gate=gate), Script(), Script(gate=gate)], train_nodes=2,
                        spare_nodes=1, node_timeout_s=120.0))
    slurmd(c, answers=False)
    with_failing(c, 1)
    open_gate_on_event(c, "exclusion", gate)
    assert c.run() == {0: 0, 1: 1, 2: 0}
    assert c.decisions() == [(0, Action.REPLACE_NODE, ("n1",))]
    assert c.nodes[2].started == [(1, 1, 12345)]
    assert [k["node"] for k in c.ledger.of("node_kept")] == ["n1"]  # no Slurm: the agent's word
    assert [e["status"] for e in c.ledger.of("end")] == ["completed"]


def test_a_killed_agent_on_a_node_slurm_calls_healthy_is_not_excluded(
        tmp_path: Path, requeued: list[tuple[str, tuple[str, ...]]]) -> None:
    # The chaos campaign's case: the agent of n1 SIGKILLed, slurmd alive (the node is ALLOCATED).
    fake = FakeSlurm({"debug": "n[0-1]"})
    c = Cluster(tmp_path, [Script(), Script()], node_timeout_s=0.5, slurm=client(fake))
    probes = slurmd(c, answers=True)
    fake.nodes["n1"].state = "MIXED"
    for tick in (1, 2, 3):
        c.sups[1].channel.beat(1, tick)  # then silence: its agent never runs
    assert c.run(agents=[0]) == {0: 0}
    (failure,) = c.ledger.of("failure")
    assert failure["cls"] == "node_loss" and "Slurm says MIXED" in failure["evidence"]
    (kept,) = c.ledger.of("node_kept")
    assert kept["node"] == "n1" and kept["slurm_state"] == "MIXED" and "slurmd answers" in kept["why"]
    assert c.decisions() == [(0, Action.REQUEUE, ())] and requeued == [("7", ())]
    assert probes == [("127.0.0.1", 17002)]  # n1's slurmd, once, at the decision


def test_a_dead_node_that_slurm_still_calls_mixed_is_excluded(
        tmp_path: Path, requeued: list[tuple[str, tuple[str, ...]]]) -> None:
    # A node that died seconds ago: slurmctld calls it MIXED until SlurmdTimeout, but its
    # slurmd does not answer. It must not be kept.
    fake = FakeSlurm({"debug": "n[0-1]"})
    c = Cluster(tmp_path, [Script(), Script()], node_timeout_s=0.5, slurm=client(fake))
    slurmd(c, answers=False)
    fake.nodes["n1"].state = "MIXED"
    for tick in (1, 2, 3):
        c.sups[1].channel.beat(1, tick)
    assert c.run(agents=[0]) == {0: 0}
    assert not c.ledger.of("node_kept")
    assert c.decisions() == [(0, Action.REQUEUE, ("n1",))] and requeued == [("7", ("n1",))]


def test_a_killed_agent_on_a_node_slurm_calls_down_is_excluded(
        tmp_path: Path, requeued: list[tuple[str, tuple[str, ...]]]) -> None:
    fake = FakeSlurm({"debug": "n[0-2]"})
    fake.fail_node("n1", reason="Not responding")
    c = Cluster(tmp_path, [Script(), Script()], node_timeout_s=0.5, slurm=client(fake))
    probes = slurmd(c, answers=True)
    for tick in (1, 2, 3):
        c.sups[1].channel.beat(1, tick)
    assert c.run(agents=[0]) == {0: 0}
    assert not c.ledger.of("node_kept") and probes == []  # Slurm's DOWN is enough: not probed
    assert c.decisions() == [(0, Action.REQUEUE, ("n1",))] and requeued == [("7", ("n1",))]


def test_node0s_own_agent_error_requeues_keeping_every_node(
        tmp_path: Path, requeued: list[tuple[str, tuple[str, ...]]]) -> None:
    c = guarded(Cluster(tmp_path, [Script(), Script()], slurm=client(FakeSlurm({"debug": "n[0-1]"}))))
    bad = with_failing(c, 0)
    slurmd(c, answers=False)
    assert c.run(agents=[0]) == {0: 0}
    assert bad.stops == 1
    assert [k["node"] for k in c.ledger.of("node_kept")] == ["n0"]
    assert c.decisions() == [(0, Action.REQUEUE, ())] and requeued == [("7", ())]


# ------------------------------------------------------------------ the caps
def test_max_requeues_reached_stops_with_93_and_says_why(
        tmp_path: Path, requeued: list[tuple[str, tuple[str, ...]]], capsys: pytest.CaptureFixture[str]) -> None:
    marks = tmp_path / "requeues"
    marks.mkdir()
    for attempt in ("7-0", "7-1"):  # two earlier attempts requeued after failures
        (marks / f"failure.{attempt}").touch()
    c = guarded(Cluster(tmp_path, [Script(), Script()], node_timeout_s=120.0, max_requeues=2,
                        slurm=client(FakeSlurm({"debug": "n[0-1]"}))))
    for s in c.sups:
        s.where = replace(s.where, attempt="7-2", restart_count=2)
    with_failing(c, 1)
    slurmd(c, answers=False)
    assert c.run() == {0: EXIT_NO_REQUEUE, 1: 1}
    assert requeued == []
    (refused,) = c.ledger.of("requeue_refused")
    assert refused["failure_requeues"] == 2 and refused["max_requeues"] == 2
    (end,) = c.ledger.of("end")
    assert end["exit_code"] == EXIT_NO_REQUEUE and "Detected: 2 requeues" in end["reason"]
    assert "Fix:" in end["reason"]
    assert "Detected: 2 requeues" in capsys.readouterr().err  # and in the job's log


def test_a_failure_requeue_leaves_a_mark_that_the_next_attempt_counts(
        tmp_path: Path, requeued: list[tuple[str, tuple[str, ...]]]) -> None:
    c = guarded(Cluster(tmp_path, [Script(), Script()], node_timeout_s=120.0,
                        slurm=client(FakeSlurm({"debug": "n[0-1]"}))))
    with_failing(c, 1)
    slurmd(c, answers=False)
    c.run()
    assert requeued == [("7", ())]
    assert sorted(p.name for p in (tmp_path / "requeues").iterdir()) == ["failure.7-0"]
    assert c.sups[0].failure_requeues() == 0  # its own mark is not an earlier requeue


def test_exclusions_that_leave_the_partition_too_small_stop_with_93(
        tmp_path: Path, requeued: list[tuple[str, tuple[str, ...]]]) -> None:
    fake = FakeSlurm({"debug": "n[0-1]"})
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\n#SBATCH --nodes=2\n#SBATCH --requeue\nsrun true\n")
    job_id = fake.run(["sbatch", "--parsable", str(script)]).stdout.strip()
    fake.start(job_id, ["n0", "n1"])
    c = Cluster(tmp_path, [Script(), Script()], node_timeout_s=0.5, slurm=client(fake))
    slurmd(c, answers=False)
    for s in c.sups:
        s.where = replace(s.where, job_id=job_id)
    for tick in (1, 2, 3):
        c.sups[1].channel.beat(1, tick)
    fake.nodes["n1"].flags = ["DRAIN"]  # n1 is bad: excluding it leaves one node of two
    assert c.run(agents=[0]) == {0: EXIT_NO_REQUEUE}
    assert requeued == []
    (refused,) = c.ledger.of("requeue_refused")
    assert refused["partition"] == "debug" and refused["partition_nodes"] == 2 and refused["needed"] == 2
    assert refused["excluded"] == ["n1"]
    (end,) = c.ledger.of("end")
    assert "leaving 1 for a job of 2 nodes" in end["reason"] and "BadConstraints" in end["reason"]


def test_the_slurmd_probe_tells_a_listening_daemon_from_a_dead_one() -> None:
    import socket

    from slurmkit.supervise.slurmview import node_health, slurmd_answers

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert slurmd_answers("127.0.0.1", port)
    assert not slurmd_answers("127.0.0.1", port)  # closed now: refused at once
    fake = FakeSlurm({"debug": "n[0-2]"})
    fake.fail_node("n2")
    seen: list[int] = []
    health = node_health(["n1", "n2"], client(fake), lambda addr, p: seen.append(p) or True)
    assert health == {"n1": ("IDLE", True), "n2": ("DOWN+NOT_RESPONDING", None)}, health
    assert seen == [17002]  # the node Slurm calls dead is not probed
    # A node on the cluster's SlurmdPort shows no Port (as scontrol prints it; on most sites no
    # node does): it is probed on the SlurmdPort from `scontrol show config`.
    seen.clear()
    assert node_health(["n0", "n1"], client(fake), lambda addr, p: seen.append(p) or True) == {
        "n0": ("IDLE", True), "n1": ("IDLE", True)}
    assert seen == [17001, 17002]


def test_a_spares_agent_error_fails_no_generation(tmp_path: Path) -> None:
    gate = threading.Event()
    # push=False: the error is injected into the change counter's poll
    c = guarded(Cluster(tmp_path, [Script(gate=gate), Script(gate=gate), Script()], train_nodes=2,
                        spare_nodes=1, node_timeout_s=120.0, push=False))
    spare = c.sups[2]
    report = spare.agent_error

    def broken(gen: int) -> int:
        raise ValueError("a store reply this agent cannot read")

    def reported(exc: BaseException) -> int:
        code = report(exc)
        gate.set()  # the train nodes finish only once the spare has said all it says
        return code

    spare.channel.changes = broken  # type: ignore[method-assign]
    spare.agent_error = reported  # type: ignore[method-assign]
    assert c.run() == {0: 0, 1: 0, 2: 1}
    assert [e["node"] for e in c.ledger.of("agent_error")] == ["n2"]
    assert c.decisions() == [] and not c.ledger.of("failure")
    assert [e["status"] for e in c.ledger.of("end")] == ["completed"]


def test_a_requeue_slurm_refuses_stops_with_93_and_says_how_to_resume(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A site whose QOS or job_submit plugin forbids `scontrol requeue` (here: the fake
    controller refuses it, as Slurm does for a job it will not requeue): node 0 stops with 93
    and says so, instead of dying on the exception (the job ended FAILED with exit 1)."""
    fake = FakeSlurm({"debug": "n[0-1]"})  # job 7 unknown to it: scontrol's own refusal text
    calls: list[str] = []

    def refusing(slurm: SlurmClient, job_id: str, exclude: tuple[str, ...], **kw: object) -> None:
        calls.append(job_id)
        slurm.requeue(job_id, hold=bool(exclude))  # the real client: raises SlurmCommandError

    monkeypatch.setattr("slurmkit.supervise.endings.requeue_now", refusing)
    c = guarded(Cluster(tmp_path, [Script(), Script()], node_timeout_s=120.0,
                        slurm=client(fake)))
    with_failing(c, 1)
    slurmd(c, answers=False)
    assert c.run() == {0: EXIT_NO_REQUEUE, 1: 1}
    assert calls == ["7"] and not c.errors
    (refused,) = c.ledger.of("requeue_refused")
    assert "Detected: Slurm refused `scontrol requeue 7`" in refused["reason"]
    assert "Invalid job id" in refused["reason"] and "store.run_id=" in refused["reason"]
    (end,) = c.ledger.of("end")
    assert end["exit_code"] == EXIT_NO_REQUEUE and end["reason"] == refused["reason"]
    assert "Slurm refused" in capsys.readouterr().err  # and in the job's log
