"""Step-time sections from the trainer's beat to node 0's ledger: the agent's window
(slurmkit.launch.steptimes), the channel's one-set / one-multi_get exchange, and the real
supervisor loop naming a node that stays slow (and nobody on a clean run)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from slurmkit.launch.steptimes import StepTimes, parse_sections
from slurmkit.supervise.channel import Channel
from slurmkit.supervise.stragglers import NodeWindow
from slurmkit.train.heartbeat import read_heartbeat
from tests.unit.supervise.test_loop import Cluster, Script, ScriptedNode
from tests.unit.train.test_heartbeat import STEPS, group, run_loop  # noqa: F401 - group is a fixture

GOOD = {"data": 0.01, "compute": 0.1, "comm": 0.02, "ckpt": 0.0}


@pytest.mark.parametrize("sections, expected", [
    (GOOD, GOOD),
    ({"data": 0, "compute": 1}, {"data": 0.0, "compute": 1.0, "comm": 0.0, "ckpt": 0.0}),
    ({**GOOD, "future_section": "x"}, GOOD),  # a newer writer's extra section is ignored
    (None, None), ("fast", None), ([0.1], None),
    ({**GOOD, "compute": -0.1}, None), ({**GOOD, "compute": float("nan")}, None),
    ({**GOOD, "compute": float("inf")}, None), ({**GOOD, "compute": 1e9}, None),
    ({**GOOD, "data": "0.1"}, None), ({**GOOD, "data": True}, None),
])
def test_sections_of_an_untrusted_beat(sections: Any, expected: Any) -> None:
    beat = {"step": 3, "time": 1.0} if sections is None else {"step": 3, "time": 1.0, "sections": sections}
    assert parse_sections(beat) == expected


def beat(step: int, compute: float, **extra: Any) -> dict[str, object]:
    return {"step": step, "time": 1.0, "sections": {**GOOD, "compute": compute}, **extra}


def test_a_window_is_the_median_of_new_samples_of_every_rank() -> None:
    st = StepTimes("n1", 4, window_samples=3)
    st.observe({2: beat(1, 0.1), 3: beat(1, 0.2)})
    st.observe({2: beat(1, 0.9), 3: beat(1, 0.9)})  # the same step read again: no new sample
    st.observe({2: beat(2, 0.1), 3: beat(2, 0.2)})
    assert st.take() is None  # two samples each
    st.observe({2: beat(3, 5.0), 3: {"step": 3, "time": 1.0}})  # one slow step; rank 3 measured nothing
    assert st.take() is None  # rank 3 still has two
    st.observe({3: beat(4, 0.2)})
    w = st.take()
    assert w is not None and (w.node, w.generation, w.seq, w.step) == ("n1", 4, 1, 4)
    assert w.ranks == {2: pytest.approx(0.11), 3: pytest.approx(0.21)}  # the slow step moved nothing
    assert w.sections["compute"] == pytest.approx(0.2) and w.sections["data"] == pytest.approx(0.01)
    assert st.take() is None  # windows do not overlap
    for s in range(5, 8):
        st.observe({2: beat(s, 0.1), 3: beat(s, 0.1)})
    assert st.take().seq == 2  # type: ignore[union-attr]


def test_beats_without_sections_make_no_window() -> None:
    st = StepTimes("n0", 0, window_samples=3)
    for s in range(10):
        st.observe({0: {"step": s, "time": 1.0}, 1: {"step": s, "time": 1.0, "sections": "garbage"}})
    assert st.take() is None


NAMES = ("n0", "n1", "n2")


def window(node: str, seq: int, gen: int = 0) -> NodeWindow:
    return NodeWindow(node, gen, seq, 10 * seq, {NAMES.index(node): 0.1}, GOOD)


def test_windows_go_through_the_channel_in_one_round_trip() -> None:
    store = dist.HashStore()
    ch = Channel(store, "7-0", b"k" * 32, NAMES)
    ch.seed_step_windows(range(3))
    assert ch.step_windows(0, [0, 1, 2]) == {}  # seeded, none posted: no wait on a missing key
    ch.post_step_window(1, window("n1", 1))
    ch.post_step_window(1, window("n1", 2))  # replaces the last one
    ch.post_step_window(2, window("n2", 1, gen=1))  # another generation's
    assert ch.step_windows(0, [0, 1, 2]) == {1: window("n1", 2)}
    assert ch.step_windows(1, [0, 1, 2]) == {2: window("n2", 1, gen=1)}
    # A stranger (no token) or a malformed record is refused, not believed.
    stranger = Channel(store, "7-0", b"x" * 32, NAMES)
    stranger.post_step_window(0, window("n0", 9))
    store.set(ch._window_key(2), ch._seal(ch._window_key(2), {"gen": 0, "seq": 1, "step": 1,
                                                                 "ranks": {"0": -1.0}, "sections": {}}))
    assert ch.step_windows(0, [0, 1, 2]) == {1: window("n1", 2)}


class TimedNode(ScriptedNode):
    """A scripted node whose ranks report a new window every time the loop asks."""

    def __init__(self, name: str, script: Script, own_s: float) -> None:
        super().__init__(name, script)
        self.own_s, self.seq = own_s, 0

    def step_window(self) -> NodeWindow | None:
        self.seq += 1
        first = 2 * NAMES.index(self.name)
        return NodeWindow(self.name, self.gen, self.seq, self.seq, {first: self.own_s, first + 1: self.own_s},
                          {**GOOD, "compute": self.own_s - 0.01})


def run_cluster(tmp_path: Path, own: list[float], until: Any) -> Cluster:
    gate = threading.Event()
    c = Cluster(tmp_path, [Script(gate=gate) for _ in own], extra=("health.straggler_windows=3",))
    c.nodes = [TimedNode(n, s.script, t) for n, s, t in zip(c.names, c.nodes, own)]
    for sup, node in zip(c.sups, c.nodes):
        sup.node = node

    def watch() -> None:
        while not until(c):
            threading.Event().wait(0.01)
        gate.set()

    threading.Thread(target=watch, daemon=True).start()
    assert c.run() == {0: 0, 1: 0, 2: 0}
    return c


def test_the_loop_names_a_node_that_stays_slow(tmp_path: Path) -> None:
    c = run_cluster(tmp_path, [0.1, 0.1, 0.25], lambda c: c.ledger.of("straggler"))
    (x,) = c.ledger.of("straggler")
    assert x["node"] == "n2" and x["score"] == pytest.approx(0.4) and x["windows"] == 3
    assert x["rank"] in (4, 5) and x["action"] == "report" and x["threshold"] == 0.7
    assert x["sections"]["compute"] == pytest.approx(0.24) and x["generation"] == 0
    # slow from the first round on, and named with windows == 3: named in the third round
    assert c.sups[0].stragglers is not None and list(c.sups[0].stragglers.named) == ["n2"]


def test_a_clean_loop_names_nobody(tmp_path: Path) -> None:
    def enough(c: Cluster) -> bool:
        det = c.sups[0].stragglers
        return det is not None and det.rounds >= 10

    c = run_cluster(tmp_path, [0.1, 0.11, 0.09], enough)
    assert c.ledger.of("straggler") == []


def test_a_real_trainer_beats_its_step_sections(group: None, tmp_path: Any,  # noqa: F811
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    _counter, hb, _events = run_loop(tmp_path, monkeypatch, beat_in_run_dir=False)
    beat = read_heartbeat(hb.path)
    assert beat is not None and beat["step"] == STEPS
    sections = parse_sections(beat)
    assert sections is not None and sections["compute"] > 0
    assert set(beat["sections"]) == {"data", "compute", "comm", "ckpt"}
    assert {"rank", "step", "time", "pid", "generation"} <= set(beat)  # the old keys, unchanged
