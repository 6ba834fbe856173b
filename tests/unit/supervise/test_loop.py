"""The supervisor loop in one process: one Supervisor per scripted node agent, each in its own
thread, all talking through the typed channel over one real in-process store (HashStore, the
TCPStore's semantics without sockets). Scripted fault sequences; the decisions are asserted."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from slurmkit import EXIT_NO_REQUEUE
from slurmkit.config import compose
from slurmkit.ledger.events import validate
from slurmkit.slurm.client import SlurmClient
from slurmkit.slurm.retry import RetryPolicy
from slurmkit.supervise.channel import Channel
from slurmkit.failures.classes import FailureClass
from slurmkit.failures.classify import Evidence
from slurmkit.supervise.endwatch import EndWatch
from slurmkit.supervise.loop import Supervisor, Where
from slurmkit.supervise.policy import Action
from testkit.fakeslurm import FakeSlurm

F = FailureClass
TOKEN = bytes(range(32))


class Ledger:
    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def append(self, event: str, **fields: Any) -> dict[str, Any]:
        validate(event, fields)  # the real ledger's schema (slurmkit/ledger/events.py)
        with self.lock:
            self.events.append({"event": event, **fields})
        return self.events[-1]

    def of(self, event: str) -> list[dict[str, Any]]:
        with self.lock:
            return [e for e in self.events if e["event"] == event]


@dataclass
class Script:
    """What one node's ranks do: per generation, a failure to report (class) or an exit code."""

    fail: dict[int, FailureClass] = field(default_factory=dict)
    at: float = 0.0  # when the failure was seen (epoch seconds): the earliest is the root cause
    exit_code: int = 0
    gate: threading.Event | None = None  # the node's ranks finish only once this is set
    on_stop: Callable[[], None] | None = None  # runs while the node stops its ranks


class ScriptedNode:
    """The loop's Node: ranks that do what the script says."""

    def __init__(self, name: str, script: Script) -> None:
        self.name, self.script = name, script
        self.signal_kind: str | None = None
        self.started: list[tuple[int, int, int]] = []  # (gen, slot, port)
        self.masters: list[str] = []  # MASTER_ADDR its ranks were given, per generation started
        self.gen = -1

    def start(self, gen: int, slot: int, port: int, master_addr: str) -> None:
        self.gen = gen
        self.started.append((gen, slot, port))
        self.masters.append(master_addr)

    def poll(self, gen: int) -> Evidence | None:
        cls = self.script.fail.get(gen)
        if cls is None:
            return None
        return Evidence(self.script.at, self.name, 0, "line", cls, f"scripted {cls.value}")

    def exit_codes(self) -> list[int | None]:
        if self.script.fail.get(self.gen) is not None:
            return [None]
        if self.script.gate is not None and not self.script.gate.is_set():
            return [None]
        return [self.script.exit_code]

    def stop(self) -> list[Evidence]:
        if self.script.on_stop is not None:
            self.script.on_stop()
        ev = self.poll(self.gen)
        # The scripted rank's process ended after its line (a line a rank can survive counts only
        # with that exit: classify.CONFIRM_BY_EXIT).
        return [ev, replace(ev, kind="exit", detail="returncode 1")] if ev is not None else [
            Evidence(0.0, self.name, 0, "exit", F.PEER_FAILURE, "returncode -9")]

    def join_output(self) -> None:
        pass

    def step_window(self) -> None:  # no step times: its ranks do not train
        return None


def config(extra: tuple[str, ...] = (), **sup: Any):  # noqa: ANN201 - SlurmkitConfig
    over = [f"supervisor.{k}={v}" for k, v in {"poll_interval_s": 0.01, "node_timeout_s": 1.0, **sup}.items()]
    return compose(["+exp=tiny", "cluster=local", *over, *extra])


