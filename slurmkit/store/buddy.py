"""Buddy copies: each node's checkpoint files also on a peer node's NVMe, sent over gloo.

Why: a save kept only on node-local NVMe is a recovery point only if every rank can still
read everything it needs after a failure. DCP spreads replicated items over every rank's
files and a node's NVMe holds only its own ranks' files, so without a copy elsewhere a rank
restarted on a spare (or a rank whose node lost its disk) falls back to the last save that
reached the shared tier. Sending the files to a buddy node over the network costs one NIC
transfer of the node's own bytes per save, never touches the shared file system, and is
O(replicas) per rank at any job size (Gemini, SOSP'23; NVIDIA resiliency-ext's local
checkpoints).

Layout (the node agent's rank layout: ``rank = slot * L + local_rank``, a spare takes the
lost node's slot, so slots are stable across generations while node names are not):
slot ``k`` holds its own files and those of slots ``k-1 .. k-R`` (ring order, ``R`` =
``store.replicas``); rank ``r`` sends its files to ranks ``r + j*L`` and receives from
``r - j*L`` (``j = 1..R``), so every transfer is between one pair of ranks in a fixed shift.

The wire format (one module, one place): a frame is an int64 length (-1: "I do not have
it") followed by that many bytes in chunks of ``CHUNK``. Both sides always run whole
frames, so a failed read or write on one side never desynchronises the pair; the receiver
verifies every file's checksum before it appears under its final name.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from slurmkit.store import nofollow
from slurmkit.store.manifest import FileEntry, Hasher
from slurmkit.store.tier import fsync_dir

log = logging.getLogger(__name__)
CHUNK = 16 << 20  # bytes per gloo message
Pair = tuple[int, int]


@dataclass(frozen=True)
class Ring:
    """Who holds whose files. ``local_world``: ranks per node (0: unknown, buddies off)."""

    rank: int
    world_size: int
    local_world: int
    replicas: int

    @property
    def slots(self) -> int:
        return self.world_size // self.local_world if self.local_world else 1

    @property
    def copies(self) -> int:
        """Buddy copies actually kept: at most one per other node."""
        if not self.local_world or self.world_size % self.local_world:
            return 0
        return max(0, min(self.replicas, self.slots - 1))

    @property
    def enabled(self) -> bool:
        return self.copies > 0

    def slot_of(self, rank: int) -> int:
        return rank // self.local_world

    @property
    def slot(self) -> int:
        return self.slot_of(self.rank)

    def targets(self) -> list[int]:
        """Ranks that keep a copy of this rank's files (nearest first)."""
        step = self.local_world
        return [(self.rank + j * step) % self.world_size for j in range(1, self.copies + 1)]

    def sources(self) -> list[int]:
        """Ranks whose files this rank keeps a copy of (same order as ``targets``)."""
        step = self.local_world
        return [(self.rank - j * step) % self.world_size for j in range(1, self.copies + 1)]

    def holder_slots(self, writer: int) -> list[int]:
        """Slots whose NVMe holds ``writer``'s files: its own first, then its buddies."""
        s = self.slot_of(writer)
        return [(s + j) % self.slots for j in range(self.copies + 1)]

    def held_slots(self) -> list[int]:
        """Slots whose files this rank's node keeps: its own, then ring predecessors."""
        return [(self.slot - j) % self.slots for j in range(self.copies + 1)]

    def ring_pairs(self) -> list[Pair]:
        pairs = {_pair(self.rank, p) for p in self.targets() + self.sources()}
        return sorted(pairs)


def _pair(a: int, b: int) -> Pair:
    return (a, b) if a < b else (b, a)


class Link:
    """One 2-rank gloo process group: this rank and ``peer``, nothing else."""

    def __init__(self, pg: Any, peer: int, peer_index: int) -> None:
        self.pg = pg
        self.peer = peer  # the peer's global rank
        self._index = peer_index  # its rank inside the pair (0 or 1)

    def send(self, t: torch.Tensor) -> None:
        self.pg.send([t], self._index, 0).wait()

    def recv(self, t: torch.Tensor) -> None:
        self.pg.recv([t], self._index, 0).wait()


