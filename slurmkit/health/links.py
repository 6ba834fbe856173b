"""A short bandwidth test among the job's train nodes: each with its two ring neighbours.

Train slot ``s`` exchanges ``health.link_probe_mb`` both ways with slot ``s+1`` (mod n) over a
2-rank process group of that pair alone, built on the agents' store under a prefix both derive
from (generation, pair) (as slurmkit.store.buddy does for checkpoint copies): O(1) groups and
bytes per node, no world-sized group. The ring's edges are coloured so that each node's two
edges run in different phases (even edges, odd edges, and the closing edge of an odd ring):
a node waits for at most a neighbour's earlier phase, never a chain across the ring.

A node's figure is its *best* link (MiB/s, best of ``ROUNDS`` exchanges): a node whose every link
is slow has the fault itself (its NIC, its port, its CPU); one slow link between two good nodes
is named as a link, and fails no node (either end, or the switch between, may be the cause).
Train slot 0's agent is the judge: it polls one counter until every slot has posted, reads all
figures in one multi_get, names the nodes whose figure is below ``health.min_link_ratio`` times
the median of all, and posts that once; every agent waits for it (one store wait). Judging
needs three nodes or more: of two, either end may be slow.

Every deadline missed (a neighbour that never comes, a judge that does not answer) is ``wait``,
never ``bad_node``: only a measured figure names a node. Gloo on CPU; NCCL when CUDA is there
(``health.link_backend=auto``): the agent then keeps a CUDA context on its first visible GPU.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from slurmkit.health.result import CheckResult, Figure, bad, ok, skipped, wait

log = logging.getLogger(__name__)
NAME = "links"
ROUNDS = 3  # timed exchanges per edge: the best counts (a healthy link has no bad best)
MIN_JUDGED = 3  # nodes with a figure before anyone can be named


@dataclass(frozen=True)
class Edge:
    phase: int
    a: int  # train slots, a < b
    b: int


def ring_edges(n: int, slot: int) -> list[Edge]:
    """``slot``'s edges of the ring of ``n`` train slots, in phase order."""
    if n < 2:
        return []
    if n == 2:
        return [Edge(0, 0, 1)]

    def edge(s: int) -> Edge:
        t = (s + 1) % n
        return Edge(2 if n % 2 and s == n - 1 else s % 2, min(s, t), max(s, t))

    return sorted((edge((slot - 1) % n), edge(slot)), key=lambda e: e.phase)


def phases(n: int) -> int:
    return 0 if n < 2 else 1 if n == 2 else 3 if n % 2 else 2


@dataclass(frozen=True)
class NodeLinks:
    """One train node's measured links: peer slot -> MiB/s (None: not measured in time)."""

    node: str
    slot: int
    links: dict[int, float | None]

    @property
    def best(self) -> float | None:
        got = [v for v in self.links.values() if v is not None]
        return max(got) if got else None

    def to_json(self) -> dict[str, Any]:
        return {"node": self.node, "slot": self.slot, "links": {str(k): v for k, v in self.links.items()}}

    @staticmethod
    def from_json(d: dict[str, Any]) -> NodeLinks:
        links = {int(k): (None if v is None else float(v)) for k, v in dict(d["links"]).items()}
        if any(v is not None and not 0 <= v < 1e9 for v in links.values()):
            raise ValueError(f"link figures out of range: {links}")
        return NodeLinks(str(d["node"]), int(d["slot"]), links)


@dataclass(frozen=True)
class Judgement:
    median_mib_s: float | None
    named: tuple[str, ...]  # nodes whose best link is far below the median
    slow_links: tuple[tuple[str, str], ...]  # links far below the links' median, between good nodes
    judged: int  # nodes with a figure

    def to_json(self) -> dict[str, Any]:
        return {"median_mib_s": self.median_mib_s, "named": list(self.named),
                "slow_links": [list(x) for x in self.slow_links], "judged": self.judged}