class Cluster:
    """N supervisors over one store; ``beating[nr]`` stops an agent's beats when cleared."""

    def __init__(self, tmp_path: Path, scripts: list[Script], *, train_nodes: int | None = None,
                 executor: str = "local", slurm: Any = None, extra: tuple[str, ...] = (),
                 ckpt: Callable[[], int | None] | None = None, push: bool = True, **sup: Any) -> None:
        self.store = dist.HashStore()
        self.cfg = config(extra, **sup)
        self.names = tuple(f"n{i}" for i in range(len(scripts)))
        self.ledger = Ledger()
        self.nodes = [ScriptedNode(n, s) for n, s in zip(self.names, scripts)]
        self.beating = [threading.Event() for _ in scripts]
        for e in self.beating:
            e.set()
        self.codes: dict[int, int] = {}
        self.errors: list[BaseException] = []
        self.sups = []
        for nr in range(len(scripts)):
            where = Where(node_rank=nr, nodes=self.names, attempt="7-0", job_id="7", executor=executor,
                          master_addr="10.0.0.0", addr=f"10.0.0.{nr}")
            ch = Channel(self.store, where.attempt, TOKEN, self.names)
            self.sups.append(Supervisor(self.cfg, where, ch, self.nodes[nr], self.ledger,
                                        train_nodes=train_nodes or len(scripts), run_dir=str(tmp_path),
                                        slurm=slurm, free_port=lambda nr=nr: 12345 + 100 * nr,
                                        ckpt_step=ckpt or (lambda: None), ckpt_seen=ckpt,
                                        # the generation's end pushed by the store (the agent's
                                        # way); push=False: the change counter polled instead
                                        end_watch=EndWatch(lambda ch=ch: ch) if push else None))
        self._stop = threading.Event()

    def _beat(self, nr: int) -> None:
        tick = 0
        while not self._stop.is_set():
            if self.beating[nr].is_set():
                tick += 1
                try:
                    self.sups[nr].channel.beat(nr, tick)
                except RuntimeError:  # a store that died (DyingStore): the real Beater retries too
                    pass
            self._stop.wait(0.02)

    def _run(self, nr: int) -> None:
        try:
            self.codes[nr] = self.sups[nr].run()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.errors.append(exc)

    def run(self, agents: list[int] | None = None) -> dict[int, int]:
        self.sups[0].channel.seed_beats(range(len(self.names)))
        agents = list(range(len(self.names))) if agents is None else agents
        beaters = [threading.Thread(target=self._beat, args=(nr,), daemon=True) for nr in agents]
        runners = [threading.Thread(target=self._run, args=(nr,), daemon=True) for nr in agents]
        for t in beaters + runners:
            t.start()
        for t in runners:
            t.join(timeout=120)
        self._stop.set()
        assert not self.errors, self.errors
        assert all(not t.is_alive() for t in runners), "a supervisor never ended"
        return self.codes

    def decisions(self) -> list[tuple[int, Action, tuple[str, ...]]]:
        return [(e["generation"], Action(e["action"]), tuple(e["exclude"])) for e in self.ledger.of("decision")]



def open_gate_on_event(c: Cluster, event: str, gate: threading.Event) -> None:
    """Let the scripted ranks finish once the ledger holds ``event`` (from a watcher thread)."""
    def watch() -> None:
        while not c.ledger.of(event):
            threading.Event().wait(0.01)
        gate.set()

    threading.Thread(target=watch, daemon=True).start()

def test_a_clean_run_completes_on_every_node(tmp_path: Path) -> None:
    c = Cluster(tmp_path, [Script(), Script(), Script()])
    assert c.run() == {0: 0, 1: 0, 2: 0}
    assert c.decisions() == []
    assert [e["status"] for e in c.ledger.of("end")] == ["completed"]
    assert all(n.started == [(0, i, 12345)] for i, n in enumerate(c.nodes))


def test_a_failure_restarts_every_node_then_completes(tmp_path: Path) -> None:
    c = Cluster(tmp_path, [Script(), Script(fail={0: F.USER_ERROR}), Script()])
    assert c.run() == {0: 0, 1: 0, 2: 0}
    assert c.decisions() == [(0, Action.RESTART, ())]
    (failure,) = c.ledger.of("failure")
    assert failure["cls"] == "user_error" and failure["node"] == "n1"
    # Every node applied the same decision and started generation 1 in the same slot.
    assert all([g for g, _ in s.decisions] == [0] for s in c.sups)
    assert all(n.started == [(0, i, 12345), (1, i, 12345)] for i, n in enumerate(c.nodes))


