"""The store's coordination: small JSON messages through the job's rendezvous store.

Why not process groups: a gloo group is a full mesh (every rank connects to every other), so
the two groups the store used to make cost each rank 2(N-1) sockets, and their "broadcast"
(an all-gather padded to the largest payload) made every rank receive N copies. At 2,048
nodes x 8 ranks that is 32k sockets and tens of MB per rank per save.

Instead every rank holds one extra connection per coordinator to the TCPStore that
torch.distributed's default group already rendezvoused on (``Store.clone()``), and every
operation is O(1) requests and bytes for a rank other than the root:

* ``broadcast_json``: the root sets one key, the others get it;
* ``gather_json``: each rank appends one line to one key and counts itself in; the root
  reads the key once all arrived (the root receives O(N), as the manifest's writer must);
* ``reduce_json`` (and ``agree``, ``any_true``, ``max_int``, ``barrier`` on it): a gather to
  the root, whose small result every rank gets.

Two coordinators (the writer thread's, the training thread's) never share a connection: a
TCPStore client holds its lock while it blocks in a wait, so one thread's wait would stall
the other's requests and, across ranks, deadlock. Keys are namespaced per store instance
(counted on the store itself, so a restarted generation on the same server never reads an
old key) and the root deletes an operation's keys once every rank has moved past it.

Payloads are JSON, never pickle; what comes back is checked (a malformed line or a rank
heard twice is a CoordinationError, which callers treat like any failed save or restore).
Bulk data between peers (buddy copies) goes over 2-rank gloo groups made for exactly the
ranks involved (buddy.Links), never a world-sized one.

Anyone who reaches the job's store can connect to it, so with a ``secret`` (``coord_secret``:
derived from the run's token, slurmkit.runtoken, for this attempt, generation and
store address) every key lives under a prefix derived from it, which a stranger cannot guess,
and every value and gathered line carries an HMAC of its full key and payload: a value that
is not signed so is refused (ForgedValueError, a CoordinationError), a forged gathered line is
dropped, so nobody else can race in a step list, a promotion decision or a verdict.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import threading
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

from slurmkit.errors import SlurmkitError
from slurmkit.runtoken import load_token

log = logging.getLogger(__name__)

# Per-process operation counter (the scale benchmark reads it; one per coordinator call)
COUNTERS: dict[str, int] = {"store_ops": 0}
_COUNTER_LOCK = threading.Lock()
MAX_REASON = 300  # characters of one rank's failure reason carried in an agreement
MAX_REASONS = 8  # ranks whose reasons an agreement carries (the count says how many failed)
_TOP = "slurmkit/ckpt"  # every key of the checkpoint coordinators is below it


class CoordinationError(SlurmkitError):
    """The ranks' exchange failed or returned something malformed."""


class ForgedValueError(CoordinationError):
    """A value on the job's store is not signed with this run's coordinator secret."""


_MAC_HEX = 64  # characters of a value's HMAC-SHA256, in front of its payload


def coord_secret(env: Mapping[str, str]) -> bytes | None:
    """The coordinator's signing secret: the run's token (``$SLURMKIT_RUN_DIR/rdzv/token``,
    0600, the agents' own) bound to this attempt, generation and store address, so a value
    recorded in one generation is worthless in the next. None without a run directory (a
    trainer started by hand): values are then not signed."""
    run_dir = env.get("SLURMKIT_RUN_DIR")
    if not run_dir:
        return None
    token = load_token(run_dir, create=True)  # made by node 0's agent; by a rank without one
    scope = "/".join(env.get(k, "") for k in ("SLURMKIT_ATTEMPT", "SLURMKIT_GENERATION",
                                              "MASTER_ADDR", "MASTER_PORT"))
    return hmac.new(token, f"slurmkit-ckpt-coord:{scope}".encode(), hashlib.sha256).digest()


def _count() -> None:
    with _COUNTER_LOCK:
        COUNTERS["store_ops"] = COUNTERS.get("store_ops", 0) + 1