def judge(table: Sequence[NodeLinks], min_ratio: float) -> Judgement:
    """Name the nodes (and links) far below their peers' median. Pure: the figures in, names out."""
    bests = {x.node: b for x in table if (b := x.best) is not None}
    if len(bests) < MIN_JUDGED:
        return Judgement(statistics.median(bests.values()) if bests else None, (), (), len(bests))
    median = statistics.median(bests.values())
    named = tuple(sorted(n for n, b in bests.items() if b < min_ratio * median))
    by_slot = {x.slot: x for x in table}
    links: dict[tuple[int, int], float] = {}
    for x in table:
        for peer, v in x.links.items():
            if v is not None and peer in by_slot:
                key = (min(x.slot, peer), max(x.slot, peer))
                links[key] = max(v, links.get(key, 0.0))  # both ends timed the same exchange
    slow: list[tuple[str, str]] = []
    if len(links) >= MIN_JUDGED:
        link_median = statistics.median(links.values())
        for (a, b), v in sorted(links.items()):
            ends = (by_slot[a].node, by_slot[b].node)
            if v < min_ratio * link_median and not set(ends) & set(named):
                slow.append(ends)
    return Judgement(median, named, tuple(slow), len(bests))


def pick_backend(setting: str) -> str:
    """gloo or nccl for ``health.link_backend`` (auto: NCCL when this process sees CUDA)."""
    if setting != "auto":
        return setting
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


def pair_group(store: Any, prefix: str, me: int, timeout_s: float, backend: str) -> Any:
    """The 2-rank group of one edge (``me``: 0 or 1), a rendezvous of its two members only."""
    import torch.distributed as dist

    sub = dist.PrefixStore(prefix, store)
    timeout = timedelta(seconds=max(timeout_s, 0.05))
    if backend == "nccl":  # untested here (no GPU on the project's machines)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(sub, me, 2, opts)
    return dist.ProcessGroupGloo(sub, me, 2, timeout)


def exchange_mib_s(pg: Any, peer: int, nbytes: int, backend: str, timeout_s: float,
                   clock: Callable[[], float] = time.monotonic) -> float:
    """Send and receive ``nbytes`` at once with ``peer`` (its rank in the pair), ``ROUNDS`` times
    after a small exchange that lines both up; the best round in MiB/s each way."""
    import torch

    device = "cuda" if backend == "nccl" else "cpu"
    out = torch.ones(nbytes, dtype=torch.uint8, device=device)
    into = torch.empty_like(out)
    timeout = timedelta(seconds=max(timeout_s, 0.05))
    best = 0.0
    for i in range(ROUNDS + 1):
        size = 1 if i == 0 else nbytes
        t = clock()
        works = [pg.send([out[:size]], peer, i), pg.recv([into[:size]], peer, i)]
        for w in works:
            w.wait(timeout)
        if backend == "nccl":
            torch.cuda.synchronize()
        if i:
            best = max(best, nbytes / (1 << 20) / max(clock() - t, 1e-9))
    return best


@dataclass
class Round:
    """What a pre-flight checks for: set by the agent before each run of its checks."""

    generation: int = 0
    slot: int | None = None  # this node's train slot (None: a spare, no ranks here)