class Links:
    """2-rank gloo groups, made on demand, each a rendezvous of its two members only.

    Why not ``dist.new_group(use_local_synchronization=True)``: c10d names such a group by
    hashing its ranks together with the number of groups the calling process already has,
    so two members that made different numbers of pairs before (rank 1 pairs with 0 then 2,
    rank 2 with 2's first pair 1) rendezvous under different names and wait for each other
    forever (seen at 4 nodes). Here the group is built directly on ``store`` (a prefix of
    the job's rendezvous store unique to this CheckpointStore), under a name both members
    derive from the pair alone. Every rank makes its pairs in one global order (sorted
    pairs), so no cycle of ranks each waiting for the next can form; a pair is made once.
    """

    def __init__(self, rank: int, store: Any | None = None,
                 timeout_s: float = 1800.0) -> None:
        self.rank = rank
        self.store = store
        self.timeout_s = timeout_s
        self._links: dict[Pair, Link] = {}
        self._lock = threading.Lock()  # the writer thread and a restore may both ask

    def ensure(self, pairs: Iterable[Pair]) -> None:
        for pair in sorted(set(pairs)):
            if self.rank in pair:
                self._make(pair)

    def _make(self, pair: Pair) -> Link:
        with self._lock:
            link = self._links.get(pair)
            if link is None:
                if self.store is None:
                    raise RuntimeError("buddy links need the job's rendezvous store "
                                       "(CheckpointStore.from_config makes it)")
                import torch.distributed as dist

                me = pair.index(self.rank)
                pg = dist.ProcessGroupGloo(dist.PrefixStore(f"{pair[0]}-{pair[1]}/", self.store),
                                           me, 2, timedelta(seconds=self.timeout_s))
                link = self._links[pair] = Link(pg, pair[1 - me], 1 - me)
            return link

    def group(self, peer: int) -> Link:
        return self._make(_pair(self.rank, peer))


# -- frames -------------------------------------------------------------------------------
def _send_frame(group: Link, data: bytes | None) -> None:
    n = -1 if data is None else len(data)
    group.send(torch.tensor([n], dtype=torch.int64))
    if data:
        view = memoryview(data)
        for off in range(0, n, CHUNK):
            chunk = torch.frombuffer(bytearray(view[off:off + CHUNK]), dtype=torch.uint8)
            group.send(chunk)


def _send_file_frame(group: Link, path: str, size: int) -> None:
    """Send a file of ``size`` bytes as one frame (-1 when it cannot be opened, or it or its
    step directory is a link: never sent; zeros pad a file that turned out shorter, so the
    receiver's checksum, not the protocol, fails)."""
    try:
        f = open(nofollow.open_in_step(path), "rb", buffering=0)
    except OSError as exc:
        log.warning("buddy copy: cannot read %s: %s", path, exc)
        group.send(torch.tensor([-1], dtype=torch.int64))
        return
    with f:
        group.send(torch.tensor([size], dtype=torch.int64))
        buf = bytearray(min(CHUNK, max(size, 1)))
        for off in range(0, size, CHUNK):
            want = min(CHUNK, size - off)
            view = memoryview(buf)[:want]
            got = 0
            try:
                while got < want and (k := f.readinto(view[got:])):
                    got += k
            except OSError as exc:
                log.warning("buddy copy: read of %s failed: %s", path, exc)
            view[got:] = bytes(want - got)
            group.send(torch.frombuffer(buf, dtype=torch.uint8)[:want].clone())


def _recv_frame(group: Link) -> bytes | None:
    head = torch.zeros(1, dtype=torch.int64)
    group.recv(head)
    n = int(head.item())
    if n < 0:
        return None
    out = bytearray()
    for off in range(0, n, CHUNK):
        t = torch.empty(min(CHUNK, n - off), dtype=torch.uint8)
        group.recv(t)
        out += t.numpy().tobytes()
    return bytes(out)


def _recv_file_frame(group: Link, path: str, algo: str) -> tuple[str, int] | None:
    """Receive one frame into ``path`` (fsynced), returning (checksum, size); None when the
    peer had no such file. A local write failure still drains the frame, then raises."""
    head = torch.zeros(1, dtype=torch.int64)
    group.recv(head)
    n = int(head.item())
    if n < 0:
        return None
    h = Hasher(algo)
    problem: OSError | None = None
    try:  # a new file (O_EXCL|O_NOFOLLOW): a link planted under the name is not written
        f: Any = os.fdopen(nofollow.create_private(path), "wb")
    except OSError as exc:
        f, problem = None, exc
    try:
        for off in range(0, n, CHUNK):
            t = torch.empty(min(CHUNK, n - off), dtype=torch.uint8)
            group.recv(t)
            data = t.numpy().data  # a memoryview of the tensor's bytes, no copy
            h.update(data)
            if f is not None and problem is None:
                try:
                    f.write(data)
                except OSError as exc:
                    problem = exc
        if f is not None and problem is None:
            f.flush()
            os.fsync(f.fileno())
    finally:
        if f is not None:
            f.close()
    if problem is not None:
        raise problem
    return h.hexdigest(), n


