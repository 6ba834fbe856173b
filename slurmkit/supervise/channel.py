"""The typed channel between node agents: every TCPStore key and message in one place.

The agents talk through one TCPStore on the node that holds it. Anyone on the cluster network
can connect to a TCPStore, so nothing here trusts a name or a value by itself:

- every key lives under one prefix per run attempt (and one per generation below it) derived
  from a random per-run token with HMAC, so a stranger can neither guess a key nor read one;
- every value carries an HMAC of its key and payload under the same token, so a value written
  by anyone without the token is refused, not believed (``evidence=gpu_oom`` from outside would
  otherwise stop the job with 93);
- every value read is validated (types, ranges, known node names) and a bad one raises
  :class:`ChannelError` with Detected/Requirement/Fix.

The token file, the seals and the one table of the store's key families (ChannelCore.KEY_*,
each with who writes it and who reads it) are in slurmkit.supervise.channelbase; the messages
are here, and build every key from that table. Counters (``add``) cannot carry a MAC; their keys
are as unguessable as the rest.

Every message costs its reader O(1) round trips whatever the number of agents N (2,048 nodes
means 2,048 readers of one store): an agent blocks on the generation's end key with one store
``wait`` (slurmkit.supervise.endwatch; it polls one change counter only when that wait cannot
be made), blocks on the decision key the same way (woken by node 0's post), and node 0 reads
every agent's beat or evidence with one ``multi_get``, never a get per agent.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from slurmkit.failures.classes import FailureClass
from slurmkit.runtoken import TOKEN_NAME, ChannelError, load_token, token_path
from slurmkit.supervise.channelbase import _ABSENT, ChannelCore
from slurmkit.failures.classify import Evidence
from slurmkit.supervise.policy import Action, Decision
from slurmkit.supervise.stragglers import NodeWindow, window_from_json, window_to_json

log = logging.getLogger(__name__)

_MAX_EVIDENCE = 64  # per node and generation
COMPLETED, SIGNALLED = "completed", "signalled"
_CLOCK_KEEP = 64  # node 0 deletes a clock tick this many ticks later (a reader has seconds)

__all__ = ["COMPLETED", "SIGNALLED", "TOKEN_NAME", "Channel", "ChannelError", "FailureNotice", "load_token", "token_path"]


# ------------------------------------------------------------------ messages
@dataclass(frozen=True)
class FailureNotice:
    """The first failure of a generation: who saw it (node, rank; -1: the agent) and its class."""

    node: str
    rank: int
    cls: FailureClass



class Channel(ChannelCore):
    """One agent's view of the store: ``nodes`` are the allocation's node names (node-rank order)."""

    # -------------------------------------------------------------- rendezvous port of the ranks
    def post_port(self, gen: int, port: int) -> None:
        key = self._gen(gen, self.KEY_PORT)
        self.store.set(key, self._seal(key, int(port)))

    def wait_port(self, gen: int, timeout_s: float) -> int:
        key = self._gen(gen, self.KEY_PORT)
        self.store.wait([key], timedelta(seconds=timeout_s))
        port = self._open(key, self.store.get(key))
        if not isinstance(port, int) or not 0 < port < 65536:
            raise ChannelError(f"store key {key} holds port {port!r}", "a TCP port (1-65535)",
                               "look for a stranger writing to the agents' store")
        return port

    def post_addr(self, node_rank: int, addr: str) -> None:
        """Where this node's agent (and its ranks' rendezvous, when it holds slot 0) is reached."""
        self.store.set(self._addr(node_rank), self._seal(self._addr(node_rank), addr))

    def addr(self, node_rank: int) -> str:
        key = self._addr(node_rank)
        raw = self._get(key)
        if not isinstance(raw, str) or not raw or len(raw) > 255 or any(c.isspace() or ord(c) < 32 for c in raw):
            raise ChannelError(f"store key {key} holds address {raw!r}", "a host name or IP address",
                               "check the agent log of that node")
        return raw

    # -------------------------------------------------------------- adopted program saves
    def post_adopt(self, notice: dict[str, Any]) -> None:
        """Node 0: the program's newest finished save, to be adopted (slurmkit.store.adopt);
        each notice replaces the one before."""
        key = self._key(self.KEY_ADOPT)
        self.store.set(key, self._seal(key, notice))

    def adopt_notice(self) -> dict[str, Any] | None:
        """The newest adopt notice node 0 posted (None: none yet); checked by its reader."""
        raw = self._get(self._key(self.KEY_ADOPT))
        if raw is not None and not isinstance(raw, dict):
            raise ChannelError(f"store key {self._key(self.KEY_ADOPT)} holds {type(raw).__name__}",
                               "an adopt notice (an object)", "look for a stranger writing to the agents' store")
        return raw

    # -------------------------------------------------------------- failure of a generation
    def post_failure(self, gen: int, node: str, rank: int, cls: FailureClass) -> None:
        """The first failure wins; later ones only add evidence."""
        key = self._gen(gen, self.KEY_FAIL)
        self._set_once(key, {"node": node, "rank": int(rank), "cls": cls.value})
        self.store.add(self._gen(gen, self.KEY_EVENTS), 1)
        self.store.set(self._gen(gen, self.KEY_END), "1")  # wakes every agent's EndWatch

    def wait_ended(self, gen: int, timeout_s: float) -> bool:
        """Block until ``gen``'s end key is set (a failure posted, or every slot finished): one
        store wait, woken by the post (slurmkit.supervise.endwatch). False when ``timeout_s``
        passed first; a store that does not answer raises (RuntimeError). The key is only a
        wake-up: what ended the generation is read from the failure and finish keys."""
        key = self._gen(gen, self.KEY_END)
        try:
            self.store.wait([key], timedelta(seconds=timeout_s))
        except RuntimeError:  # DistStoreError on a timeout, DistNetworkError on a broken store
            return bool(self.store.check([key]))  # raises if the store does not answer
        return True

    def changes(self, gen: int) -> int:
        """How many failures and finishes were posted in ``gen``: one counter (one round trip)
        that every agent polls, reading the failure and the finish counts only when it moved."""
        return self._count(self._gen(gen, self.KEY_EVENTS))

    def failure(self, gen: int) -> FailureNotice | None:
        key = self._gen(gen, self.KEY_FAIL)
        raw = self._get(key)
        if raw is None:
            return None
        try:
            return FailureNotice(self._node(raw["node"], key), int(raw["rank"]), FailureClass(raw["cls"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ChannelError(f"store key {key} holds a malformed failure ({exc})",
                               "node, rank and a failure class", "report a bug in slurmkit") from None

    def post_evidence(self, gen: int, node_rank: int, evidence: list[Evidence]) -> None:
        """This node's evidence (set once: the first report of a generation stands)."""
        key = self._evidence_key(gen, node_rank)
        self._set_once(key, [e.to_json() for e in evidence[:_MAX_EVIDENCE]])

    def _evidence_key(self, gen: int, node_rank: int) -> str:
        return self._gen(gen, self.KEY_EVIDENCE, node=node_rank)

    def evidence(self, gen: int, node_rank: int) -> list[Evidence] | None:
        key = self._evidence_key(gen, node_rank)
        raw = self._get(key)
        if raw is None:
            return None
        return self._evidence_list(key, raw)

    def all_evidence(self, gen: int, node_ranks: Sequence[int]) -> dict[int, list[Evidence] | ChannelError]:
        """Every listed node's evidence in one round trip (each key must exist: see
        has_all_evidence). A value that is not this run's is deleted and comes back as its
        ChannelError, so the caller counts that node as silent."""
        if not node_ranks:
            return {}
        keys = [self._evidence_key(gen, nr) for nr in node_ranks]
        out: dict[int, list[Evidence] | ChannelError] = {}
        for nr, key, raw in zip(node_ranks, keys, self.store.multi_get(keys)):
            try:
                if not raw:  # a stranger's value, cleared: the node has not reported yet
                    raise ChannelError(f"store key {key} was cleared (it held a stranger's value)",
                                       "the node's own sealed evidence",
                                       "look for a stranger writing to the agents' store")
                out[nr] = self._evidence_list(key, self._open(key, raw))
            except ChannelError as exc:
                if raw:
                    self._clear(key, raw)
                out[nr] = exc
        return out

    def has_all_evidence(self, gen: int, node_ranks: Sequence[int]) -> bool:
        """Whether every listed node has posted its evidence: one round trip while some key is
        missing, a second once all exist (a cleared stranger's value is not a report)."""
        if not node_ranks:
            return True
        keys = [self._evidence_key(gen, nr) for nr in node_ranks]
        return bool(self.store.check(keys)) and all(self.store.multi_get(keys))

    def _evidence_list(self, key: str, raw: Any) -> list[Evidence]:
        if not isinstance(raw, list) or len(raw) > _MAX_EVIDENCE:
            raise ChannelError(f"store key {key} holds no evidence list", "a list of evidence records",
                               "report a bug in slurmkit")
        try:
            out = [Evidence.from_json(d) for d in raw]
        except (KeyError, TypeError, ValueError) as exc:
            raise ChannelError(f"store key {key} holds a malformed evidence record ({exc})",
                               "time, node, rank, source, class, detail", "report a bug in slurmkit") from None
        for e in out:
            self._node(e.node, key)
        return out

    def has_evidence(self, gen: int, node_rank: int) -> bool:
        return bool(self.store.check([self._evidence_key(gen, node_rank)]))

    def post_stopped(self, gen: int) -> None:
        self.store.add(self._gen(gen, self.KEY_STOPPED), 1)

    def stopped(self, gen: int) -> int:
        return self._count(self._gen(gen, self.KEY_STOPPED))

    # -------------------------------------------------------------- the end of a generation
    def post_finished(self, gen: int, kind: str, slots: int | None = None) -> None:
        """This slot's ranks all left (``kind``). The one whose report completes the count of
        ``slots`` sets the generation's end key (waking every agent's EndWatch)."""
        if kind not in (COMPLETED, SIGNALLED):
            raise ValueError(kind)
        self.store.add(self._gen(gen, self.KEY_COMPLETED if kind == COMPLETED else self.KEY_SIGNALLED), 1)
        self.store.add(self._gen(gen, self.KEY_EVENTS), 1)
        if slots is not None and int(self.store.add(self._gen(gen, self.KEY_FINISHED), 1)) >= slots:
            self.store.set(self._gen(gen, self.KEY_END), "1")

    def finished(self, gen: int) -> tuple[int, int]:
        """(slots that completed, slots that left on a signal) in ``gen``."""
        return self._count(self._gen(gen, self.KEY_COMPLETED)), self._count(self._gen(gen, self.KEY_SIGNALLED))

    # -------------------------------------------------------------- a hang's stacks
    def stacks_taken(self, gen: int, expected: int, timeout_s: float) -> bool:
        """Say this agent has its ranks' stacks, then wait until ``expected`` agents have
        (one store wait, woken by the last one's post: no polling), at most ``timeout_s``.
        No node may kill its ranks while another still reads its own: the killed ranks' peers
        fail out of the collective they waited in, and their stacks then show the crash, not
        the wait (seen on the local cluster: two ranks blamed as 'outside' a collective in
        their exit handlers). True when all arrived in time; a lost agent costs the timeout."""
        done = self._gen(gen, self.KEY_STACKS_ALL)
        if int(self.store.add(self._gen(gen, self.KEY_STACKS), 1)) >= expected:
            self.store.set(done, "1")
            return True
        try:
            self.store.wait([done], timedelta(seconds=timeout_s))
        except RuntimeError:  # a timeout (or a failing store: the stop goes ahead either way)
            return bool(self.store.check([done]))
        return True

    # -------------------------------------------------------------- the decision
    def post_decision(self, gen: int, d: Decision) -> None:
        """Set once: a second decider (a successor of node 0) never overwrites the first."""
        key = self._gen(gen, self.KEY_DECISION)
        self._set_once(key, {"action": d.action.value, "reason": d.reason, "exclude": list(d.exclude)})

    def wait_decision(self, gen: int, timeout_s: float) -> Decision | None:
        """Block until node 0's decision is posted (one store wait, woken by the post: no
        polling), at most ``timeout_s``; None when it has not come by then. A wait that
        raises is told from a timeout by one check: a store that answers it merely timed out,
        one that does not raises (the caller's store-trouble path)."""
        key = self._gen(gen, self.KEY_DECISION)
        try:
            self.store.wait([key], timedelta(seconds=timeout_s))
        except RuntimeError:  # DistStoreError on a timeout, DistNetworkError on a broken store
            if not self.store.check([key]):
                return None
        # It is there, or it holds a cleared stranger's value (the wait no longer blocks on
        # it): then look again every 50 ms until node 0's own value lands or time is up.
        deadline = time.monotonic() + timeout_s
        while (raw := self._peek(key)) is None:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            time.sleep(min(0.05, left))
        try:
            value = self._open(key, raw)
        except ChannelError:
            self._clear(key, raw)
            raise
        return self._decision(key, value)

    def decision(self, gen: int) -> Decision | None:
        key = self._gen(gen, self.KEY_DECISION)
        raw = self._get(key)
        return None if raw is None else self._decision(key, raw)

    def _decision(self, key: str, raw: Any) -> Decision:
        try:
            exclude = tuple(self._node(n, key) for n in raw["exclude"])
            reason = raw["reason"]
            if not isinstance(reason, str):
                raise TypeError("reason is not text")
            return Decision(Action(raw["action"]), reason, exclude)
        except (KeyError, TypeError, ValueError) as exc:
            raise ChannelError(f"store key {key} holds a malformed decision ({exc})",
                               "action, reason, exclude", "report a bug in slurmkit") from None

    # -------------------------------------------------------------- liveness
    def beat(self, node_rank: int, tick: int, store: Any | None = None) -> None:
        """One beat of an agent (``store``: the beating thread's own connection)."""
        (store or self.store).set(self._alive(node_rank), str(int(tick)))

    def seed_beats(self, node_ranks: Sequence[int]) -> None:
        """Node 0, before anyone beats: every agent's counter exists (0: never beat), so one
        multi_get reads them all without waiting on a missing key."""
        for nr in node_ranks:
            self.store.compare_set(self._alive(nr), "", "0")

    def beats(self, node_ranks: Sequence[int]) -> dict[int, int]:
        """Every agent's beat counter in one round trip."""
        if not node_ranks:
            return {}
        raw = self.store.multi_get([self._alive(nr) for nr in node_ranks])
        out: dict[int, int] = {}
        for nr, v in zip(node_ranks, raw):
            try:
                out[nr] = int(v)
            except ValueError:
                raise ChannelError(f"store key {self._alive(nr)} holds {v[:40]!r}", "a beat counter",
                                   "look for a stranger writing to the agents' store") from None
        return out

    # -------------------------------------------------------------- step-time windows
    def _window_key(self, node_rank: int) -> str:
        return self._key(self.KEY_STEPS, node=node_rank)

    def seed_step_windows(self, node_ranks: Sequence[int]) -> None:
        """Node 0, before any generation: every node's window key exists (empty: none yet), so
        one multi_get reads them all without waiting on a missing key."""
        for nr in node_ranks:
            self.store.compare_set(self._window_key(nr), "", "")

    def post_step_window(self, node_rank: int, w: NodeWindow) -> None:
        """This node's newest step-time window (slurmkit.launch.steptimes): one set, replacing
        the last one (node 0 reads only the newest)."""
        key = self._window_key(node_rank)
        self.store.set(key, self._seal(key, window_to_json(w)))

    def step_windows(self, gen: int, node_ranks: Sequence[int]) -> dict[int, NodeWindow]:
        """The listed nodes' newest windows of generation ``gen``, in one round trip (keys seeded
        by seed_step_windows). A value that is not this run's, or malformed, is logged and left
        out (its node posts again next interval); so is one of another generation."""
        if not node_ranks:
            return {}
        keys = [self._window_key(nr) for nr in node_ranks]
        out: dict[int, NodeWindow] = {}
        for nr, key, raw in zip(node_ranks, keys, self.store.multi_get(keys)):
            if not raw:
                continue
            try:
                w = window_from_json(self.nodes[nr], self._open(key, raw))
            except (ChannelError, ValueError) as exc:
                log.error("step-time window at %s refused: %s", key, exc)
                continue
            if w.generation == gen:
                out[nr] = w
        return out

    # -------------------------------------------------------------- exit barrier
    def arrive_exit(self) -> int:
        return int(self.store.add(self._exit(), 1))

    def exited(self) -> int:
        return self._count(self._exit())

    # -------------------------------------------------------------- pre-flight: clock and links

    def _tick_key(self, tick: int) -> str:
        return self._key(self.KEY_CLOCK_TICK, tick=tick)

    def post_clock_tick(self, tick: int, node0_time: float) -> None:
        """Node 0: tick ``tick`` (1, 2, ...) stamped with its wall-clock time, then the tick
        counter (so a reader that sees counter k knows tick k+1 was stamped after it looked)."""
        key = self._tick_key(tick)
        self.store.set(key, self._seal(key, float(node0_time)))
        self.store.add(self._key(self.KEY_CLOCK_SEQ), 1)
        if tick > _CLOCK_KEEP:
            self.store.delete_key(self._tick_key(tick - _CLOCK_KEEP))

    def clock_seq(self) -> int:
        """The newest tick node 0 has posted (0: none yet)."""
        return self._count(self._key(self.KEY_CLOCK_SEQ))

    def wait_clock_tick(self, tick: int, timeout_s: float) -> float | None:
        """Node 0's time in tick ``tick``, once posted (one store wait); None when it does not
        come within ``timeout_s`` or was already deleted. Raises ChannelError on a forged value."""
        key = self._tick_key(tick)
        try:
            self.store.wait([key], timedelta(seconds=max(timeout_s, 0.001)))
        except RuntimeError:  # DistStoreError: not within timeout_s
            return None
        raw = self._peek(key)
        if raw is None:
            return None
        value = self._open(key, raw)
        if not isinstance(value, float) or not math.isfinite(value):
            raise ChannelError(f"store key {key} holds {value!r}", "node 0's wall-clock time in seconds",
                               "look for a stranger writing to the agents' store")
        return value

    def link_prefix(self, gen: int, a: int, b: int) -> str:
        """The store prefix under which train slots ``a`` and ``b`` build their 2-rank group of
        generation ``gen``'s bandwidth test (both derive it from the pair alone)."""
        return self._gen(gen, self.KEY_LINK_PAIR, a=a, b=b)

    def _link_key(self, gen: int, slot: int) -> str:
        return self._gen(gen, self.KEY_LINK_FIGURES, slot=slot)

    def post_link_figure(self, gen: int, slot: int, figure: dict[str, Any]) -> None:
        """One train slot's link figures, then the count the judge polls."""
        key = self._link_key(gen, slot)
        self.store.set(key, self._seal(key, figure))
        self.store.add(self._gen(gen, self.KEY_LINK_COUNT), 1)

    def link_figures_posted(self, gen: int) -> int:
        return self._count(self._gen(gen, self.KEY_LINK_COUNT))

    def link_figures(self, gen: int, slots: Sequence[int], *, all_posted: bool) -> dict[int, dict[str, Any]]:
        """The posted link figures of ``slots``: one multi_get when ``all_posted``, else one
        non-blocking read per slot (the judge's deadline passed with some missing). A value not
        this run's is logged and left out, as is a missing one."""
        keys = [self._link_key(gen, s) for s in slots]
        raws = self.store.multi_get(keys) if all_posted else [self._peek(k) or b"" for k in keys]
        out: dict[int, dict[str, Any]] = {}
        for slot, key, raw in zip(slots, keys, raws):
            if not raw:
                continue
            try:
                value = self._open(key, raw)
                if not isinstance(value, dict):
                    raise ChannelError(f"store key {key} holds {type(value).__name__}", "link figures",
                                       "report a bug in slurmkit")
                self._node(value.get("node"), key)
            except ChannelError as exc:
                log.error("link figures at %s refused: %s", key, exc)
                continue
            out[slot] = value
        return out

    def post_link_verdict(self, gen: int, verdict: dict[str, Any]) -> None:
        self._set_once(self._gen(gen, self.KEY_LINK_VERDICT), verdict)

    def wait_link_verdict(self, gen: int, timeout_s: float) -> dict[str, Any] | None:
        """The judge's verdict on generation ``gen``'s links (one store wait), or None when it
        has not come within ``timeout_s``. The nodes it names are checked against the allocation."""
        key = self._gen(gen, self.KEY_LINK_VERDICT)
        try:
            self.store.wait([key], timedelta(seconds=max(timeout_s, 0.001)))
        except RuntimeError:
            return None
        raw = self._get(key)
        if not isinstance(raw, dict) or not isinstance(raw.get("named"), list):
            return None if raw is None else self._bad_verdict(key, raw)
        for name in raw["named"]:
            self._node(name, key)
        return raw

    def _bad_verdict(self, key: str, raw: object) -> dict[str, Any]:
        raise ChannelError(f"store key {key} holds a malformed link verdict ({str(raw)[:80]})",
                           "the judge's median and named nodes", "report a bug in slurmkit")


    # -------------------------------------------------------------- a relaunched agent's rejoin
    # (slurmkit.supervise.relaunch: node 0 relaunches a lost agent on a node Slurm calls healthy)
    def _rejoin_key(self, node_rank: int) -> str:
        return self._key(self.KEY_REJOIN, node=node_rank)

    def post_rejoin(self, node_rank: int, r: Rejoin) -> None:
        """Node 0, before it relaunches that node's agent: where the new agent joins. A plain set
        (node 0 is the only writer): a later relaunch's message replaces an earlier one's, and
        the relaunch number the new agent was started with tells them apart."""
        key = self._rejoin_key(node_rank)
        self.store.set(key, self._seal(key, r.to_json()))

    def rejoin(self, node_rank: int, attempt: str) -> Rejoin | None:
        """The rejoin message for this node's relaunched agent (None: none posted), validated."""
        key = self._rejoin_key(node_rank)
        raw = self._get(key)
        return None if raw is None else Rejoin.from_json(raw, key, node_rank=node_rank, attempt=attempt,
                                                         nodes=len(self.nodes))

    def reset_beat(self, node_rank: int) -> None:
        """Node 0, before a relaunch: the lost agent's counter back to 0 (never beat), so that
        the first beat of its new agent is what moves it."""
        self.store.set(self._alive(node_rank), "0")


