"""The supervisor loop moving nodes out, with scripted nodes over one real in-process store:
several nodes failing pre-flight leave in one decision, failed pre-flights are no crash loop,
and a straggler is moved onto a spare at the next committed checkpoint
(health.straggler_action=replace; slurmkit.supervise.straggler_move)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from slurmkit.supervise.ckpt_progress import CheckpointProgress
from slurmkit.failures.classes import FailureClass
from slurmkit.supervise.policy import Action
from slurmkit.supervise.stragglers import NodeWindow
from tests.unit.supervise.test_loop import Cluster, Script, ScriptedNode, open_gate_on_event

F = FailureClass
SECTIONS = {"data": 0.01, "compute": 0.09, "comm": 0.02, "ckpt": 0.0}


def wait_until(cond: object, timeout_s: float = 60.0) -> None:
    done = threading.Event()
    deadline = threading.Event()
    timer = threading.Timer(timeout_s, deadline.set)
    timer.start()
    try:
        while not deadline.is_set():
            if cond():  # type: ignore[operator]
                done.set()
                return
            deadline.wait(0.01)
    finally:
        timer.cancel()
    raise AssertionError("condition not met in time")


# ------------------------------------------------------------------ several bad nodes, no crash loop
def test_every_node_failing_preflight_leaves_in_one_decision(tmp_path: Path) -> None:
    pre = {0: F.PREFLIGHT}
    c = Cluster(tmp_path, [Script(), Script(fail=pre, at=2.0), Script(fail=pre, at=1.0), Script(), Script()],
                train_nodes=3)
    assert c.run() == {nr: 0 for nr in range(5)}
    assert c.decisions() == [(0, Action.REPLACE_NODE, ("n1", "n2"))]  # one decision, both out
    (ex,) = c.ledger.of("exclusion")
    assert ex["how"] == "spare" and ex["train_nodes"] == ["n0", "n3", "n4"]
    assert [s[:2] for s in c.nodes[3].started] == [(1, 1)] and [s[:2] for s in c.nodes[4].started] == [(1, 2)]


def test_too_few_spares_requeue_without_every_node_failing_preflight(tmp_path: Path) -> None:
    pre = {0: F.PREFLIGHT}
    c = Cluster(tmp_path, [Script(), Script(fail=pre), Script(fail=pre), Script()], train_nodes=3)
    assert c.run() == {nr: 93 for nr in range(4)}  # local mode: the requeue becomes a stop
    (d,) = c.ledger.of("decision")
    assert d["action"] == "stop" and d["generation"] == 0, d
    assert "1 spare(s) for 2 nodes (n1,n2): requeue without them" in d["reason"], d


def test_spares_failing_preflight_in_turn_leave_the_crash_loop_budget_whole(tmp_path: Path) -> None:
    # Two generations end in a failed pre-flight (the first spare is bad too), then the program
    # crashes twice without checkpoint progress (limit 3): it restarts both times and completes.
    # The old loop counted the pre-flights and stopped the run with 93 at the first crash.
    crash = {2: F.USER_ERROR, 3: F.USER_ERROR}
    c = Cluster(tmp_path, [Script(fail=crash), Script(fail={0: F.PREFLIGHT}), Script(fail={1: F.PREFLIGHT}),
                           Script()], train_nodes=2, max_restarts_without_progress=3)
    assert c.run() == {nr: 0 for nr in range(4)}
    assert [d[1] for d in c.decisions()] == [Action.REPLACE_NODE, Action.REPLACE_NODE, Action.RESTART,
                                             Action.RESTART]
    assert c.sups[0].history.restarts_without_progress == 2


# ------------------------------------------------------------------ a straggler moved onto a spare
class TimedNode(ScriptedNode):
    """A scripted node whose ranks report a new window every time the loop asks."""

    def __init__(self, name: str, script: Script, index: int, own_s: float) -> None:
        super().__init__(name, script)
        self.index, self.own_s, self.seq = index, own_s, 0

    def step_window(self) -> NodeWindow | None:
        self.seq += 1
        first = 2 * self.index
        return NodeWindow(self.name, self.gen, self.seq, self.seq, {first: self.own_s, first + 1: self.own_s},
                          {**SECTIONS, "compute": self.own_s - 0.01})


class Committed:
    """The newest committed checkpoint step as node 0 reads it; a test moves it on."""

    def __init__(self, step: int | None) -> None:
        self.step, self.reads = step, 0

    def __call__(self) -> int | None:
        self.reads += 1
        return self.step


def straggler_cluster(tmp_path: Path, own: list[float], train_nodes: int, committed: Committed,
                      gate: threading.Event) -> Cluster:
    c = Cluster(tmp_path, [Script(gate=gate) for _ in own], train_nodes=train_nodes, ckpt=committed,
                extra=("health.straggler_action=replace", "health.straggler_windows=3"))
    c.nodes = [TimedNode(n, s.script, i, t) for i, (n, s, t) in enumerate(zip(c.names, c.nodes, own))]
    for sup, node in zip(c.sups, c.nodes):
        sup.node = node
    return c


def test_a_straggler_moves_onto_the_spare_at_the_next_committed_checkpoint(tmp_path: Path) -> None:
    gate, committed = threading.Event(), Committed(1)
    c = straggler_cluster(tmp_path, [0.1, 0.1, 0.25, 0.1], 3, committed, gate)

    def script() -> None:
        wait_until(lambda: c.ledger.of("straggler"))
        rounds = c.sups[0].stragglers.rounds  # type: ignore[union-attr]
        # No checkpoint newer than the naming yet: the generation goes on, however many rounds.
        wait_until(lambda: c.sups[0].stragglers is not None and c.sups[0].stragglers.rounds >= rounds + 5)
        assert c.ledger.of("decision") == []
        committed.step = 40  # the next checkpoint commits
        wait_until(lambda: c.ledger.of("decision"))
        gate.set()

    t = threading.Thread(target=script, daemon=True)
    t.start()
    assert c.run() == {nr: 0 for nr in range(4)}
    t.join(5)
    (x,) = c.ledger.of("straggler")
    assert x["node"] == "n2" and x["action"] == "replace" and "moved onto a spare" in x["plan"], x
    (f,) = c.ledger.of("failure")
    assert f["cls"] == "straggler" and f["node"] == "n2" and f["rank"] == -1 and f["generation"] == 0, f
    assert "checkpoint step 40" in f["evidence"] and "score 0.40" in f["evidence"], f
    (d,) = c.ledger.of("decision")
    assert (d["action"], d["exclude"], d["generation"]) == ("replace_node", ["n2"], 0), d
    s = d["straggler"]
    assert s["node"] == "n2" and s["ckpt_step"] == 40 and s["score"] == pytest.approx(0.4), s
    assert s["rank"] in (4, 5) and s["windows"] == 3 and s["named_step"] <= 40 and s["own_s"] == 0.25, s
    (ex,) = c.ledger.of("exclusion")
    assert ex["how"] == "spare" and ex["train_nodes"] == ["n0", "n1", "n3"]
    assert [g[:2] for g in c.nodes[3].started] == [(1, 2)]  # the spare took the slot, next generation
    h = c.sups[0].history
    assert h.restarts == 0 and h.restarts_without_progress == 0 and h.retired == {"n2"}


def test_a_straggler_without_a_spare_is_reported_only(tmp_path: Path) -> None:
    gate, committed = threading.Event(), Committed(1)
    c = straggler_cluster(tmp_path, [0.1, 0.1, 0.25], 3, committed, gate)

    def script() -> None:
        wait_until(lambda: c.ledger.of("straggler"))
        committed.step = 40
        rounds = c.sups[0].stragglers.rounds  # type: ignore[union-attr]
        wait_until(lambda: c.sups[0].stragglers is not None and c.sups[0].stragglers.rounds >= rounds + 5)
        gate.set()

    threading.Thread(target=script, daemon=True).start()
    assert c.run() == {0: 0, 1: 0, 2: 0}
    (x,) = c.ledger.of("straggler")
    assert x["action"] == "replace" and x["plan"] == "reported only: no spare node left to move it onto", x
    assert c.ledger.of("decision") == [] and c.ledger.of("failure") == []
    assert committed.reads == 0  # nothing to move: the checkpoint store is not even asked


def test_a_move_is_dropped_when_its_generation_ends_first(tmp_path: Path) -> None:
    gate, committed = threading.Event(), Committed(1)
    c = straggler_cluster(tmp_path, [0.1, 0.1, 0.25, 0.1], 3, committed, gate)
    open_gate_on_event(c, "straggler", gate)  # training ends before any newer checkpoint
    assert c.run() == {nr: 0 for nr in range(4)}
    assert c.ledger.of("decision") == [] and len(c.ledger.of("straggler")) == 1


def test_peek_never_waits_for_a_slow_tier() -> None:
    release, calls = threading.Event(), []

    def slow() -> int | None:
        calls.append(1)
        if len(calls) > 1:
            release.wait()
        return 10 * len(calls)

    p = CheckpointProgress([slow], refresh_s=3600).start()
    assert p.latest(wait_s=30) == 10
    assert p.peek() == 10  # asks for a read that hangs; the value read before comes back at once
    release.set()
    wait_until(lambda: p.peek() == 20)


def test_a_spare_lost_before_the_checkpoint_leaves_the_straggler_reported_only() -> None:
    from slurmkit.supervise.straggler_move import StragglerActions
    from slurmkit.supervise.stragglers import Named
    from tests.unit.supervise.test_loop import Ledger

    ledger, committed = Ledger(), Committed(10)
    actions = StragglerActions("replace", ledger, committed=committed, wall=lambda: 5.0)
    x = Named("n2", 0.4, 4, 0.25, 0.1, 3, 12, dict(SECTIONS))
    actions.named(x, 0, threshold=0.7, spares=1)
    assert actions.due(0, spares=1) is None  # step 10 is older than the naming
    committed.step = 20
    assert actions.due(1, spares=1) is None  # another generation: the move was dropped with its own
    actions.named(x, 2, threshold=0.7, spares=1)
    assert actions.due(2, spares=1) is None  # 20 was committed before this naming: not newer
    committed.step = 30
    assert actions.due(2, spares=0) is None
    first, again, last = ledger.of("straggler")
    assert first["plan"].startswith("moved onto a spare") and again["generation"] == 2
    assert last["plan"] == "reported only: no spare node left at checkpoint step 30", last
    assert actions.evidence(2) == [] and actions.decision_fields(2) == {}
    # With the spare there: the move, its evidence and (once it is the root cause) its figures
    actions.named(x, 3, threshold=0.7, spares=1)
    committed.step = 40
    move = actions.due(3, spares=1)
    assert move is not None and move.ckpt_step == 40 and move.at == 5.0
    (ev,) = actions.evidence(3)
    assert ev.cls == F.STRAGGLER and ev.node == "n2" and ev.rank == -1 and ev.time == 5.0
    assert actions.due(3, spares=1) is None  # one move per generation