def test_two_failures_at_once_make_one_decision_on_the_root_cause(tmp_path: Path) -> None:
    # Two nodes see a failure in the same generation; the earlier (a GPU OOM) is the root cause:
    # one decision, stop with 93, although the later crash alone would restart.
    c = Cluster(tmp_path, [Script(), Script(fail={0: F.RANK_CRASH}, at=2.0),
                           Script(fail={0: F.GPU_OOM}, at=1.0)])
    assert c.run() == {0: EXIT_NO_REQUEUE, 1: EXIT_NO_REQUEUE, 2: EXIT_NO_REQUEUE}
    assert c.decisions() == [(0, Action.STOP, ())]
    (failure,) = c.ledger.of("failure")
    assert failure["cls"] == "gpu_oom"


def test_a_failure_during_a_decision_belongs_to_the_next_generation(tmp_path: Path) -> None:
    # Node 2's ranks fail again in generation 1 while node 0 still decides about generation 0;
    # generation 0's decision stays what it was, generation 1 gets its own.
    c = Cluster(tmp_path, [Script(), Script(fail={0: F.USER_ERROR}), Script(fail={1: F.RANK_CRASH})])
    c.run()
    assert [(g, a) for g, a, _ in c.decisions()] == [(0, Action.RESTART), (1, Action.RESTART)]
    assert [e["cls"] for e in c.ledger.of("failure")] == ["user_error", "rank_crash"]


@pytest.mark.parametrize("never_beat", [False, True])
def test_a_silent_agent_is_lost_and_its_slot_goes_to_the_spare(tmp_path: Path, never_beat: bool) -> None:
    gate = threading.Event()
    scripts = [Script(gate=gate), Script(gate=gate), Script(gate=gate)]
    c = Cluster(tmp_path, scripts, train_nodes=2, spare_nodes=1, node_timeout_s=1.0, startup_timeout_s=2.0)
    # n1's agent never runs: it beats a few times and falls silent, or never sends a first beat
    # (then it is lost after startup_timeout_s). Node 0 calls it lost; the spare n2 takes slot 1.
    if never_beat:
        c.beating[1].clear()
    else:
        for tick in (1, 2, 3):
            c.sups[1].channel.beat(1, tick)

    open_gate_on_event(c, "exclusion", gate)
    codes = c.run(agents=[0, 2])
    assert codes == {0: 0, 2: 0}
    assert c.decisions() == [(0, Action.REPLACE_NODE, ("n1",))]
    assert c.nodes[2].started == [(1, 1, 12345)] and c.nodes[2].masters == ["10.0.0.0"]
    (failure,) = c.ledger.of("failure")
    assert failure["cls"] == "node_loss" and failure["node"] == "n1"
    assert "two deadlines" in failure["evidence"]  # no Slurm to confirm: lost after a second deadline


def test_slurm_confirms_the_lost_node_and_its_view_goes_into_the_failure(tmp_path: Path) -> None:
    fake = FakeSlurm({"debug": "n[0-2]"})
    fake.fail_node("n1", reason="Not responding")
    client = SlurmClient(fake, retry=RetryPolicy(max_attempts=1, jitter_s=0))
    gate = threading.Event()
    c = Cluster(tmp_path, [Script(gate=gate), Script(gate=gate), Script(gate=gate)], train_nodes=2,
                spare_nodes=1, node_timeout_s=1.0, slurm=client)
    for tick in (1, 2, 3):
        c.sups[1].channel.beat(1, tick)

    open_gate_on_event(c, "exclusion", gate)
    assert c.run(agents=[0, 2]) == {0: 0, 2: 0}
    assert c.decisions() == [(0, Action.REPLACE_NODE, ("n1",))]
    (failure,) = c.ledger.of("failure")
    assert "Slurm says DOWN" in failure["evidence"]
    assert any("state=DOWN" in v for v in failure["slurm_view"])
    # Asked once, in the background, about n1 only: never the whole cluster, never again to decide.
    assert [a for a in fake.calls if a[:2] == ["scontrol", "show"]] == [["scontrol", "show", "node", "-o", "n1"]]