class LinkCheck:
    """The ``links`` check of one agent: ``connect`` gives a channel over the check's own store
    connection (made on first use, kept across generations); ``round`` says which generation and
    slot. Deadlines, as fractions of the check's: measuring ends by 0.6, the judge reads by 0.75,
    every agent has the verdict by 0.9 (so the check ends before the runner gives up on it)."""

    def __init__(self, connect: Callable[[], Any], round: Round, *, node: str, train_nodes: int,
                 probe_bytes: int, min_ratio: float, backend: str,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                 exchange: Callable[..., float] = exchange_mib_s) -> None:
        self.connect, self.round, self.node, self.train_nodes = connect, round, node, train_nodes
        self.exchange = exchange  # one edge's measurement (exchange_mib_s; tests wrap it)
        self.probe_bytes, self.min_ratio, self.backend = probe_bytes, min_ratio, backend
        self.clock, self.sleep = clock, sleep
        self._channel: Any = None
        self.judgement: Judgement | None = None  # the last one this agent made (train slot 0)

    def __call__(self, deadline_s: float) -> CheckResult:
        n, gen, slot = self.train_nodes, self.round.generation, self.round.slot
        if n < 2:
            return skipped(NAME, "a single-node job has no links between nodes")
        if slot is None:
            return skipped(NAME, "not a train node in this generation (a spare)")
        if self._channel is None:
            self._channel = self.connect()
        ch = self._channel
        t0 = self.clock()
        backend = pick_backend(self.backend)
        mine = NodeLinks(self.node, slot, self.measure(ch, gen, slot, backend, t0, 0.6 * deadline_s))
        ch.post_link_figure(gen, slot, mine.to_json())
        if slot == 0:
            self.judgement = self.judge_and_post(ch, gen, t0 + 0.75 * deadline_s)
        verdict = ch.wait_link_verdict(gen, t0 + 0.9 * deadline_s - self.clock())
        return self.result(mine, verdict, backend, deadline_s)

    def measure(self, ch: Any, gen: int, slot: int, backend: str, t0: float,
                budget_s: float) -> dict[int, float | None]:
        span = budget_s / phases(self.train_nodes)
        out: dict[int, float | None] = {}
        for e in ring_edges(self.train_nodes, slot):
            me = 0 if slot == e.a else 1
            peer = e.b if me == 0 else e.a
            end = t0 + (e.phase + 1) * span
            try:
                pg = pair_group(ch.store, ch.link_prefix(gen, e.a, e.b), me, end - self.clock(), backend)
                out[peer] = round(self.exchange(pg, 1 - me, self.probe_bytes, backend, end - self.clock(),
                                                self.clock), 2)
            except RuntimeError as exc:  # a neighbour that did not come in time, or left
                log.warning("link test of generation %d with slot %d: %s", gen, peer, str(exc)[:300])
                out[peer] = None
        return out

    def judge_and_post(self, ch: Any, gen: int, until: float) -> Judgement:
        n = self.train_nodes
        while (posted := ch.link_figures_posted(gen)) < n and self.clock() < until:
            self.sleep(0.02)
        table: list[NodeLinks] = []
        for d in ch.link_figures(gen, range(n), all_posted=posted >= n).values():
            try:
                table.append(NodeLinks.from_json(d))
            except (KeyError, TypeError, ValueError) as exc:
                log.error("link figures refused: %s", exc)
        j = judge(table, self.min_ratio)
        ch.post_link_verdict(gen, {**j.to_json(), "expected": n})
        if j.named or j.slow_links:
            log.warning("link test of generation %d: slow nodes %s, slow links %s (median %.0f MiB/s)",
                        gen, list(j.named), list(j.slow_links), j.median_mib_s or 0.0)
        return j

    def result(self, mine: NodeLinks, verdict: dict[str, Any] | None, backend: str, deadline_s: float) -> CheckResult:
        figures: dict[str, Figure] = {"slot": mine.slot, "backend": backend,
                                      "probe_mib": round(self.probe_bytes / (1 << 20), 3)}
        figures.update({f"slot{peer}_mib_s": v for peer, v in mine.links.items() if v is not None})
        figures["links_missed"] = sum(v is None for v in mine.links.values())
        best = mine.best
        if best is not None:
            figures["best_mib_s"] = best
        if self.judgement is not None and mine.slot == 0:
            j = self.judgement
            figures.update(judged=j.judged, named=",".join(j.named),
                           slow_links=",".join(f"{a}-{b}" for a, b in j.slow_links))
        if verdict is None or best is None:
            why = "no verdict from the judge (train slot 0)" if verdict is None else "no link measured"
            return wait(NAME, f"{why} within {0.9 * deadline_s:.1f} s",
                        "the train nodes' link test finishes within health.link_timeout_s",
                        "look at the nodes named in the agents' logs; raise health.link_timeout_s on a "
                        "slow network", **figures)
        median = verdict.get("median_mib_s")
        if isinstance(median, (int, float)) and median > 0:
            figures.update(median_mib_s=round(float(median), 2), ratio=round(best / median, 3))
        if self.node in verdict["named"]:
            return bad(NAME, f"this node's best link moved {best:.0f} MiB/s, the train nodes' median "
                       f"{float(median or 0):.0f} MiB/s",
                       f"a node's links at least health.min_link_ratio={self.min_ratio:g} times its peers' median",
                       "look at the node's NIC, cable and switch port (error counters, link speed), or "
                       "its CPU load; lower health.min_link_ratio if the network is uneven by design", **figures)
        return ok(NAME, f"best link {best:.0f} MiB/s (median {float(median or 0):.0f} MiB/s)", **figures)