# -- one pair, both directions ------------------------------------------------------------
def exchange(links: Links, peer: int, send: list[tuple[str, str, int]],
             recv: list[tuple[str, str]], algo: str) -> dict[str, tuple[str, int] | None]:
    """Send ``send`` [(name, path, size)] to ``peer`` while receiving ``recv`` [(name, tmp
    path)] from it, both in list order (each side knows the other's list). Returns what
    arrived per name: (checksum, size), or None when the peer lacked it."""
    group = links.group(peer)
    errors: list[BaseException] = []

    def sender() -> None:
        try:
            for _name, path, size in send:
                _send_file_frame(group, path, size)
        except BaseException as exc:  # re-raised on the calling thread
            errors.append(exc)

    # gloo blocks a send until the peer receives it: send on a thread, receive here
    th = threading.Thread(target=sender, name="slurmkit-buddy-send", daemon=True)
    th.start()
    got: dict[str, tuple[str, int] | None] = {}
    try:
        for name, tmp in recv:
            got[name] = _recv_file_frame(group, tmp, algo)
    finally:
        th.join()
    if errors:
        raise errors[0]
    return got


def exchange_json(links: Links, peer: int, obj: Any) -> Any:
    """Swap one small JSON value with ``peer`` (both call it)."""
    group = links.group(peer)
    out: list[Any] = []
    th = threading.Thread(target=lambda: _send_frame(group, json.dumps(obj).encode()),
                          daemon=True)
    th.start()
    try:
        data = _recv_frame(group)
        out.append(None if data is None else json.loads(data))
    finally:
        th.join()
    return out[0]


# -- the save side ------------------------------------------------------------------------
def replicate(ring: Ring, links: Links, directory: str, own: list[FileEntry],
              algo: str) -> tuple[list[FileEntry], str | None]:
    """Copy this rank's files in ``directory`` to its buddies and receive theirs into the
    same directory (this node's partial step). Returns (the entries received and verified,
    a problem or None). A shift ``j`` pairs every rank with ``r + j*L`` and ``r - j*L``."""
    received: list[FileEntry] = []
    problems: list[str] = []
    mine = [{"name": e.name, "size": e.size, "checksum": e.checksum, "rank": e.rank}
            for e in own]
    for dst, src in zip(ring.targets(), ring.sources()):
        # the header: each side's file list, so the receiver knows what follows
        theirs = _swap_headers(links, dst, src, mine)
        entries = [FileEntry(**e) for e in theirs if _plain_name(e.get("name", ""))]
        send = [(e.name, os.path.join(directory, e.name), e.size) for e in own]
        recv = [(e.name, os.path.join(directory, f".buddy-{e.name}")) for e in entries]
        got = _shift(links, dst, src, send, recv, algo)
        for e in entries:
            res = got.get(e.name)
            tmp = os.path.join(directory, f".buddy-{e.name}")
            if res is None or res != (e.checksum, e.size):
                problems.append(f"buddy copy of {e.name} from rank {src} "
                                + ("missing" if res is None else "did not verify"))
                _unlink(tmp)
                continue
            os.replace(tmp, os.path.join(directory, e.name))
            received.append(e)
    if received:
        fsync_dir(directory)
    return received, ("; ".join(problems) or None)


def _swap_headers(links: Links, dst: int, src: int, mine: list[dict[str, Any]]
                  ) -> list[dict[str, Any]]:
    if dst == src:
        return list(exchange_json(links, dst, mine) or [])
    # a shift: send to dst and receive from src at once (every rank does the same)
    with ThreadPoolExecutor(max_workers=1) as pool:
        fut = pool.submit(_send_frame, links.group(dst), json.dumps(mine).encode())
        data = _recv_frame(links.group(src))
        fut.result()
    return list(json.loads(data) if data else [])


def _shift(links: Links, dst: int, src: int, send: list[tuple[str, str, int]],
           recv: list[tuple[str, str]], algo: str) -> dict[str, tuple[str, int] | None]:
    if dst == src:
        return exchange(links, dst, send, recv, algo)
    with ThreadPoolExecutor(max_workers=1) as pool:
        group = links.group(dst)
        def send_all() -> None:
            for _, path, size in send:
                _send_file_frame(group, path, size)

        fut = pool.submit(send_all)
        sgroup = links.group(src)
        got = {name: _recv_file_frame(sgroup, tmp, algo) for name, tmp in recv}
        fut.result()
    return got


def _plain_name(name: str) -> bool:
    """A file name a peer may make us write: no directory parts, no dot-dot."""
    return bool(name) and os.path.basename(name) == name and name not in (".", "..") \
        and "\0" not in name


def _unlink(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
