"""The channel's foundation: the per-run token, unguessable keys (every family of them in one
table, ChannelCore.KEY_*) and signed values.

Anyone on the cluster network can connect to a TCPStore, so nothing the agents read from it is
trusted by itself. Every key lives under one prefix per run attempt derived from a random per-run
token with HMAC; every value carries an HMAC of its key and payload under the same token; a value
that is not sealed with it is refused (:class:`ChannelError`) and cleared, and never believed.
The token lives in a 0600 file of the run directory (``rdzv/token``), created by the first agent
that starts the run; a file others can read or write, or owned by someone else, is refused
(slurmkit.runtoken, which the store reads it with too).
The messages themselves are in slurmkit.supervise.channel.
"""


from __future__ import annotations

import copy
import hashlib
import hmac
import json
import logging
from collections.abc import Sequence
from typing import Any, TypeVar

from slurmkit.runtoken import ChannelError


log = logging.getLogger(__name__)
_C = TypeVar("_C", bound="ChannelCore")

_MAX_VALUE = 1 << 20  # a value this long was not written by an agent
# Never written by an agent: compare_set(key, _ABSENT, _ABSENT) reads a key without blocking and
# without writing (an absent key answers _ABSENT, a present one its value).
_ABSENT = "\x00slurmkit:absent"


