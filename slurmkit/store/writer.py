"""Persist one snapshot to the primary (fastest local) tier and commit it.

Order: DCP writes every rank's shard files into ``.partial/step_N.<token>/`` through the
sealing writer, which checksums and fsyncs each file while writing it (sealing.py); on a
node-local tier each rank then sends its files to its buddy ranks on other nodes and
receives theirs (buddy.py); rank 0 gathers the per-rank records through the writer's
coordinator (coord.py), builds the manifest and announces its digest (one rank per node
fetches the body, manifest_share.py); ``.metadata`` goes to every other node's first rank,
whose node waits for it; the files move to ``step_N``; the manifest is written last,
atomically, read back and verified (with the buddy copies this rank received); only once
every rank agreed the commit worked does ``latest.json`` move. So a committed step on NVMe survives the loss of any one
node (``store.replicas`` nodes) without the shared tier.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import logging
import os
import re
import time
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItem

from slurmkit.store import dcp_coord, nofollow
from slurmkit.store.buddy import Links, Ring, replicate
from slurmkit.store.catalog import check_step, write_latest
from slurmkit.store.coord import MAX_REASON, CoordinationError, Coordinator
from slurmkit.store.manifest import (
    MANIFEST,
    METADATA,
    PARTIAL,
    FileEntry,
    Manifest,
    ManifestError,
    hash_file,
    step_dir,
)
from slurmkit.store.manifest_share import SharedManifest, digest, pack
from slurmkit.store.sealing import SealingWriter
from slurmkit.store.staging import FillGate
from slurmkit.store.tier import FsspecTier, Tier, TierError, fsync_dir

# DCP's CheckpointException derives from BaseException, not Exception
log = logging.getLogger(__name__)
SAVE_ERRORS: tuple[type[BaseException], ...] = (Exception, CheckpointException)


@contextlib.contextmanager
def tier_lock(tier: Tier | None) -> Iterator[None]:
    """Serialise commits of the ranks that share one local directory (one node's NVMe)."""
    root = tier.local_path("") if tier is not None else None
    if root is None:
        yield
        return
    with nofollow.open_write(root, ".lock", append=True) as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)  # a link: not ours
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def own_files(directory: str, rank: int) -> list[str]:
    """The files DCP wrote for ``rank`` in ``directory`` (rank 0 also owns .metadata)."""
    pat = re.compile(rf"^__{rank}_\d+\.distcp$")
    names = [n for n in os.listdir(directory) if pat.match(n)]
    if rank == 0 and os.path.exists(os.path.join(directory, METADATA)):
        names.append(METADATA)
    return sorted(names)


def seal_files(directory: str, names: list[str], rank: int, algo: str) -> list[FileEntry]:
    """fsync and checksum files concurrently (hashlib and fsync both release the GIL)."""
    paths = [os.path.join(directory, n) for n in names]
    with ThreadPoolExecutor(max_workers=max(2, len(paths) + 1)) as pool:
        syncs = [pool.submit(_fsync, p) for p in paths]
        hashes = [pool.submit(hash_file, p, algo) for p in paths]
        for s in syncs:
            s.result()
        entries = []
        for name, h in zip(names, hashes):
            digest, size = h.result()
            entries.append(FileEntry(name=name, size=size, checksum=digest, rank=rank))
    fsync_dir(directory)
    return entries


class GatedPlanner(DefaultSavePlanner):
    """DCP's default planner, except that it hands out a tensor only once its staging copy
    is complete (planning itself needs shapes and dtypes only)."""

    def __init__(self, gate: FillGate | None) -> None:
        super().__init__()
        self._gate = gate

    def resolve_data(self, write_item: WriteItem) -> Any:
        if self._gate is not None:
            self._gate.wait(write_item.index.fqn)
        return super().resolve_data(write_item)


def sealed_entries(directory: str, names: list[str], rank: int, algo: str,
                   sealed: dict[str, tuple[str, int]]) -> list[FileEntry]:
    """Entries for ``names`` from the checksums taken while writing (files already fsynced);
    any file the sealing writer did not record is fsynced and hashed now."""
    rest = [n for n in names if n not in sealed]
    entries = {e.name: e for e in seal_files(directory, rest, rank, algo)} if rest else {}
    if not rest:
        fsync_dir(directory)  # the files' own fsyncs do not cover their directory entries
    for n in names:
        if n in sealed:
            digest, size = sealed[n]
            entries[n] = FileEntry(name=n, size=size, checksum=digest, rank=rank)
    return [entries[n] for n in names]