@dataclass(frozen=True)
class Rejoin:
    """Where a relaunched agent joins its attempt: the next generation, in its old slot."""

    attempt: str
    relaunch: int  # 1, 2, ...: which relaunch of this node's agent in the attempt
    generation: int  # the generation it starts with (the one after the loss)
    slot: int  # its train slot (the same as before the loss)
    slots: tuple[int, ...]  # the node rank of every train slot, in slot order
    spares: tuple[int, ...]  # the node ranks of the spares left

    def to_json(self) -> dict[str, Any]:
        return {"attempt": self.attempt, "relaunch": self.relaunch, "generation": self.generation,
                "slot": self.slot, "slots": list(self.slots), "spares": list(self.spares)}

    @classmethod
    def from_json(cls, raw: Any, key: str, *, node_rank: int, attempt: str, nodes: int) -> Rejoin:
        def bad(why: str) -> ChannelError:
            return ChannelError(f"store key {key} holds a malformed rejoin message ({why})",
                                "attempt, relaunch, generation, slot, slots and spares written by node 0",
                                "look for a stranger writing to the agents' store, or report a bug in slurmkit")

        def count(v: Any, low: int, high: int | None = None) -> int:
            if type(v) is not int or v < low or (high is not None and v >= high):
                raise bad(f"{v!r} out of range")
            return v

        if not isinstance(raw, dict) or set(raw) != {"attempt", "relaunch", "generation", "slot", "slots", "spares"}:
            raise bad(f"fields {sorted(raw) if isinstance(raw, dict) else type(raw).__name__}")
        if raw["attempt"] != attempt:
            raise bad(f"attempt {raw['attempt']!r}, this agent's is {attempt!r}")
        if not isinstance(raw["slots"], list) or not isinstance(raw["spares"], list):
            raise bad("slots and spares are not lists")
        slots = tuple(count(v, 0, nodes) for v in raw["slots"])
        spares = tuple(count(v, 0, nodes) for v in raw["spares"])
        if len(set(slots + spares)) != len(slots) + len(spares):
            raise bad("a node rank twice in slots and spares")
        slot = count(raw["slot"], 0, len(slots))
        if slots[slot] != node_rank:
            raise bad(f"slot {slot} is node rank {slots[slot]}'s, not this agent's ({node_rank})")
        return cls(attempt, count(raw["relaunch"], 1), count(raw["generation"], 1), slot, slots, spares)