def test_a_forged_value_in_the_store_is_refused(tmp_path: Path) -> None:
    c = Cluster(tmp_path, [Script(), Script()])
    ch = c.sups[0].channel
    # A stranger who knows the old, guessable key names changes nothing...
    c.store.set("7-0/g0/fail", "n1:0:gpu_oom")
    c.store.set("7-0/g0/evidence/1", '[{"cls": "gpu_oom"}]')
    # ...and one who even learned a real key cannot sign a value: the failure is refused.
    forged = Channel(c.store, "7-0", b"\x01" * 32, c.names)
    key = ch._gen(0, "fail")  # noqa: SLF001 - the test plays the stranger who learned the key
    c.store.set(key, forged._seal(key, {"node": "n1", "rank": 0, "cls": "gpu_oom"}))  # noqa: SLF001
    assert c.run() == {0: 0, 1: 0}
    assert c.decisions() == []  # no stop with 93: the forged failure was never believed


@pytest.mark.parametrize("executor", ["local"])
def test_requeue_without_slurm_becomes_a_stop(tmp_path: Path, executor: str) -> None:
    c = Cluster(tmp_path, [Script(), Script(fail={0: F.TIME_LIMIT})], executor=executor)
    assert c.run() == {0: EXIT_NO_REQUEUE, 1: EXIT_NO_REQUEUE}
    ((gen, action, _),) = c.decisions()
    assert action == Action.STOP
def test_a_slow_agent_that_keeps_beating_is_not_lost(tmp_path: Path) -> None:
    # n1 takes 3 node timeouts to stop its ranks but beats meanwhile: it is slow, not lost.
    slow = threading.Event()
    c = Cluster(tmp_path, [Script(), Script(on_stop=lambda: slow.wait(1.5)), Script(fail={0: F.USER_ERROR})],
                node_timeout_s=0.5)
    c.run()
    assert c.decisions()[0] == (0, Action.RESTART, ())
    assert [e["cls"] for e in c.ledger.of("failure")] == ["user_error"]




def test_slot_0_moves_to_the_spare_and_the_rendezvous_follows_it(tmp_path: Path) -> None:
    # n0's ranks hit a suspect-node failure twice: the spare n2 takes slot 0. Node 0's agent
    # still decides, but the ranks' MASTER_ADDR and port are now the spare's.
    c = Cluster(tmp_path, [Script(fail={0: F.NCCL_TIMEOUT, 1: F.NCCL_TIMEOUT}), Script(), Script()],
                train_nodes=2, spare_nodes=1)
    assert c.run() == {0: 0, 1: 0, 2: 0}
    assert c.decisions() == [(0, Action.RESTART, ()), (1, Action.REPLACE_NODE, ("n0",))]
    assert c.nodes[0].started == [(0, 0, 12345), (1, 0, 12345)]  # none in generation 2
    assert c.nodes[2].started == [(2, 0, 12545)]  # the spare picked the port on its own host
    assert c.nodes[1].started[-1] == (2, 1, 12545)
    assert c.nodes[1].masters == ["10.0.0.0", "10.0.0.0", "10.0.0.2"]
    assert c.nodes[2].masters == ["10.0.0.2"]
    assert [e["status"] for e in c.ledger.of("end")] == ["completed"]


class DyingStore:
    """Node 0's store as one follower sees it: every call fails once ``dead`` is set."""

    def __init__(self, store: Any) -> None:
        self.store, self.dead = store, threading.Event()

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self.store, name)

        def call(*a: Any, **kw: Any) -> Any:
            if self.dead.is_set():
                raise dist.DistNetworkError("Connection reset by peer")
            return fn(*a, **kw)
        return call