class PrimaryWriter:
    """Writes snapshots to one local tier; lives in the store's background save thread."""

    def __init__(self, tier: FsspecTier, coord: Coordinator, *, algo: str, write_threads: int,
                 config_hash: str, clock: Callable[[], float], token: str,
                 direct_io: bool = True, ring: Ring | None = None,
                 links: Links | None = None) -> None:
        if tier.local_path("") is None:
            raise TierError(f"primary tier {tier.uri} is not a local path")
        self.tier = tier
        self.coord = coord
        self.algo = algo
        self.write_threads = write_threads
        self.config_hash = config_hash
        self.clock = clock
        self.token = token
        self.direct_io = direct_io
        # buddy copies: only on a node-local tier, and only with a known node layout
        self.ring = ring if ring is not None and ring.enabled and links is not None else None
        self.links = links

    def write(self, step: int, seq: int, flat: dict[str, Any],
              decide: Callable[[int], list[str]], gate: FillGate | None = None) -> Manifest:
        """Write, seal, build the manifest (rank 0 decides promotions), commit. Collective.

        ``gate``: the snapshot may still be filling ``flat``; each tensor is serialized only
        once its copy finished."""
        partial = f"{PARTIAL}/{step_dir(step)}.{self.token}-{seq}"
        directory = self.tier.local_path(partial)
        root = self.tier.local_path("")
        if directory is None or root is None:
            raise TierError(f"primary tier {self.tier.uri} is not a local path")
        try:  # DCP writes below it by path: no component of it may be a link
            nofollow.make_dirs(root, partial)
        except OSError as exc:
            raise TierError(f"primary tier {self.tier.uri}: {partial}: {exc}") from exc
        writer = SealingWriter(directory, algo=self.algo, thread_count=self.write_threads,
                               direct=self.direct_io)
        dist = self.coord.distributed
        t0 = time.perf_counter()
        try:
            if dist:  # over the store's coordinator: no process group (dcp_coord.py)
                dcp_coord.save(flat, writer, GatedPlanner(gate), self.coord)
            else:
                dcp.save(flat, storage_writer=writer, planner=GatedPlanner(gate), no_dist=True)
        except SAVE_ERRORS:  # DCP raises CheckpointException on every rank; drop the partial
            self.tier.rm(partial, recursive=True)
            raise
        try:
            mine: Any = [asdict(e) for e in sealed_entries(
                directory, own_files(directory, self.coord.rank), self.coord.rank, self.algo,
                writer.sealed)]
        except OSError as exc:  # gathered below so every rank fails together, none hangs
            mine = {"error": f"{type(exc).__name__}: {exc}"}
        held = {self.coord.rank}
        if self.ring is not None:
            mine, held = self._replicate(directory, mine)
        t1 = time.perf_counter()
        # O(1) per rank: the records go to rank 0 only, which builds the manifest; the others
        # get its digest, rank 0's own record and the promotion decision (manifest_share.py)
        records = self.coord.gather_json(mine)
        body: bytes | None = None
        head: Any = None
        if self.coord.rank == 0:
            assert records is not None
            errors = [f"rank {r}: {x['error']}" for r, x in enumerate(records)
                      if isinstance(x, dict)]
            head = {"error": "; ".join(errors)[:2000]} if errors else None
            if not errors:
                files = [FileEntry(**e) for per_rank in records for e in per_rank]
                m = Manifest(step=step, world_size=self.coord.world_size, files=files,
                             checksum_algo=self.algo, config_hash=self.config_hash,
                             created_unix=self.clock(), tier=self.tier.name,
                             promote_to=decide(step))
                body = m.to_json()
                head = {"sha": digest(body), "rank0": records[0]}
        # Rank 0 reads its .metadata for the other nodes now, before the broadcast lets the
        # ranks go on: the other ranks of node 0 wait for no one before their commit, which
        # moves the partial directory's files (.metadata with them) into the step.
        meta = self._metadata_body(directory, records[0]) \
            if self.ring is not None and self.coord.rank == 0 and body is not None and records else None
        key = self.coord.publish(None if body is None else pack(body))
        head = self.coord.broadcast_json(head)
        if not isinstance(head, dict) or "error" in head:
            why = head.get("error") if isinstance(head, dict) else f"malformed: {head!r}"[:200]
            raise TierError(f"sealing step {step} on {self.tier.uri} failed: {why}")
        shared = SharedManifest(self.coord, step, key, str(head.get("sha")), body)
        meta_problem = None
        if self.ring is not None:
            meta_problem = self._spread_metadata(directory, head.get("rank0") or [], meta)
        t2 = time.perf_counter()
        # No rank may skip the agreement below (the coordinator's operations must stay in
        # step on every rank): whatever the commit raises becomes this rank's verdict.
        try:
            if meta_problem:
                raise TierError(meta_problem)
            manifest: Manifest | None = self.commit(partial, shared, held)
            problem = None
        except (OSError, TierError, ManifestError, CoordinationError) as exc:
            manifest, problem = None, f"{type(exc).__name__}: {exc}"
        # The commit is the one per-rank phase: agree on its outcome, so that a failure on one
        # rank makes every rank fail this tier together (and fall back to the next tier
        # together). A rank falling back alone would pair its next collective with the other
        # ranks' next save, mixing two steps in one checkpoint.
        ok, failed = self.coord.agree(problem is None, problem or "")
        if not ok or manifest is None:
            if manifest is not None:
                self.withdraw(manifest)
            reasons = "; ".join(f"rank {r}: {p}" if r >= 0 else p for r, p in failed)
            raise TierError(f"committing step {step} on {self.tier.uri} failed: {reasons}")
        write_latest(self.tier, manifest.step)
        log.debug("step %d on %s: write+seal %.3f s, gather %.3f s, commit %.3f s", step,
                  self.tier.name, t1 - t0, t2 - t1, time.perf_counter() - t2)
        return manifest

    def _replicate(self, directory: str, mine: Any) -> tuple[Any, set[int]]:
        """Swap files with the buddy ranks (always, so no pair waits on a failed rank);
        returns this rank's record (an error if a copy failed) and the ranks whose files
        this rank verifies at commit."""
        assert self.ring is not None and self.links is not None
        own = [FileEntry(**e) for e in mine if e["name"] != METADATA] \
            if isinstance(mine, list) else []
        try:
            got, problem = replicate(self.ring, self.links, directory, own, self.algo)
        except OSError as exc:
            got, problem = [], f"{type(exc).__name__}: {exc}"
        if problem and isinstance(mine, list):
            mine = {"error": f"buddy copy: {problem}"}
        return mine, {self.coord.rank, *(e.rank for e in got)}

    @staticmethod
    def _metadata_body(directory: str, rank0: Any) -> str | None:
        """Rank 0: its ``.metadata`` (compressed, base64) when its record names one; None when
        it names none or the file cannot be read (then no other node gets it: its commit fails)."""
        try:
            if not any(isinstance(e, dict) and e.get("name") == METADATA for e in rank0):
                return None
            with open(nofollow.open_in_step(os.path.join(directory, METADATA)), "rb") as f:
                return base64.b64encode(zlib.compress(f.read(), 6)).decode()
        except (OSError, TypeError) as exc:
            log.warning("cannot spread %s: %s", METADATA, exc)
            return None

    def _spread_metadata(self, directory: str, rank0: list[Any], body: str | None = None) -> str | None:
        """``.metadata`` (rank 0's, small) into every other node's partial directory before
        any rank of that node commits. Returns a problem (None: fine).

        Rank 0 publishes the file once; only the first rank of each other node fetches it,
        writes it and verifies it against rank 0's record, then puts its verdict under a key
        of its node; the node's other ranks wait for that key before they commit (a commit
        moves whatever the partial directory holds, and the last one removes it). So a rank
        receives the file only if it writes it, and waits only for its own node's leader:
        O(1) requests per rank, no world-wide barrier."""
        assert self.ring is not None
        ring, coord = self.ring, self.coord
        try:
            entry = next((FileEntry(**e) for e in rank0 if e.get("name") == METADATA), None)
        except (TypeError, ValueError) as exc:
            entry = None
            log.warning("cannot spread %s: %s", METADATA, exc)
        if coord.rank == 0:  # read before the broadcast (_metadata_body): none read, none spread
            if body is None:
                entry = None
        else:
            body = None
        key = coord.publish(body)  # every rank: the operation keeps the ranks in step
        ready = [f"{key}/node{s}" for s in range(1, ring.slots)]
        coord.reclaim(ready)
        if entry is None or ring.slot == 0 or not coord.distributed:
            return None
        mine = ready[ring.slot - 1]
        if ring.rank % ring.local_world:  # not the node's leader: wait for its verdict
            try:
                verdict = coord.fetch(mine)
            except CoordinationError as exc:
                return f"waiting for {METADATA} on this node: {exc}"
            return None if verdict is None else \
                f"{METADATA} on this node (its first rank): {str(verdict)[:MAX_REASON]}"
        problem = self._write_metadata(directory, entry, key)
        try:
            coord.put(mine, problem)
        except CoordinationError as exc:
            problem = problem or f"telling this node's ranks: {exc}"
        return problem

    def _write_metadata(self, directory: str, entry: FileEntry, key: str) -> str | None:
        path = os.path.join(directory, METADATA)
        try:
            wire = self.coord.fetch(key)
            if not isinstance(wire, str):
                return f"rank 0 published no {METADATA}"
            z = zlib.decompressobj()
            data = z.decompress(base64.b64decode(wire, validate=True), entry.size + 1)
            with os.fdopen(nofollow.create_private(path + ".buddy"), "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            if hash_file(path + ".buddy", self.algo) != (entry.checksum, entry.size):
                return f"the copy of {METADATA} on this node does not match rank 0's"
            os.replace(path + ".buddy", path)
            fsync_dir(directory)
        except (CoordinationError, ValueError, zlib.error) as exc:
            return f"receiving {METADATA} from rank 0: {type(exc).__name__}: {exc}"
        except OSError as exc:
            return f"writing {METADATA} on this node: {type(exc).__name__}: {exc}"
        return None

    def _verifies(self, held: set[int]) -> Callable[[Manifest], list[FileEntry]]:
        """The entries this rank checks after its commit: its own files and its buddy copies;
        the first rank of each node also its node's ``.metadata``."""
        leader = self.ring is not None and self.coord.rank % self.ring.local_world == 0
        return lambda m: [f for f in m.files if f.rank in held
                          or (leader and f.name == METADATA)]

    def commit(self, partial: str, shared: SharedManifest | Manifest,
               held: set[int] | None = None) -> Manifest:
        """Move this save's files into place and write the manifest last, then verify this
        rank's files (and the buddy copies it holds). ``latest.json`` moves only once every
        rank committed (see ``write``)."""
        final = step_dir(shared.step)
        held = held or {self.coord.rank}
        mrel = f"{final}/{MANIFEST}"
        root = self.tier.local_path("")
        with tier_lock(self.tier):
            existing = _read_rel(root, mrel)
            # this node's copy when another rank of it wrote this save's already, else the
            # body (fetched from rank 0 by one rank per node)
            if isinstance(shared, Manifest):
                body = shared.to_json()
            else:
                body = existing if shared.matches(existing) and existing is not None \
                    else shared.body()
            manifest = Manifest.from_json(body)
            if root is not None and existing not in (None, body):
                # an older save of this step (an earlier generation), or a planted link:
                # invisible first, so its manifest never names files this save is replacing
                self.tier.rm(mrel)
            if root is not None:
                # File by file, never a whole-directory swap: ranks that share this node's
                # directory each move what they find, and none can delete a file another rank
                # already moved (an older save of the same step is simply overwritten; the
                # manifest written below names exactly this save's files). A step directory
                # that is a link is refused, never written through (nofollow.py).
                try:
                    nofollow.move_all(root, partial, final)
                except OSError as exc:
                    raise TierError(f"step {shared.step} on {self.tier.uri}: moving the "
                                    f"files into {final}: {exc}") from exc
            if existing != body:
                # the other ranks of this node find it written already: rewriting it would
                # only make a temporary file appear and vanish under their verification
                self.tier.write_atomic(f"{final}/{MANIFEST}", body)
        status = check_step(self.tier, manifest.step, deep=False, files=self._verifies(held))
        if not status.ok:
            raise TierError(f"step {manifest.step} on {self.tier.uri} did not verify after "
                            f"commit: {status.problem}")
        return manifest

    def withdraw(self, manifest: Manifest) -> None:
        """Make this save invisible on this node again (another rank failed to commit it):
        its manifest is removed unless it was since replaced by a different save's."""
        rel = f"{step_dir(manifest.step)}/{MANIFEST}"
        root = self.tier.local_path("")
        with tier_lock(self.tier):
            if _read_rel(root, rel) == manifest.to_json():
                self.tier.rm(rel)
                log.warning("withdrew step %d on %s: not every rank committed it",
                            manifest.step, self.tier.uri)


def _read_rel(root: str | None, rel: str) -> bytes | None:
    """A local tier's file, read without following a link (a link reads as ``b""``)."""
    return None if root is None else nofollow.read_or_none(root, rel)
