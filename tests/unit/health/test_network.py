"""Pre-flight checks among nodes: the clock offset to node 0 and the ring bandwidth test.

The pure parts (offset from timestamps, ring phases, the link judgement) from tables; then real
threads, each an agent with its own connection to a real TCPStore, real clock ticks and real
2-rank gloo groups measuring and judging.
"""

from __future__ import annotations

import random
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from slurmkit.config.health import HealthConfig
from slurmkit.errors import ConfigError
from slurmkit.health.clock import (TEST_OFFSET_ENV, ClockCheck, ClockTicker, Sample, best_sample,
                                   injected_offset_s, judge_offset)
from slurmkit.health.links import LinkCheck, NodeLinks, Round, exchange_mib_s, judge, phases, ring_edges
from slurmkit.health.result import CheckResult, Verdict
from slurmkit.supervise.channel import Channel

NODES = ("n0", "n1", "n2", "n3")
TOKEN = b"t" * 32

# The link tests judge gloo probes between threads against deadlines of a few seconds: CI runs
# them in its foreground stream, not beside the cluster's jobs at a low priority.
pytestmark = pytest.mark.realtime


# ------------------------------------------------------------------ clock: pure
def test_offset_is_node0_minus_the_midpoint_within_half_the_round_trip() -> None:
    s = Sample(sent=100.0, node0=102.5, received=100.2)
    assert s.offset_s == pytest.approx(2.4) and s.uncertainty_s == pytest.approx(0.1)
    assert Sample(100.0, 99.0, 100.0).offset_s == -1.0  # node 0 behind: this node is ahead


def test_the_sample_with_the_shortest_round_trip_is_kept() -> None:
    samples = [Sample(0.0, 5.2, 0.3), Sample(1.0, 6.01, 1.02), Sample(2.0, 7.1, 2.2), Sample(3.0, 9.0, 2.9)]
    best = best_sample(samples)
    assert best == samples[1]  # the one whose local clock stepped back (negative trip) is ignored
    assert best_sample([]) is None and best_sample([Sample(3.0, 9.0, 2.9)]) is None


@pytest.mark.parametrize("offset, rtt, verdict", [
    (0.003, 0.002, Verdict.OK),
    (-0.9, 0.01, Verdict.OK),
    (1.5, 0.01, Verdict.BAD_NODE),
    (-1.5, 0.01, Verdict.BAD_NODE),
    (1.2, 0.6, Verdict.OK),  # beyond the bound only inside the uncertainty: a slow network, not a bad clock
])
def test_the_offset_judgement(offset: float, rtt: float, verdict: Verdict) -> None:
    r = judge_offset(Sample(10.0, 10.0 + rtt / 2 + offset, 10.0 + rtt), 1.0, 4)
    assert r.verdict == verdict and r.figures["offset_s"] == pytest.approx(offset, abs=1e-6)
    if verdict == Verdict.BAD_NODE:
        assert "Detected:" in r.message and "max_clock_offset_s=1" in r.message


def test_the_test_hook_shifts_only_the_named_nodes() -> None:
    env = {TEST_OFFSET_ENV: "n2:5.5,n3:-2"}
    assert [injected_offset_s(env, n) for n in NODES] == [0.0, 0.0, 5.5, -2.0]
    assert injected_offset_s({}, "n2") == 0.0
    with pytest.raises(ConfigError):
        injected_offset_s({TEST_OFFSET_ENV: "n2=5"}, "n2")


# ------------------------------------------------------------------ links: pure
@pytest.mark.parametrize("n", range(2, 12))
def test_ring_edges_cover_the_ring_and_each_node_has_distinct_phases(n: int) -> None:
    edges = {(e.a, e.b): e.phase for s in range(n) for e in ring_edges(n, s)}
    ring = {(min(s, (s + 1) % n), max(s, (s + 1) % n)) for s in range(n)}
    assert set(edges) == ring
    for s in range(n):
        mine = [e.phase for e in ring_edges(n, s)]
        assert mine == sorted(set(mine)) and all(p < phases(n) for p in mine)
    assert ring_edges(1, 0) == [] and phases(1) == 0