@pytest.mark.parametrize("with_slurm,slurmd_up", [(False, False), (True, False), (True, True)])
def test_node0_lost_the_successor_records_it_and_requeues_without_node0(
        tmp_path: Path, with_slurm: bool, slurmd_up: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    requeued: list[tuple[str, tuple[str, ...]]] = []
    monkeypatch.setattr("slurmkit.supervise.endings.requeue_now",
                        lambda client, job, exclude, **kw: requeued.append((job, tuple(exclude))))
    gate = threading.Event()
    c = Cluster(tmp_path, [Script(gate=gate), Script(gate=gate), Script(gate=gate)], node_timeout_s=0.3,
                slurm=SlurmClient(FakeSlurm({"debug": "n[0-2]"})) if with_slurm else None)
    dying = {nr: DyingStore(c.store) for nr in (1, 2)}
    probes: list[tuple[str, int]] = []
    for nr, d in dying.items():
        c.sups[nr].channel.store = d
        # Node 0's slurmd: down (the node died) or answering (only its agent died).
        c.sups[nr].probe_slurmd = lambda addr, port: probes.append((addr, port)) or slurmd_up
    c.sups[0].channel.post_port(0, 12345)  # node 0 started generation 0, then its node died

    def kill_node0_once_running() -> None:
        while not all(c.nodes[nr].started for nr in (1, 2)):
            threading.Event().wait(0.01)
        for d in dying.values():
            d.dead.set()

    threading.Thread(target=kill_node0_once_running, daemon=True).start()
    codes = c.run(agents=[1, 2])
    (failure,) = c.ledger.of("failure")
    assert failure["cls"] == "node_loss" and failure["node"] == "n0"
    assert "has not answered" in failure["evidence"] and "recorded by n1" in failure["evidence"]
    (decision,) = c.ledger.of("decision")
    if slurmd_up:  # a healthy node whose agent died is not thrown away (its ranks died with the agent)
        assert decision["exclude"] == [] and "requeue keeping it" in decision["reason"]
        assert codes == {1: 0, 2: 1} and decision["action"] == "requeue" and requeued == [("7", ())]
        (kept,) = c.ledger.of("node_kept")
        assert kept["node"] == "n0" and "its slurmd answers" in kept["why"] and len(probes) == 1
        assert not c.ledger.of("exclusion")
        return
    assert decision["exclude"] == ["n0"]
    if with_slurm:
        assert codes == {1: 0, 2: 1} and decision["action"] == "requeue" and requeued == [("7", ("n0",))]
        assert not c.ledger.of("node_kept") and len(probes) == 1
    else:
        assert codes == {1: 1, 2: 1} and decision["action"] == "stop" and requeued == []


def test_a_rank_that_dies_after_the_time_limit_warning_requeues_instead_of_restarting(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Under load a rank can get the SIGUSR1 before it installed its handler (returncode -10):
    # restarting in an allocation that ends in a minute would only crash-loop into exit 93.
    requeued: list[tuple[str, ...]] = []
    monkeypatch.setattr("slurmkit.supervise.endings.requeue_now",
                        lambda client, job, exclude, **kw: requeued.append(tuple(exclude)))
    c = Cluster(tmp_path, [Script(), Script(fail={0: F.RANK_CRASH})], extra=("job.requeue=true",),
                slurm=SlurmClient(FakeSlurm({"debug": "n[0-1]"})))
    for n in c.nodes:
        n.signal_kind = "time_limit"
    assert c.run() == {0: 0, 1: 0}
    ((gen, action, exclude),) = c.decisions()
    assert action == Action.REQUEUE and exclude == () and requeued == [()]
    (failure,) = c.ledger.of("failure")
    assert failure["cls"] == "time_limit" and "was rank_crash" in failure["evidence"]


def test_a_gpu_fault_after_the_time_limit_warning_requeues_without_its_node_even_with_a_spare(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The warning leaves a minute: a spare brought in now could not finish a generation, and a
    # plain time-limit requeue (no exclusion) would bring the faulty GPU back.
    requeued: list[tuple[str, ...]] = []
    monkeypatch.setattr("slurmkit.supervise.endings.requeue_now",
                        lambda client, job, exclude, **kw: requeued.append(tuple(exclude)))
    c = Cluster(tmp_path, [Script(), Script(fail={0: F.GPU_FAULT}), Script()], extra=("job.requeue=true",),
                train_nodes=2, spare_nodes=1, slurm=SlurmClient(FakeSlurm({"debug": "n[0-3]"})))
    for n in c.nodes:
        n.signal_kind = "time_limit"
    c.run()
    ((gen, action, exclude),) = c.decisions()
    assert action == Action.REQUEUE and exclude == ("n1",) and requeued == [("n1",)]
    (failure,) = c.ledger.of("failure")
    assert failure["cls"] == "gpu_fault"


# ------------------------------------------------------------------ bounded work per decision
class Recorder:
    """An agent's store that logs its round trips (method, keys) while ``on`` is set."""

    def __init__(self, store: Any) -> None:
        self.store, self.calls, self.on = store, [], True

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.store, name)

        def call(*args: Any, **kw: Any) -> Any:
            if self.on:
                keys = args[0] if args and isinstance(args[0], list) else [args[0]] if args else []
                self.calls.append((name, tuple(keys)))
            return attr(*args, **kw)

        return call


@pytest.mark.parametrize("n", [3, 12])
def test_node0_reads_every_agents_evidence_in_one_round_trip_and_followers_wait_on_the_decision(
        tmp_path: Path, n: int) -> None:
    scripts = [Script() for _ in range(n)]
    scripts[1] = Script(fail={0: F.USER_ERROR})
    c = Cluster(tmp_path, scripts)
    node0, follower = Recorder(c.store), Recorder(c.store)
    node0.on = False
    c.sups[0].channel.store, c.sups[2].channel.store = node0, follower
    decide = c.sups[0].node0_decide

    def recorded(gen: int, participants: list[int]) -> Any:
        node0.on = True
        try:
            return decide(gen, participants)
        finally:
            node0.on = False

    c.sups[0].node0_decide = recorded  # type: ignore[method-assign]
    c.run()
    assert c.decisions()[0] == (0, Action.RESTART, ())
    # Node 0 never asks agent by agent: one check of all n evidence keys (once the stopped
    # counter says every agent is done), one multi_get that none is a cleared stranger's
    # value, then one multi_get of them all.
    ev = [(m, len(k)) for m, k in node0.calls if any("/evidence/" in x for x in k)]
    assert ev == [("check", n), ("multi_get", n), ("multi_get", n)], ev
    # A follower blocks on the decision key (woken by node 0's post) and reads it once, with a
    # read that cannot block (compare_set against a value no agent writes).
    key = c.sups[2].channel._gen(0, "decision")  # noqa: SLF001
    on_key = [m for m, k in follower.calls if k == (key,)]
    assert on_key[0] == "wait" and on_key.count("compare_set") == 1, on_key
    assert set(on_key) <= {"wait", "check", "compare_set"}, on_key
    # In the steady state a follower polls one change counter, not the failure and finish keys.
    watch = [k[0].rsplit("/", 1)[-1] for m, k in follower.calls if k and "/g1/" in k[0] and m != "wait"]
    assert 0 < watch.count("fail") <= min(n, watch.count("events")), watch  # only after the counter moved


def test_a_forged_decision_planted_before_node0_posts_is_replaced_by_the_real_one(tmp_path: Path) -> None:
    c = Cluster(tmp_path, [Script(), Script(fail={0: F.USER_ERROR}), Script()])
    ch = c.sups[0].channel
    forged = Channel(c.store, "7-0", b"\x01" * 32, c.names)
    key = ch._gen(0, "decision")  # noqa: SLF001 - a stranger who learned the key writes first
    c.store.set(key, forged._seal(key, {"action": "stop", "reason": "forged", "exclude": []}))  # noqa: SLF001
    assert c.run() == {0: 0, 1: 0, 2: 0}  # nobody stopped with 93, nobody waited forever
    for s in c.sups:
        assert [(g, d.action) for g, d in s.decisions] == [(0, Action.RESTART)]