class Coordinator:
    """JSON broadcast, gather and reductions among the ranks of one job (or a world of one).

    ``store``: a torch.distributed Store (a dedicated client); None for a world of one. All
    ranks must call the same operations in the same order (like collectives), but a rank
    other than the root never waits in a gather or a broadcast it sends.
    """

    def __init__(self, store: Any | None, rank: int, world_size: int, *,
                 root: int = 0, secret: bytes | None = None, label: str = "") -> None:
        self.store: Any = store
        self.secret = secret  # signs every value (None: unsigned, no run token)
        self.label = label  # the store prefix of this coordinator, part of what is signed
        self.rank = rank
        self.world_size = world_size
        self.root = root
        self._seq = 0
        self.namespace = ""  # this store instance's key prefix (set by coordinators())
        self.timeout_s = 1800.0
        self._stale: list[str] = []  # keys of finished operations (the root deletes them)

    @property
    def distributed(self) -> bool:
        return self.store is not None and self.world_size > 1

    @property
    def group(self) -> None:
        """No process group: DCP runs over this coordinator (dcp_coord.py), not a group."""
        return None

    # -- primitives ---------------------------------------------------------------------
    def _key(self) -> str:
        self._seq += 1
        _count()
        return str(self._seq)

    def _get(self, key: str) -> bytes:
        try:
            return bytes(self.store.get(key))  # type: ignore[union-attr]
        except Exception as exc:  # DistStoreError on timeout, connection loss
            raise CoordinationError(f"rank {self.rank}: waiting for {key!r} from the other "
                                    f"ranks failed: {exc}") from exc

    def _mac(self, key: str, payload: bytes) -> bytes:
        assert self.secret is not None
        full = f"{self.label}{key}\n".encode()
        return hmac.new(self.secret, full + payload, hashlib.sha256).hexdigest().encode()

    def _seal(self, key: str, obj: Any) -> str:
        """``obj`` as JSON, behind the HMAC of the full key and the JSON when signing."""
        payload = json.dumps(obj)
        if self.secret is None:
            return payload
        return self._mac(key, payload.encode()).decode() + payload

    def _unseal(self, key: str, raw: bytes) -> bytes:
        """The JSON payload of a value sealed under ``key``; ForgedValueError otherwise."""
        if self.secret is None:
            return raw
        mac, payload = raw[:_MAC_HEX], raw[_MAC_HEX:]
        if len(mac) != _MAC_HEX or not hmac.compare_digest(mac, self._mac(key, payload)):
            raise ForgedValueError(
                f"rank {self.rank}: the job's store holds a value under {key!r} that is not "
                "signed with this run's token (a stranger writing to the ranks' store?): "
                f"refused ({len(raw)} bytes, starting {raw[:24]!r})")
        return payload

    def _read(self, key: str) -> Any:
        """Wait for ``key`` and return its signed JSON value."""
        return _loads(self._unseal(key, self._get(key)), key)

    def _set(self, key: str, obj: Any, what: str) -> None:
        value = self._seal(key, obj)
        self._request(lambda: self.store.set(key, value), what)

    def _lines(self, key: str, data: bytes) -> bytes:
        """The appended lines under ``key`` whose signature holds; a forged one is dropped
        (and logged): the ranks' own lines are still there."""
        if self.secret is None:
            return data
        good = []
        for line in data.splitlines():
            if not line.strip():
                continue
            try:
                good.append(self._unseal(key, line))
            except ForgedValueError as exc:
                log.warning("%s; the line was dropped", exc)
        return b"\n".join(good)

    def _request(self, fn: Callable[[], Any], what: str) -> Any:
        try:
            return fn()
        except Exception as exc:
            raise CoordinationError(f"rank {self.rank}: {what} failed: {exc}") from exc

    def _fence(self, current: list[str]) -> None:
        """Root only, once every rank reached the current operation: every earlier one is
        finished everywhere, so its keys can go (the store must not grow with each save)."""
        stale, self._stale = self._stale, list(current)
        for k in stale:
            try:
                self.store.delete_key(k)  # type: ignore[union-attr]
            except Exception:  # a missing key or a closing store: nothing to reclaim
                pass

    # -- operations ---------------------------------------------------------------------
    def broadcast_json(self, obj: Any, src: int | None = None) -> Any:
        """Rank ``src``'s ``obj`` (the root's by default) on every rank."""
        if not self.distributed:
            return obj
        src = self.root if src is None else src
        k = f"{self._key()}/b"
        if self.rank == src:
            self._set(k, obj, "broadcast")
            if src == self.root:
                self._stale.append(k)
            return obj
        return self._read(k)

    def publish(self, obj: Any) -> str:
        """Every rank calls it, none waits: the root puts its ``obj`` under the returned key,
        which ranks may ``fetch`` later (or never); it is reclaimed at a later fence, after
        every rank passed it. Other ranks' ``obj`` is ignored."""
        k = f"{self._key()}/p"
        if self.distributed and self.rank == self.root:
            self._set(k, obj, "publish")
            self._stale.append(k)
        return k

    def fetch(self, key: str) -> Any:
        """What the root ``publish``-ed (or a rank ``put``) under ``key``; waits for it."""
        return self._read(key)

    def put(self, key: str, obj: Any) -> None:
        """Set ``key`` (one derived from an operation's key, e.g. ``publish``'s) for the few
        ranks that ``fetch`` it: a point-to-point signal, no other rank waits. The root must
        ``reclaim`` it."""
        if self.distributed:
            self._set(key, obj, "put")

    def reclaim(self, keys: list[str]) -> None:
        """Root only: delete ``keys`` at the next gather or reduce, once every rank reached
        it (so every rank is past the point where it reads them)."""
        if self.distributed and self.rank == self.root:
            self._stale.extend(keys)

    def scatter_json(self, objs: list[Any] | None) -> Any:
        """The root's ``objs[rank]`` on each rank (one key each, set in one request)."""
        if not self.distributed:
            assert objs is not None
            return objs[0]
        k = self._key()
        if self.rank == self.root:
            if objs is None or len(objs) != self.world_size:
                raise CoordinationError("scatter needs one entry per rank on the root")
            keys = [f"{k}/{r}" for r in range(self.world_size)]
            values = [self._seal(key, o) for key, o in zip(keys, objs)]
            self._request(lambda: self.store.multi_set(keys, values), "scatter")
            self._stale.extend(keys)
            return objs[self.rank]
        return self._read(f"{k}/{self.rank}")

    def gather_json(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` in rank order on the root; None elsewhere (no wait there)."""
        if not self.distributed:
            return [obj]
        k = self._key()
        line = self._seal(f"{k}/a", [self.rank, obj]) + "\n"
        self._request(lambda: self.store.append(f"{k}/a", line), "gather")
        arrived = self._request(lambda: self.store.add(f"{k}/n", 1), "gather count")
        if arrived == self.world_size:
            self._request(lambda: self.store.set(f"{k}/d", "1"), "gather done")
        if self.rank != self.root:
            return None
        self._get(f"{k}/d")
        out = _parse_lines(self._lines(f"{k}/a", self._get(f"{k}/a")), self.world_size, k)
        self._fence([f"{k}/a", f"{k}/n", f"{k}/d"])
        return out

    def reduce_json(self, obj: Any, reduce: Callable[[list[Any]], Any]) -> Any:
        """``reduce`` (run on the root) of every rank's ``obj``, on every rank."""
        if not self.distributed:
            return reduce([obj])
        k = self._key()
        line = self._seal(f"{k}/a", [self.rank, obj]) + "\n"
        self._request(lambda: self.store.append(f"{k}/a", line), "reduce")
        arrived = self._request(lambda: self.store.add(f"{k}/n", 1), "reduce count")
        if arrived == self.world_size:
            self._request(lambda: self.store.set(f"{k}/d", "1"), "reduce done")
        if self.rank == self.root:
            self._get(f"{k}/d")
            result = reduce(_parse_lines(self._lines(f"{k}/a", self._get(f"{k}/a")),
                                         self.world_size, k))
            self._set(f"{k}/r", result, "reduce result")
            self._fence([f"{k}/a", f"{k}/n", f"{k}/d", f"{k}/r"])
            return result
        return self._read(f"{k}/r")

    def all_gather_json(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` on every rank. O(N) bytes per rank: only for results every
        rank truly needs whole (the store's own paths use gather/reduce/agree instead)."""
        return self.reduce_json(obj, lambda xs: xs)

    def agree(self, ok: bool, why: str = "") -> tuple[bool, list[tuple[int, str]]]:
        """(every rank ok, up to MAX_REASONS (rank, reason) of those that were not; the
        count of failed ranks is in the last entry's text when more failed)."""
        mine = None if ok else why[:MAX_REASON]

        def combine(xs: list[Any]) -> Any:
            bad = [[r, x] for r, x in enumerate(xs) if x is not None]
            shown = bad[:MAX_REASONS]
            if len(bad) > len(shown):
                shown.append([-1, f"... and {len(bad) - len(shown)} more ranks"])
            return {"ok": not bad, "bad": shown}

        res = self.reduce_json(mine, combine)
        if not isinstance(res, dict) or not isinstance(res.get("bad"), list):
            raise CoordinationError(f"malformed agreement from the root: {res!r}"[:300])
        return bool(res.get("ok")), [(int(r), str(w)) for r, w in res["bad"]]

    def any_true(self, flag: bool) -> bool:
        return bool(self.reduce_json(bool(flag), lambda xs: any(bool(x) for x in xs)))

    def max_int(self, value: int | None) -> int | None:
        """The largest ``value`` over the ranks (None where every rank passed None)."""
        def top(xs: list[Any]) -> Any:
            vals = [int(x) for x in xs if isinstance(x, int) and not isinstance(x, bool)]
            return max(vals) if vals else None

        res = self.reduce_json(value, top)
        return None if res is None else int(res)

    def barrier(self) -> None:
        if self.distributed:
            self.reduce_json(None, lambda xs: None)


def _loads(data: bytes, key: str) -> Any:
    try:
        return json.loads(data)
    except ValueError as exc:
        raise CoordinationError(f"malformed message under {key!r}: {exc}") from exc


def _parse_lines(data: bytes, world_size: int, key: str) -> list[Any]:
    """The appended ``[rank, obj]`` lines, in rank order; each rank exactly once."""
    out: list[Any] = [None] * world_size
    seen: set[int] = set()
    for line in data.splitlines():
        if not line.strip():
            continue
        try:
            rank, obj = json.loads(line)
        except (ValueError, TypeError) as exc:
            raise CoordinationError(f"malformed line under {key!r}: {line[:80]!r}") from exc
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < world_size \
                or rank in seen:
            raise CoordinationError(f"line under {key!r} from rank {rank!r}: not a rank of "
                                    f"this world of {world_size}, or heard twice")
        seen.add(rank)
        out[rank] = obj
    if len(seen) != world_size:
        missing = sorted(set(range(world_size)) - seen)[:5]
        raise CoordinationError(f"{key!r}: no message from ranks {missing}")
    return out


def job_store(timeout_s: float) -> Any:
    """The default group's rendezvous store (must exist: torch.distributed initialized)."""
    import torch.distributed.distributed_c10d as c10d

    store = c10d._get_default_store()
    store.set_timeout(timedelta(seconds=timeout_s))
    return store


def coordinators(rank: int, world_size: int, names: tuple[str, ...],
                 timeout_s: float = 1800.0, secret: bytes | None = None) -> list[Coordinator]:
    """One Coordinator per name, each on its own client connection to the job's store,
    under a prefix unique to this store instance (and, with a ``secret``, unguessable; its
    values signed). Collective: every rank calls it. ``side_store(coords[0], name)`` gives
    further clients under the same prefix."""
    if world_size <= 1:
        return [Coordinator(None, rank, 1) for _ in names]
    import torch.distributed as dist

    base = job_store(timeout_s)
    # the n-th store made in this job (on this rendezvous server): every rank counts itself
    # in, and the barrier below keeps a fast rank from counting into the next instance
    top = _TOP
    if secret is not None:  # a stranger cannot name (so cannot read or squat) any key
        top = f"{top}/{hmac.new(secret, b'keys', hashlib.sha256).hexdigest()[:32]}"
    count = int(base.add(f"{top}/instances", 1))
    instance = (count - 1) // world_size
    prefix = f"{top}/{instance}/"
    out = []
    for name in names:
        client = _clone(base)
        client.set_timeout(timedelta(seconds=timeout_s))
        out.append(Coordinator(dist.PrefixStore(f"{prefix}{name}/", client), rank, world_size,
                               secret=secret, label=f"{prefix}{name}/"))
        out[-1].namespace = prefix
        out[-1].timeout_s = timeout_s
    out[0].barrier()
    return out


def side_store(coord: Coordinator, name: str) -> Any | None:
    """A new client connection to the job's store under ``coord``'s instance prefix +
    ``name`` (e.g. the buddy pairs' rendezvous), the same on every rank of this store
    instance; None without a store."""
    if not coord.distributed or not coord.namespace:
        return None
    import torch.distributed as dist

    client = _clone(job_store(coord.timeout_s))
    client.set_timeout(timedelta(seconds=coord.timeout_s))
    return dist.PrefixStore(f"{coord.namespace}{name}/", client)


def _clone(store: Any) -> Any:
    try:
        return store.clone()
    except (AttributeError, RuntimeError, NotImplementedError):
        return store  # a store kind without clone (hash/file store): share it
