"""A lost agent on a healthy node relaunched in the allocation (slurmkit.supervise.relaunch), in
the one-process supervisor cluster of test_loop: a real in-process store, the fake
Slurm controller behind the real client; the relaunched agent is one more Supervisor, started
by node 0's spawn in its own thread, that rejoins from the sealed message node 0 posted."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from slurmkit.supervise.channel import Channel, ChannelError, Rejoin
from slurmkit.supervise.endwatch import EndWatch
from slurmkit.supervise.loop import Supervisor, Where
from slurmkit.supervise.policy import Action
from slurmkit.errors import SlurmkitError
from slurmkit.launch.context import GROUP_LOG_ENV
from slurmkit.supervise.relaunch import (
    REJOIN_ENV, Relauncher, read_rejoin, shared_srun_command, shared_step_env, step_env,
)
from slurmkit.supervise.stepsended import StepsEnded
from testkit.fakeslurm import FakeSlurm
from tests.unit.supervise.test_loop import TOKEN, Cluster, Script, ScriptedNode
from tests.unit.supervise.test_loop_agent import client, requeued, slurmd  # noqa: F401 - requeued: a fixture


class AgentStep:
    """A relaunched agent as node 0 holds it: a follower Supervisor in a thread (``beats``:
    whether it beats at all; ``fail``: it exits 1 at once, as an srun that cannot start)."""

    def __init__(self, c: Cluster, name: str, nr: int, relaunch: int, *, beats: bool = True,
                 fail: bool = False) -> None:
        self.command, self.log = ["fake-srun", name, str(relaunch)], f"/logs/{name}.r{relaunch}"
        self.code: int | None = 1 if fail else None
        self.stopped = threading.Event()
        self.node = ScriptedNode(name, Script())
        self.sup: Supervisor | None = None
        self.rejoined: Rejoin | None = None
        if fail:
            return
        where = Where(node_rank=nr, nodes=c.names, attempt="7-0", job_id="7", executor="slurm",
                      master_addr="10.0.0.0", addr=f"10.0.0.{nr}")
        ch = Channel(c.store, where.attempt, TOKEN, c.names)
        self.rejoined = read_rejoin(ch, nr, where.attempt, {REJOIN_ENV: str(relaunch)})
        self.sup = Supervisor(c.cfg, where, ch, self.node, c.ledger, train_nodes=len(c.names), run_dir="/nonexistent",
                              free_port=lambda: 23456, end_watch=EndWatch(lambda: ch))
        assert self.rejoined is not None
        self.sup.rejoin(self.rejoined)
        if beats:
            threading.Thread(target=self._beat, args=(ch, nr), daemon=True).start()
        threading.Thread(target=self._run, daemon=True).start()

    def _beat(self, ch: Channel, nr: int) -> None:
        tick = 0
        while self.code is None and not self.stopped.is_set():
            tick += 1
            ch.beat(nr, tick)
            self.stopped.wait(0.02)

    def _run(self) -> None:
        assert self.sup is not None
        self.code = self.sup.run()

    def poll(self) -> int | None:
        return self.code

    def stop(self, wait_s: float) -> None:
        self.stopped.set()


def killed_agent_cluster(tmp_path: Path, **sup: Any) -> tuple[Cluster, list[AgentStep], dict[str, Any]]:
    """n0 and n1; n1's agent beat three times and then went silent while Slurm calls n1 MIXED
    and its slurmd answers (the agent SIGKILLed)."""
    fake = FakeSlurm({"debug": "n[0-1]"})
    c = Cluster(tmp_path, [Script(), Script()], node_timeout_s=0.5, slurm=client(fake), **sup)
    slurmd(c, answers=True)
    fake.nodes["n1"].state = "MIXED"
    for tick in (1, 2, 3):
        c.sups[1].channel.beat(1, tick)
    steps: list[AgentStep] = []
    how: dict[str, Any] = {"beats": True, "fail": False}

    def spawn(name: str, nr: int, relaunch: int) -> AgentStep:
        steps.append(AgentStep(c, name, nr, relaunch, beats=how["beats"], fail=how["fail"]))
        return steps[-1]

    c.sups[0].relauncher = Relauncher(spawn, limit=c.cfg.supervisor.agent_relaunches, first_beat_s=2.0, poll_s=0.01)
    return c, steps, how


def wait_code(step: AgentStep) -> int | None:
    for _ in range(2000):
        if step.code is not None:
            break
        step.stopped.wait(0.01)
    return step.code


def test_a_killed_agent_on_a_healthy_node_is_relaunched_and_rejoins_the_next_generation(
        tmp_path: Path, requeued: list[tuple[str, tuple[str, ...]]]) -> None:
    c, steps, _ = killed_agent_cluster(tmp_path)
    assert c.run(agents=[0]) == {0: 0}
    (step,) = steps
    assert wait_code(step) == 0  # the new agent completed the run with node 0
    assert step.rejoined == Rejoin("7-0", 1, 1, 1, (0, 1), ())
    assert step.node.started == [(1, 1, 12345)]  # slot 1 in generation 1, node 0's rendezvous port
    assert c.nodes[0].started == [(0, 0, 12345), (1, 0, 12345)]
    (kept,) = c.ledger.of("node_kept")
    assert kept["node"] == "n1"
    (rel,) = c.ledger.of("agent_relaunched")
    assert (rel["node"], rel["node_rank"], rel["generation"], rel["relaunch"], rel["slot"]) == ("n1", 1, 1, 1, 1)
    assert rel["command"] == ["fake-srun", "n1", "1"] and rel["first_beat_s"] >= 0
    assert c.decisions() == [(0, Action.RESTART, ())]
    assert "agent relaunched on n1" in c.ledger.of("decision")[0]["reason"]
    assert requeued == [] and not c.ledger.of("exclusion") and not c.ledger.of("agent_relaunch_failed")
    assert [e["status"] for e in c.ledger.of("end")] == ["completed"]


def test_a_relaunch_without_a_first_beat_falls_back_to_a_requeue_keeping_the_node(
        tmp_path: Path, requeued: list[tuple[str, tuple[str, ...]]]) -> None:
    c, steps, how = killed_agent_cluster(tmp_path)
    how["beats"] = False  # it starts, but never beats within the deadline
    assert c.run(agents=[0]) == {0: 0}
    (step,) = steps
    assert step.stopped.is_set()  # node 0 ended the step it started
    (failed,) = c.ledger.of("agent_relaunch_failed")
    assert failed["node"] == "n1" and "no first beat" in failed["why"] and failed["relaunch"] == 1
    assert not c.ledger.of("agent_relaunched")
    assert c.decisions() == [(0, Action.REQUEUE, ())] and requeued == [("7", ())]


def test_an_srun_that_fails_falls_back_at_once(tmp_path: Path, requeued: list[tuple[str, tuple[str, ...]]]) -> None:
    c, steps, how = killed_agent_cluster(tmp_path)
    how["fail"] = True
    assert c.run(agents=[0]) == {0: 0}
    (failed,) = c.ledger.of("agent_relaunch_failed")
    assert "exited with code 1 before its first beat" in failed["why"]
    assert c.decisions() == [(0, Action.REQUEUE, ())] and requeued == [("7", ())]


def test_agent_relaunches_0_never_relaunches(tmp_path: Path, requeued: list[tuple[str, tuple[str, ...]]]) -> None:
    c, steps, _ = killed_agent_cluster(tmp_path, agent_relaunches=0)
    assert c.run(agents=[0]) == {0: 0}
    assert steps == []
    (failed,) = c.ledger.of("agent_relaunch_failed")
    assert "supervisor.agent_relaunches=0" in failed["why"]
    assert c.decisions() == [(0, Action.REQUEUE, ())] and requeued == [("7", ())]


def shared_step_cluster(tmp_path: Path, spare: bool) -> tuple[Cluster, list[AgentStep]]:
    """n0 alone in its srun step, n1 and n2 in one step (launch.nodes_per_step=2), n3 a spare
    (when ``spare``). n1 died (Slurm: DOWN*), which ended the step: n2's agent was killed with
    it while n2 is healthy (MIXED, its slurmd answers). Both beat three times, then nothing."""
    fake = FakeSlurm({"debug": "n[0-3]" if spare else "n[0-2]"})
    scripts = [Script(), Script(), Script()] + ([Script()] if spare else [])
    c = Cluster(tmp_path, scripts, train_nodes=3, spare_nodes=1 if spare else 0, node_timeout_s=0.5,
                slurm=client(fake))
    slurmd(c, answers=True)
    fake.nodes["n1"].state = "DOWN*"
    fake.nodes["n2"].state = "MIXED"
    for tick in (1, 2, 3):
        c.sups[1].channel.beat(1, tick)
        c.sups[2].channel.beat(2, tick)
    steps: list[AgentStep] = []

    def spawn(name: str, nr: int, relaunch: int) -> AgentStep:
        steps.append(AgentStep(c, name, nr, relaunch))
        return steps[-1]

    c.sups[0].relauncher = Relauncher(spawn, limit=1, first_beat_s=2.0, poll_s=0.01)
    return c, steps


def test_a_lost_node_in_a_shared_step_takes_a_spare_and_its_step_peers_are_relaunched(
        tmp_path: Path, requeued: list[tuple[str, tuple[str, ...]]]) -> None:
    c, steps = shared_step_cluster(tmp_path, spare=True)
    assert c.run(agents=[0, 3]) == {0: 0, 3: 0}
    (step,) = steps  # n2's agent only: n1 is dead
    assert wait_code(step) == 0
    # n2 rejoins in its own slot, with the slots as they are after the spare took n1's
    assert step.rejoined == Rejoin("7-0", 1, 1, 2, (0, 3, 2), ())
    assert step.node.started == [(1, 2, 12345)]
    assert c.nodes[3].started == [(1, 1, 12345)]  # the spare in n1's slot
    assert c.decisions() == [(0, Action.REPLACE_NODE, ("n1",))]
    reason = c.ledger.of("decision")[0]["reason"]
    assert "replacing n1 with a spare" in reason and "relaunched on n2" in reason
    (failure,) = c.ledger.of("failure")
    assert failure["cls"] == "node_loss"
    assert [k["node"] for k in c.ledger.of("node_kept")] == ["n2"]
    (rel,) = c.ledger.of("agent_relaunched")
    assert (rel["node"], rel["slot"], rel["generation"]) == ("n2", 2, 1)
    assert requeued == [] and [e["status"] for e in c.ledger.of("end")] == ["completed"]


def test_a_lost_node_in_a_shared_step_without_a_spare_requeues_without_it_and_relaunches_nothing(
        tmp_path: Path, requeued: list[tuple[str, tuple[str, ...]]]) -> None:
    c, steps = shared_step_cluster(tmp_path, spare=False)
    assert c.run(agents=[0]) == {0: 0}
    assert steps == []
    assert c.decisions() == [(0, Action.REQUEUE, ("n1",))] and requeued == [("7", ("n1",))]


def test_a_step_the_batch_script_says_ended_is_a_lost_agent_at_once(
        tmp_path: Path, requeued: list[tuple[str, tuple[str, ...]]]) -> None:
    # A liveness deadline of minutes: only the batch script's word can end generation 0 quickly.
    fake = FakeSlurm({"debug": "n[0-1]"})
    c = Cluster(tmp_path, [Script(), Script()], node_timeout_s=120.0, startup_timeout_s=120.0, slurm=client(fake))
    slurmd(c, answers=True)
    fake.nodes["n1"].state = "MIXED"
    c.sups[1].channel.beat(1, 1)
    ended = tmp_path / "slurmkit-steps.abc"
    ended.write_text("1 1 137\n")  # n1's step ended: its agent SIGKILLed
    c.sups[0].steps_ended = StepsEnded(str(ended), 2)
    steps: list[AgentStep] = []

    def spawn(name: str, nr: int, relaunch: int) -> AgentStep:
        steps.append(AgentStep(c, name, nr, relaunch))
        return steps[-1]

    c.sups[0].relauncher = Relauncher(spawn, limit=1, first_beat_s=5.0, poll_s=0.01)
    assert c.run(agents=[0]) == {0: 0}
    (failure,) = c.ledger.of("failure")
    assert failure["node"] == "n1" and "its srun step (node ranks 1-1) ended with code 137" in failure["evidence"]
    assert [r["node"] for r in c.ledger.of("agent_relaunched")] == ["n1"] and wait_code(steps[0]) == 0
    # the same node's old step said again (or late): its agent runs in node 0's step now
    with ended.open("a") as f:
        f.write("1 1 9\n")
    assert c.sups[0].lost_agents() == []


class SharedStep:
    """Several relaunched agents in one step, as srun_spawn_many starts them."""

    def __init__(self, c: Cluster, agents: list[tuple[str, int, int]]) -> None:
        self.parts = [AgentStep(c, name, nr, n) for name, nr, n in agents]
        self.command, self.log = ["fake-srun", ",".join(a[0] for a in agents)], "/logs/shared"

    def poll(self) -> int | None:
        codes = [p.poll() for p in self.parts]
        return None if None in codes else max(c for c in codes if c is not None)

    def stop(self, wait_s: float) -> None:
        for p in self.parts:
            p.stop(wait_s)


def test_agents_lost_together_come_back_in_one_step(tmp_path: Path, requeued: list[tuple[str, tuple[str, ...]]]) -> None:
    fake = FakeSlurm({"debug": "n[0-2]"})
    c = Cluster(tmp_path, [Script(), Script(), Script()], node_timeout_s=0.5, slurm=client(fake))
    slurmd(c, answers=True)
    for name, nr in (("n1", 1), ("n2", 2)):
        fake.nodes[name].state = "MIXED"
        for tick in (1, 2, 3):
            c.sups[nr].channel.beat(nr, tick)
    calls: list[list[tuple[str, int, int]]] = []
    shared: list[SharedStep] = []

    def spawn(name: str, nr: int, relaunch: int) -> AgentStep:
        raise AssertionError("one step per agent")

    def spawn_many(agents: Any) -> SharedStep:
        calls.append(list(agents))
        shared.append(SharedStep(c, list(agents)))
        return shared[-1]

    c.sups[0].relauncher = Relauncher(spawn, limit=1, first_beat_s=2.0, poll_s=0.01, spawn_many=spawn_many)
    assert c.run(agents=[0]) == {0: 0}
    assert calls == [[("n1", 1, 1), ("n2", 2, 1)]]  # one srun step for both
    assert [wait_code(p) for p in shared[0].parts] == [0, 0]
    assert [p.rejoined.slot for p in shared[0].parts if p.rejoined] == [1, 2]
    assert sorted(r["node"] for r in c.ledger.of("agent_relaunched")) == ["n1", "n2"]
    assert c.decisions() == [(0, Action.RESTART, ())] and requeued == []


def test_a_shared_relaunch_step_names_each_agents_relaunch_and_log(tmp_path: Path) -> None:
    env = {"SLURM_JOB_ID": "7", "SLURM_STEPID": "0", "SLURMKIT_NODE_RANK": "0", "SLURMKIT_NODES": "n0,n1,n2,n3",
           "SLURM_JOB_NUM_NODES": "4", "SLURM_JOB_NODELIST": "n[0-3]", "SLURMD_NODENAME": "n0"}
    out = shared_step_env(env, [("n2", 2, 1), ("n3", 3, 2)], "/runs/x/submitit")
    assert "SLURMKIT_NODE_RANK" not in out and "SLURMD_NODENAME" not in out and "SLURM_STEPID" not in out
    assert out[REJOIN_ENV] == "n2=1,n3=2" and out[GROUP_LOG_ENV] == "/runs/x/submitit"
    assert out["SLURM_NNODES"] == "4"
    cmd = shared_srun_command(["srun", "--unbuffered"], "/runs/x", ["n2", "n3"], "/runs/x/submitit/o_%t")
    assert cmd[:7] == ["srun", "--unbuffered", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1",
                       "--nodelist=n2,n3", "--output=/runs/x/submitit/o_%t"]
    # each agent of the step takes its own node's relaunch number
    ch = channel()
    ch.post_rejoin(2, Rejoin("7-0", 2, 4, 1, (0, 2), ()))
    assert read_rejoin(ch, 2, "7-0", {REJOIN_ENV: "n1=1,n2=2"}, "n2") == Rejoin("7-0", 2, 4, 1, (0, 2), ())
    with pytest.raises(SlurmkitError, match="does not name this node"):
        read_rejoin(ch, 2, "7-0", {REJOIN_ENV: "n1=1,n2=2"}, "n9")


def test_the_cap_is_per_node_and_allocation() -> None:
    store = dist.HashStore()
    ch = Channel(store, "7-0", TOKEN, ("n0", "n1"))
    ch.seed_beats([0, 1])

    class Beating:
        command, log = ["x"], "y"

        def __init__(self) -> None:
            ch.beat(1, 1)

        def poll(self) -> int | None:
            return None

        def stop(self, wait_s: float) -> None:
            pass

    r = Relauncher(lambda name, nr, n: Beating(), limit=1, first_beat_s=1.0, poll_s=0.01)
    assert r.left("n1") == 1
    res = r.relaunch(ch, "7-0", 3, [0, 1], [], [("n1", 1)])
    assert res.ok and [(s.node, s.relaunch) for s in res.started] == [("n1", 1)]
    assert r.left("n1") == 0 and r.left("n0") == 1
    assert ch.rejoin(1, "7-0") == Rejoin("7-0", 1, 3, 1, (0, 1), ())


# ------------------------------------------------------------------ the rejoin message
def channel() -> Channel:
    return Channel(dist.HashStore(), "7-0", TOKEN, ("n0", "n1", "n2"))


def test_the_rejoin_message_round_trips_and_is_checked_against_this_relaunch() -> None:
    ch = channel()
    ch.post_rejoin(2, Rejoin("7-0", 1, 4, 1, (0, 2), (1,)))
    assert read_rejoin(ch, 2, "7-0", {REJOIN_ENV: "1"}) == Rejoin("7-0", 1, 4, 1, (0, 2), (1,))
    assert read_rejoin(ch, 2, "7-0", {}) is None  # a first agent reads nothing
    with pytest.raises(ChannelError, match="found relaunch 1's rejoin message"):
        read_rejoin(ch, 2, "7-0", {REJOIN_ENV: "2"})  # an earlier relaunch's message
    with pytest.raises(ChannelError, match="found none"):
        read_rejoin(ch, 1, "7-0", {REJOIN_ENV: "1"})
    with pytest.raises(Exception, match="Detected: SLURMKIT_REJOIN='x'"):
        read_rejoin(ch, 2, "7-0", {REJOIN_ENV: "x"})


def test_a_forged_rejoin_value_is_refused_and_cleared() -> None:
    ch = channel()
    key = ch._rejoin_key(1)
    ch.store.set(key, json.dumps({"p": json.dumps({"attempt": "7-0"}), "mac": "0" * 64}))
    with pytest.raises(ChannelError, match="wrong HMAC"):
        ch.rejoin(1, "7-0")
    assert ch.rejoin(1, "7-0") is None  # cleared: node 0's own message can still land
    ch.store.set(key, b"\xff garbage")
    with pytest.raises(ChannelError, match="unsealed"):
        ch.rejoin(1, "7-0")


@pytest.mark.parametrize("payload, why", [
    ({"attempt": "7-0"}, "fields"),
    ({"attempt": "7-1", "relaunch": 1, "generation": 1, "slot": 1, "slots": [0, 1], "spares": []}, "attempt"),
    ({"attempt": "7-0", "relaunch": 0, "generation": 1, "slot": 1, "slots": [0, 1], "spares": []}, "out of range"),
    ({"attempt": "7-0", "relaunch": 1, "generation": True, "slot": 1, "slots": [0, 1], "spares": []}, "out of range"),
    ({"attempt": "7-0", "relaunch": 1, "generation": 1, "slot": 0, "slots": [0, 1], "spares": []}, "not this agent"),
    ({"attempt": "7-0", "relaunch": 1, "generation": 1, "slot": 1, "slots": [0, 7], "spares": []}, "out of range"),
    ({"attempt": "7-0", "relaunch": 1, "generation": 1, "slot": 1, "slots": [0, 1], "spares": [1]}, "twice"),
    ({"attempt": "7-0", "relaunch": 1, "generation": 1, "slot": 1, "slots": "01", "spares": []}, "not lists"),
])
def test_a_malformed_rejoin_message_is_refused(payload: dict[str, Any], why: str) -> None:
    ch = channel()
    key = ch._rejoin_key(1)
    ch.store.set(key, ch._seal(key, payload))  # sealed with the token: only its content is wrong
    with pytest.raises(ChannelError, match=why) as exc:
        ch.rejoin(1, "7-0")
    assert "Fix:" in str(exc.value)


def test_the_relaunch_step_environment_is_the_batch_scripts() -> None:
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "4", "SLURM_JOB_NODELIST": "node[1-4]",
           "SLURM_NNODES": "1", "SLURM_NODELIST": "node1", "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "node1",
           "SLURM_NTASKS": "1", "SLURM_CPU_BIND": "none", "SLURM_PROCID": "0", "CUDA_VISIBLE_DEVICES": "0,1",
           "SLURMKIT_NODE_RANK": "0", "SLURMKIT_NODES": "node1,node2", "PATH": "/bin", "SLURM_RESTART_COUNT": "2"}
    out = step_env(env, 3, 1)
    assert out == {"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "4", "SLURM_JOB_NODELIST": "node[1-4]",
                   "SLURM_NNODES": "4", "SLURM_NODELIST": "node[1-4]", "SLURMKIT_NODE_RANK": "3",
                   "SLURMKIT_NODES": "node1,node2", "PATH": "/bin", "SLURM_RESTART_COUNT": "2", REJOIN_ENV: "1"}