def table(bests: list[float]) -> list[NodeLinks]:
    """A ring whose link between i and i+1 moves the slower of their two figures."""
    n = len(bests)
    return [NodeLinks(f"n{i}", i, {(i - 1) % n: min(bests[i], bests[(i - 1) % n]) if (i - 1) % n != i else None,
                                   (i + 1) % n: min(bests[i], bests[(i + 1) % n])}) for i in range(n)]


def test_a_node_whose_links_are_all_slow_is_named() -> None:
    t = table([1000.0, 950.0, 1100.0, 1000.0, 1020.0])
    slow = [NodeLinks(x.node, x.slot, {p: (v if x.slot != 2 and p != 2 else 120.0) for p, v in x.links.items()})
            for x in t]
    j = judge(slow, 0.5)
    assert j.named == ("n2",) and j.slow_links == () and j.judged == 5 and j.median_mib_s == 1000.0


def test_one_slow_link_between_two_good_nodes_is_named_as_a_link_not_a_node() -> None:
    t = table([1000.0, 950.0, 1100.0, 1000.0])
    cut = [NodeLinks(x.node, x.slot, {p: (100.0 if {x.slot, p} == {1, 2} else v) for p, v in x.links.items()})
           for x in t]
    j = judge(cut, 0.5)
    assert j.named == () and j.slow_links == (("n1", "n2"),)


def test_noisy_healthy_figures_name_nobody() -> None:
    rng = random.Random(7)
    for _ in range(500):
        n = rng.randint(3, 40)
        j = judge(table([rng.uniform(600.0, 1200.0) for _ in range(n)]), 0.5)
        assert j.named == () and j.slow_links == (), j


def test_two_nodes_or_missing_figures_cannot_name_anyone() -> None:
    assert judge(table([1000.0, 10.0]), 0.5).named == ()  # either end may be the slow one
    j = judge([NodeLinks("n0", 0, {1: None, 3: 900.0}), NodeLinks("n1", 1, {0: None, 2: None})], 0.5)
    assert j.named == () and j.judged == 1


def test_link_figures_round_trip_and_refuse_nonsense() -> None:
    x = NodeLinks("n1", 1, {0: 512.5, 2: None})
    assert NodeLinks.from_json(x.to_json()) == x
    with pytest.raises(ValueError):
        NodeLinks.from_json({"node": "n1", "slot": 1, "links": {"0": -5.0}})


def test_the_config_refuses_nonsense() -> None:
    for bad in ({"min_link_ratio": 1.5}, {"max_clock_offset_s": -1.0}, {"link_backend": "mpi"},
                {"link_timeout_s": 0.0}):
        with pytest.raises(ConfigError):
            HealthConfig(**bad)  # type: ignore[arg-type]


# ------------------------------------------------------------------ real store, real gloo
@pytest.fixture()
def store_port():  # noqa: ANN201
    master = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30), wait_for_workers=False,
                           use_libuv=True)
    yield master.port
    del master


def connector(port: int):  # noqa: ANN201
    def connect() -> Channel:
        store = dist.TCPStore("127.0.0.1", port, 1, False, timeout=timedelta(seconds=30), use_libuv=True)
        return Channel(store, "9-0", TOKEN, NODES)
    return connect