class ChannelCore:
    """The keys, seals and store primitives every message of slurmkit.supervise.channel uses."""

    # ------------------------------------------------- every key family of the store, once
    # A key is <prefix>/<family>, ``prefix`` one per run attempt (an HMAC of the run token); the
    # families after KEY_GENERATION are one generation's, below <prefix>/g<gen>/. Fields: {node} a
    # node rank, {tick} a clock tick, {slot} a train slot, {a}-{b} a pair of train slots. Values:
    # sealed (the token's HMAC of key and payload: _seal/_open), a counter (store.add: no MAC is
    # possible, the key is as unguessable as the rest) or a plain flag or number.
    #     family                         writer -> reader(s); value
    KEY_ALIVE = "alive/{node}"         # its agent (node 0 seeds, resets) -> node 0, all for node 0's; plain count
    KEY_ADDR = "addr/{node}"           # its agent at start -> the agents whose slot 0 it holds; sealed
    KEY_STEPS = "steps/{node}"         # its agent per beat interval (node 0 seeds it "") -> node 0; sealed
    KEY_REJOIN = "rejoin/{node}"       # node 0 before a relaunch -> that node's relaunched agent; sealed
    KEY_CLOCK_TICK = "clock/{tick}"    # node 0's ticker -> every agent's clock pre-flight; sealed
    KEY_CLOCK_SEQ = "clock/seq"        # node 0's ticker, after each tick -> every clock pre-flight; counter
    KEY_EXIT = "exit"                  # every agent as it leaves -> node 0 (keeps the store up); counter
    KEY_ADOPT = "adopt"                # node 0, at each program save it adopts -> every agent's Adopter; sealed
    KEY_GENERATION = "g{gen}"          # the scope of the families below
    KEY_PORT = "port"                  # the agent of train slot 0 -> every train node's agent; sealed
    KEY_FAIL = "fail"                  # the first agent to see a failure (set once) -> every agent; sealed
    KEY_EVIDENCE = "evidence/{node}"   # its agent (set once) -> node 0's decision; sealed
    KEY_EVENTS = "events"              # every failure and finish post -> every agent's poll; counter
    KEY_END = "end"                    # the failure post, or the last finish -> every agent's EndWatch; flag
    KEY_COMPLETED = "completed"        # each slot whose ranks all completed -> every agent; counter
    KEY_SIGNALLED = "signalled"        # each slot whose ranks left on a signal -> every agent; counter
    KEY_FINISHED = "finished"          # each slot that finished either way -> the last finisher; counter
    KEY_STOPPED = "stopped"            # each agent whose ranks were stopped -> node 0; counter
    KEY_STACKS = "stacks"              # each agent with its ranks' stacks -> the last to arrive; counter
    KEY_STACKS_ALL = "stacks_all"      # the last agent with its stacks -> every agent about to kill; flag
    KEY_DECISION = "decision"          # node 0, or its successor (set once) -> every agent; sealed
    KEY_LINK_PAIR = "link/{a}-{b}/"    # train slots a and b: their link test's 2-rank group keys below it
    KEY_LINK_FIGURES = "linkfig/{slot}"  # that train slot's link test -> the judge (slot 0); sealed
    KEY_LINK_COUNT = "linkfig/count"   # each train slot after its figures -> the judge; counter
    KEY_LINK_VERDICT = "linkverdict"   # the judge (set once) -> every train slot's link check; sealed

    def __init__(self, store: Any, attempt: str, token: bytes, nodes: Sequence[str]) -> None:
        self.store = store
        self.nodes = tuple(nodes)
        self._members = frozenset(self.nodes)  # a node named in a message: checked in O(1), not O(N)
        self._token = token
        tag = hmac.new(token, f"attempt:{attempt}".encode(), hashlib.sha256).hexdigest()[:32]
        self.prefix = f"sk/{tag}"

    # -------------------------------------------------------------- keys, from the table only
    def _key(self, family: str, **fields: int) -> str:
        """The key of ``family`` (a KEY_ of the table) with its fields: <prefix>/<family>."""
        return f"{self.prefix}/{family.format(**{name: int(v) for name, v in fields.items()})}"

    def _gen(self, gen: int, family: str, **fields: int) -> str:
        """The key of a generation's ``family``: <prefix>/g<gen>/<family>."""
        return self._key(f"{self.KEY_GENERATION}/{family}", gen=gen, **fields)

    def _alive(self, node_rank: int) -> str:
        return self._key(self.KEY_ALIVE, node=node_rank)

    def _addr(self, node_rank: int) -> str:
        return self._key(self.KEY_ADDR, node=node_rank)

    def _exit(self) -> str:
        return self._key(self.KEY_EXIT)

    # -------------------------------------------------------------- signed values
    def _mac(self, key: str, payload: str) -> str:
        return hmac.new(self._token, f"{key}\n{payload}".encode(), hashlib.sha256).hexdigest()

    def _seal(self, key: str, value: object) -> str:
        payload = json.dumps(value, separators=(",", ":"))
        return json.dumps({"p": payload, "mac": self._mac(key, payload)}, separators=(",", ":"))

    def _open(self, key: str, raw: bytes) -> Any:
        """The payload of a sealed value; ChannelError if it is not one this run wrote."""
        if len(raw) > _MAX_VALUE:
            raise ChannelError(f"store key {key} holds {len(raw)} bytes", "a short agent message",
                               "look for a stranger writing to the agents' store")
        try:
            outer = json.loads(raw)
            payload, mac = outer["p"], outer["mac"]
            if not isinstance(payload, str) or not isinstance(mac, str):
                raise TypeError("not strings")
        except (ValueError, KeyError, TypeError) as exc:
            raise ChannelError(f"store key {key} holds an unsealed value ({exc})",
                               "values carry the run token's HMAC",
                               "look for a stranger writing to the agents' store") from None
        if not hmac.compare_digest(mac, self._mac(key, payload)):
            raise ChannelError(f"store key {key} holds a value with a wrong HMAC",
                               "values signed with the run's token (rdzv/token)",
                               "look for a stranger writing to the agents' store; the value was ignored")
        return json.loads(payload)

    def _peek(self, key: str) -> bytes | None:
        """The raw value at ``key`` in one round trip that never blocks, or None when absent or
        cleared. (check-then-get would race: another agent may clear a forged value between
        the two, and the get then waits for the store's whole timeout.)"""
        raw = self.store.compare_set(key, _ABSENT, _ABSENT)
        raw = raw.encode() if isinstance(raw, str) else bytes(raw)
        return None if raw in (b"", _ABSENT.encode()) else raw

    def _clear(self, key: str, raw: bytes | str) -> None:
        """Empty ``key`` if it still holds ``raw`` (a stranger's value). Compare-and-clear, not a
        delete: a delete could remove the agent's own message set meanwhile; an empty value
        counts as absent everywhere, and _set_once writes over it."""
        self.store.compare_set(key, raw, "")

    def _get(self, key: str) -> Any | None:
        """The sealed value at ``key``, or None when absent. A value that is not sealed with
        this run's token is cleared (so the agents' own set-once message can still land) and
        refused with ChannelError."""
        raw = self._peek(key)
        if raw is None:
            return None
        try:
            return self._open(key, raw)
        except ChannelError:
            self._clear(key, raw)
            raise

    def _count(self, key: str) -> int:
        return int(self.store.add(key, 0))

    def _set_once(self, key: str, value: object) -> None:
        """Set ``key`` unless an agent of this run set it first. A squatter's value (not sealed
        with the token, planted before the agent wrote) is deleted and the write tried once
        more, so a stranger cannot block a failure, evidence or decision by writing first."""
        sealed = self._seal(key, value)
        for _ in range(2):
            current = self.store.compare_set(key, "", sealed)
            if current in (sealed, sealed.encode()):
                return
            try:
                self._open(key, current)
                return  # another agent of this run was first: its message stands
            except ChannelError as exc:
                log.error("%s", exc)
                self._clear(key, current)

    def _node(self, value: object, key: str) -> str:
        if not isinstance(value, str) or value not in self._members:
            raise ChannelError(f"store key {key} names node {value!r}",
                               f"one of the allocation's nodes ({','.join(self.nodes)})",
                               "look for a stranger writing to the agents' store")
        return value

    def on(self: _C, store: Any) -> _C:
        """This channel over another connection to the same store (a pre-flight check's own:
        its blocking waits then hold up no other thread of the agent)."""
        other = copy.copy(self)
        other.store = store
        return other