def run_all(calls: dict[str, object], deadline_s: float) -> dict[str, CheckResult]:
    out: dict[str, CheckResult] = {}

    def one(name: str, check) -> None:  # noqa: ANN001
        out[name] = check(deadline_s)

    threads = [threading.Thread(target=one, args=(n, c)) for n, c in calls.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(deadline_s * 2)
    return out


def test_clock_checks_against_node0s_real_ticks(store_port: int) -> None:
    connect = connector(store_port)
    ticker = ClockTicker(connect).start()
    try:
        checks = {n: ClockCheck(connect, node_rank=i, num_nodes=4, max_offset_s=1.0,
                                now=(lambda: time.time() + 3.0) if n == "n2" else time.time)
                  for i, n in enumerate(NODES)}
        got = run_all(checks, 5.0)
    finally:
        ticker.stop()
    assert got["n0"].verdict == Verdict.OK and got["n0"].figures["offset_s"] == 0.0
    assert got["n2"].verdict == Verdict.BAD_NODE and got["n2"].figures["offset_s"] == pytest.approx(-3.0, abs=0.2)
    for n in ("n1", "n3"):
        assert got[n].verdict == Verdict.OK, got[n]
        f = got[n].figures
        assert abs(float(f["offset_s"])) <= float(f["uncertainty_s"]) + 0.01 and f["samples"] == 4


def test_no_ticks_from_node0_is_wait_not_bad(store_port: int) -> None:
    r = ClockCheck(connector(store_port), node_rank=1, num_nodes=2, max_offset_s=1.0)(0.5)
    assert r.verdict == Verdict.WAIT and "node 0" in r.message


def link_checks(port: int, n: int, gen: int, slots: dict[str, int | None],
                min_ratio: float = 0.5) -> dict[str, object]:
    connect = connector(port)
    return {name: LinkCheck(connect, Round(gen, slot), node=name, train_nodes=n, probe_bytes=1 << 20,
                            min_ratio=min_ratio, backend="gloo") for name, slot in slots.items()}


# What these two judge is a node's links against the others' (the judge's arithmetic and the
# verdict each agent is told), not how fast four threads of one process move data on a shared
# machine: CI's stop 49 saw one starved thread's best link at 0.36 of the median, so the bar sits at
# 0.1 and the slow NIC below is a hundredth of what it measured, far under any bar.
EQUAL_LINKS_RATIO = 0.1


def test_four_agents_measure_their_ring_links_and_the_judge_names_nobody(store_port: int) -> None:
    checks = link_checks(store_port, 4, 3, {n: i for i, n in enumerate(NODES)}, min_ratio=EQUAL_LINKS_RATIO)
    got = run_all(checks, 8.0)
    for i, n in enumerate(NODES):
        r = got[n]
        assert r.verdict == Verdict.OK, r
        f = r.figures
        assert {f"slot{(i - 1) % 4}_mib_s", f"slot{(i + 1) % 4}_mib_s"} <= set(f) and f["links_missed"] == 0
        assert float(f["best_mib_s"]) > 0 and float(f["median_mib_s"]) > 0
    assert got["n0"].figures["judged"] == 4 and got["n0"].figures["named"] == ""


def test_a_node_with_a_slow_nic_is_named_bad_by_the_judge_and_told_so(store_port: int) -> None:
    # CPU quotas do not slow gloo over loopback (measured: a node held to 10% of a core still
    # moved ~1 GB/s; docs/health.md "Pre-flight"), so the slow NIC is n2's own report: its real
    # exchanges, each figure a hundredth of what it measured. Its neighbours' figures stay real.
    def slow_nic(*args, **kwargs) -> float:  # noqa: ANN002, ANN003
        return exchange_mib_s(*args, **kwargs) / 100

    checks = link_checks(store_port, 4, 4, {n: i for i, n in enumerate(NODES)}, min_ratio=EQUAL_LINKS_RATIO)
    checks["n2"].exchange = slow_nic  # type: ignore[attr-defined]
    got = run_all(checks, 8.0)
    assert got["n2"].verdict == Verdict.BAD_NODE, got["n2"]
    assert "health.min_link_ratio=0.1" in got["n2"].message and float(got["n2"].figures["ratio"]) < 0.1
    assert {n: r.verdict for n, r in got.items() if n != "n2"} == dict.fromkeys(("n0", "n1", "n3"), Verdict.OK)
    assert got["n0"].figures["named"] == "n2"


def test_a_neighbour_that_never_comes_is_wait_and_the_others_are_judged(store_port: int) -> None:
    # n3 (slot 3) never starts its check: its neighbours' links to it time out; nobody is bad.
    # What is tested is the missing neighbour, not speed: a link judged slow by the ratio (a CI
    # rehearsal's starved thread measured one at under half the median) is out of scope here.
    checks = link_checks(store_port, 4, 5, {"n0": 0, "n1": 1, "n2": 2}, min_ratio=0.01)
    got = run_all(checks, 6.0)
    assert {n: r.verdict for n, r in got.items()} == {"n0": Verdict.OK, "n1": Verdict.OK, "n2": Verdict.OK}
    assert got["n0"].figures["links_missed"] == 1 and got["n2"].figures["links_missed"] == 1
    assert got["n0"].figures["judged"] == 3


def test_a_judge_that_never_answers_is_wait(store_port: int) -> None:
    checks = link_checks(store_port, 3, 1, {"n1": 1, "n2": 2})  # slot 0, the judge, is missing
    got = run_all(checks, 2.0)
    assert all(r.verdict == Verdict.WAIT and "judge" in r.message for r in got.values()), got


def test_single_node_jobs_and_spares_skip_the_link_test(store_port: int) -> None:
    one = LinkCheck(connector(store_port), Round(0, 0), node="n0", train_nodes=1, probe_bytes=1,
                    min_ratio=0.5, backend="gloo")
    spare = LinkCheck(connector(store_port), Round(0, None), node="n3", train_nodes=3, probe_bytes=1,
                      min_ratio=0.5, backend="gloo")
    assert one(1.0).verdict == Verdict.SKIPPED and spare(1.0).verdict == Verdict.SKIPPED


# ------------------------------------------------------------------ in the node's pre-flight
class Events:
    def __init__(self) -> None:
        self.got: list[dict] = []

    def append(self, event: str, **fields: object) -> None:
        self.got.append({"event": event, **fields})


def test_the_link_tests_wait_is_recorded_but_not_rechecked_and_sees_its_generation_and_slot() -> None:
    from slurmkit.health.preflight import Preflight
    from slurmkit.health.result import wait
    from slurmkit.health.runner import Check, Timeout

    calls: list[tuple[int, int | None]] = []
    rnd = Round()

    def links(_deadline_s: float) -> CheckResult:
        calls.append((rnd.generation, rnd.slot))
        return wait("links", "no verdict", "a verdict", "wait")

    led = Events()
    sleeps: list[float] = []
    pf = Preflight([Check("links", links, 1.0, Timeout(Verdict.WAIT, "r", "f"), rerun=False)], "n1", led,
                   wait_max_s=60, wait_retry_s=5, sleep=sleeps.append, round=rnd)
    assert pf.run(7, 2) is None  # the ranks start: alone, the node would find no peers to re-check with
    assert calls == [(7, 2)] and sleeps == []
    (e,) = led.got
    assert e["event"] == "preflight" and e["verdict"] == "wait" and e["checks"][0]["name"] == "links"


# ------------------------------------------------------------------ the channel's messages
def test_forged_ticks_figures_and_verdicts_are_refused() -> None:
    from slurmkit.supervise.channel import ChannelError

    store = dist.HashStore()
    ch = Channel(store, "9-0", TOKEN, NODES)
    ch.post_clock_tick(1, 1234.5)
    assert ch.clock_seq() == 1 and ch.wait_clock_tick(1, 0.1) == 1234.5
    assert ch.wait_clock_tick(2, 0.05) is None  # not posted (yet): no answer, no error
    stranger = Channel(store, "9-0", b"x" * 32, NODES)
    store.set(ch._tick_key(2), stranger._seal(ch._tick_key(2), 99.0))
    with pytest.raises(ChannelError):
        ch.wait_clock_tick(2, 0.1)
    ch.post_link_figure(0, 0, NodeLinks("n0", 0, {1: 10.0}).to_json())
    store.set(ch._link_key(0, 1), "not sealed")
    ch.post_link_figure(0, 2, {"node": "intruder", "slot": 2, "links": {}})  # sealed, but no such node
    assert set(ch.link_figures(0, [0, 1, 2, 3], all_posted=False)) == {0}
    ch.post_link_verdict(0, {"named": ["intruder"], "median_mib_s": 1.0})
    with pytest.raises(ChannelError):
        ch.wait_link_verdict(0, 0.1)
