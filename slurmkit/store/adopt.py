"""A program's own DCP checkpoints taken into the tiered store (``store.adopt=true``).

torchtitan (or any program whose saves are DCP directories: ``.metadata`` and one
``__R_K.distcp`` per writing rank R) saves where it likes. Adopted, every finished save is
copied from the program's folder into the store's slower tiers, verified there, committed by
a manifest and thinned by the tiers' retention, exactly as the store's own promotions are
(slurmkit.store.promote: staging prefix per save, checked copies, acknowledgements, the
manifest last). At a generation's start the newest committed copy is put back where the
program looks for it, file by file, wherever the program's own copy is missing or no longer
the bytes that were adopted.

Who does what (the agents; nothing runs in the ranks):

* **Node 0** sees the save finished (its adapter's folder scan) and names it: the step, a save
  id, the tiers it goes to (:class:`Notice`).
* **Every node** copies the files its own ranks wrote (``__R_K.distcp`` for R among them;
  node 0 also ``.metadata``), hashing each once, to every named tier; then writes one
  acknowledgement per tier listing its files (:func:`offer`). Per node and save: its ranks'
  bytes, one small file per tier; no listing of the staging prefix.
* **Node 0** commits a tier once every training slot acknowledged (:func:`commit`): the
  manifest is the union of the acknowledgements (it reads one file per node: the same
  O(N) rank 0 reads for the store's own saves).
* **Put back** (:func:`put_back`): every node, before its ranks start, compares its ranks'
  files of the newest committed step with the manifest (size, then checksum; a file this
  node verified before and that is unchanged since is not hashed again) and fetches from the
  fastest tier that verifies whatever is missing or damaged. Node 0 does ``.metadata``. No
  rank loads before every node's ranks started (they meet in the program's rendezvous
  first), so every node's part is back before any rank reads.

The program's folder is the program's: read as untrusted (names checked, no link
followed, bounded), and only a step the program itself finished is adopted. slurmkit never
loads an adopted step; the manifest marks it (``origin``) so that slurmkit's own restore
leaves it alone, and its verification is by checksum: the program reads DCP's pickled index
itself, as it would without slurmkit.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field

from slurmkit.store import nofollow
from slurmkit.store.catalog import read_latest, read_manifest
from slurmkit.store.manifest import (
    METADATA,
    FileEntry,
    Manifest,
    ManifestError,
    check_name,
    hash_file,
)
from slurmkit.store.promote import acks_dir, commit_promotion, staging_dir, verify_copy
from slurmkit.store.tier import Tier, TierError

log = logging.getLogger(__name__)

DISTCP = re.compile(r"__(\d{1,7})_(\d{1,7})\.distcp", re.ASCII)
ORIGIN = "program:"  # a manifest's origin: program:<adapter>
MAX_STEP_FILES = 1 << 16  # directory entries one step may hold (a save has ranks x threads)
_ACK = re.compile(r"slot_(\d{1,7})\.json", re.ASCII)
_MAX_ACK_BYTES = 8 << 20


class AdoptError(TierError):
    """A save cannot be adopted (or put back) as asked; the message says what was found."""


@dataclass
class Notice:
    """Node 0's word that the program finished a save: what every node copies, and where."""

    step: int
    sid: str  # names this save (same step saved again: another id)
    created: float  # when node 0 saw it (the manifest's created_unix)
    tiers: list[str]  # names of the tiers it goes to, slowest last
    world_size: int
    slots: int  # training slots that acknowledge
    algo: str
    origin: str = ORIGIN

    def to_json(self) -> dict[str, object]:
        return asdict(self)

    @staticmethod
    def from_json(raw: object) -> Notice:
        """A notice from the agents' store (sealed there; still checked field by field)."""
        if not isinstance(raw, dict):
            raise AdoptError(f"adopt notice is a {type(raw).__name__}")
        try:
            n = Notice(step=raw["step"], sid=raw["sid"], created=raw["created"], tiers=list(raw["tiers"]),
                       world_size=raw["world_size"], slots=raw["slots"], algo=raw["algo"],
                       origin=raw.get("origin", ORIGIN))
        except (KeyError, TypeError) as exc:
            raise AdoptError(f"adopt notice lacks {exc}") from None
        ints = (n.step, n.world_size, n.slots)
        if (not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in ints)
                or not isinstance(n.sid, str) or not re.fullmatch(r"[0-9a-f]{16}", n.sid)
                or not isinstance(n.created, (int, float)) or not all(isinstance(t, str) for t in n.tiers)
                or n.algo not in ("crc32", "sha256") or not isinstance(n.origin, str)
                or not n.origin.startswith(ORIGIN)):
            raise AdoptError(f"malformed adopt notice {str(raw)[:300]}")
        return n


def save_id(step: int, metadata_checksum: str, created: float) -> str:
    """One save of ``step``: its ``.metadata`` bytes and when it was seen."""
    return hashlib.sha256(f"{step}\n{metadata_checksum}\n{created!r}".encode()).hexdigest()[:16]


def writer_rank(name: str) -> int | None:
    """The rank that wrote a DCP file name (``__R_K.distcp``), 0 for ``.metadata``, else None."""
    if name == METADATA:
        return 0
    m = DISTCP.fullmatch(name)
    return int(m.group(1)) if m else None


def step_files(step_path: str) -> list[str]:
    """The DCP files of a finished save in the program's folder (names checked, links left
    out); AdoptError where it holds anything else a put-back could not restore."""
    parent, name = os.path.split(step_path.rstrip("/"))
    try:
        names = nofollow.listdir(parent or ".", name)
    except OSError as exc:
        raise AdoptError(f"cannot list the program's save {step_path}: {exc}") from exc
    if len(names) > MAX_STEP_FILES:
        raise AdoptError(f"the program's save {step_path} holds {len(names)} entries (at most {MAX_STEP_FILES})")
    other = [n for n in names if writer_rank(n) is None]
    if other:
        raise AdoptError(f"the program's save {step_path} holds {other[:3]!r}, not DCP's .metadata and "
                         "__R_K.distcp files: store.adopt takes DCP saves only")
    if METADATA not in names:
        raise AdoptError(f"the program's save {step_path} has no {METADATA} (not finished)")
    return names


def own(names: Iterable[str], ranks: set[int], *, metadata: bool) -> list[str]:
    """The names among ``names`` this node copies: its ranks' files, ``.metadata`` on node 0."""
    return sorted(n for n in names if (n == METADATA and metadata) or (n != METADATA and writer_rank(n) in ranks))


def hash_entries(step_path: str, names: Sequence[str], algo: str) -> list[FileEntry]:
    """Checksum and size of each named file of the save (opened without following a link)."""
    out = []
    for n in names:
        check_name(n)
        digest, size = hash_file(n, algo, root=step_path)
        rank = writer_rank(n)
        assert rank is not None  # noqa: S101 - own() chose DCP names only
        out.append(FileEntry(n, size, digest, rank))
    return out


def _ack_name(slot: int) -> str:
    return f"slot_{slot}.json"


def refuse(dest: Tier, notice: Notice, slot: int, problem: str) -> None:
    """This slot's acknowledgement that it cannot deliver its files (rank 0's agent then gives
    the save up on ``dest``, by name, instead of waiting out the timeout)."""
    body = {"slot": slot, "ok": False, "problem": problem[:500]}
    dest.write_atomic(f"{acks_dir(notice.step, notice.sid)}/{_ack_name(slot)}", json.dumps(body).encode())


def offer(dest: Tier, step_path: str, notice: Notice, entries: Sequence[FileEntry], slot: int) -> int:
    """This node's files of the save into ``dest``'s staging prefix, each checked there
    after the copy; then its acknowledgement. Returns the bytes copied. A failure is
    acknowledged as such (node 0 then gives the save up on that tier) and raised."""
    stage = staging_dir(notice.step, notice.sid)
    ack = f"{acks_dir(notice.step, notice.sid)}/{_ack_name(slot)}"
    copied = 0
    try:
        for e in entries:
            rel = f"{stage}/{e.name}"
            if dest.exists(rel) and verify_copy(dest, rel, e, notice.algo) is None:
                continue
            fd = nofollow.open_fd(step_path, e.name)
            try:
                dest.put_file(f"/proc/self/fd/{fd}", rel)
            finally:
                os.close(fd)
            bad = verify_copy(dest, rel, e, notice.algo)
            if bad is not None:
                dest.rm(rel)
                raise AdoptError(f"step {notice.step}: {bad} (the program rewrote it while it was copied?)")
            copied += e.size
    except (OSError, TierError) as exc:
        refuse(dest, notice, slot, str(exc))
        raise AdoptError(f"slot {slot}'s files of step {notice.step} did not reach {dest.name}: {exc}") from exc
    body = {"slot": slot, "ok": True, "files": [asdict(e) for e in entries]}
    dest.write_atomic(ack, json.dumps(body).encode())
    return copied


@dataclass
class Acks:
    """What the slots acknowledged on one tier: their files, or why they could not."""

    files: dict[int, list[FileEntry]] = field(default_factory=dict)
    refused: dict[int, str] = field(default_factory=dict)

    def complete(self, slots: int) -> bool:
        return all(s in self.files or s in self.refused for s in range(slots))


def read_acks(dest: Tier, notice: Notice) -> Acks:
    """One listing of the acknowledgements, one read of each not read before."""
    d = acks_dir(notice.step, notice.sid)
    out = Acks()
    for name in dest.ls(d):
        m = _ACK.fullmatch(name)
        if m is None or int(m.group(1)) >= notice.slots:
            continue
        slot = int(m.group(1))
        try:
            with dest.open(f"{d}/{name}", "rb") as f:
                body = json.loads(f.read(_MAX_ACK_BYTES))
            if not body.get("ok"):
                out.refused[slot] = str(body.get("problem") or "refused")[:500]
                continue
            files = []
            for raw in body["files"]:
                e = FileEntry(**raw)
                check_name(e.name)
                if writer_rank(e.name) != e.rank or not isinstance(e.size, int) or not isinstance(e.checksum, str):
                    raise ValueError(f"entry {e.name!r} names rank {e.rank!r}")
                files.append(e)
            out.files[slot] = files
        except (TierError, OSError, ValueError, TypeError, KeyError, AttributeError, ManifestError) as exc:
            out.refused[slot] = f"unreadable acknowledgement {name}: {exc}"[:500]
    return out


def wait_acks(dest: Tier, notice: Notice, timeout_s: float, *, poll_s: float = 0.5,
              superseded: Callable[[], bool] = lambda: False,
              clock: Callable[[], float] = time.monotonic,
              sleep: Callable[[float], None] = time.sleep) -> Acks:
    """Node 0: the acknowledgements once every slot gave one, or what came by the timeout
    (or by the time a newer save superseded this one)."""
    end = clock() + timeout_s
    while True:
        acks = read_acks(dest, notice)
        if acks.complete(notice.slots) or clock() >= end or superseded():
            return acks
        sleep(poll_s)


def commit(dest: Tier, notice: Notice, acks: Acks) -> Manifest:
    """Node 0: the staged save becomes step N on ``dest``: manifest last, then latest.json.
    AdoptError when a slot refused or never answered, or the union is not one whole save."""
    missing = [s for s in range(notice.slots) if s not in acks.files]
    if missing:
        why = "; ".join(f"slot {s}: {acks.refused.get(s, 'no acknowledgement')}" for s in missing[:3])
        raise AdoptError(f"step {notice.step} on {dest.name}: {why}")
    files = sorted((e for es in acks.files.values() for e in es), key=lambda e: e.name)
    names = [e.name for e in files]
    if len(set(names)) != len(names) or METADATA not in names:
        raise AdoptError(f"step {notice.step} on {dest.name}: the acknowledged files are not one save "
                         f"({len(names)} files, {len(set(names))} names, .metadata {'in' if METADATA in names else 'missing'})")
    m = Manifest(step=notice.step, world_size=notice.world_size, files=files, checksum_algo=notice.algo,
                 created_unix=notice.created, tier=dest.name, origin=notice.origin)
    commit_promotion(dest, m, sid=notice.sid)
    return m


def newest(tiers: Sequence[Tier]) -> Manifest | None:
    """The newest adopted save of the fastest tier that has one (the shared tier takes every
    save, so a slower one is read only when it has none: two small reads per node and
    generation, none on the object store in the common case); None when no tier has one."""
    for t in tiers:
        step = read_latest(t)
        if step is None:
            continue
        try:
            m = read_manifest(t, step)
        except (ManifestError, TierError, OSError) as exc:
            log.warning("adopted step %d on %s unreadable: %s", step, t.uri, exc)
            continue
        if m.origin.startswith(ORIGIN):
            return m
    return None


@dataclass
class PutBack:
    """What one node's put-back found and did."""

    step: int | None = None  # the adopted step it compared against (None: nothing adopted)
    fetched: list[str] = field(default_factory=list)  # file names fetched
    damaged: list[str] = field(default_factory=list)  # present but not the adopted bytes
    tier: str = ""  # where they came from
    bytes: int = 0
    skipped: str = ""  # why nothing was compared


#: Files this process verified in the program's folder: (path) -> (size, mtime_ns, inode, checksum).
Verified = dict[str, tuple[int, int, int, str]]


def _unchanged(verified: Verified, path: str, e: FileEntry) -> bool:
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    return verified.get(path) == (st.st_size, st.st_mtime_ns, st.st_ino, e.checksum)


def _remember(verified: Verified, path: str, e: FileEntry) -> None:
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return
    verified[path] = (st.st_size, st.st_mtime_ns, st.st_ino, e.checksum)


def put_back(tiers: Sequence[Tier], folder: str, step_name: Callable[[int], str], program_newest: int | None,
             ranks: set[int], *, metadata: bool, verified: Verified) -> PutBack:
    """Make this node's part of the newest adopted save whole in the program's ``folder``
    (``step_name(step)`` the save's directory there). Nothing is done where the program
    already has a newer finished save of its own (it resumes from that one)."""
    m = newest(tiers)
    if m is None:
        return PutBack(skipped="no adopted save on any tier")
    out = PutBack(step=m.step)
    if program_newest is not None and program_newest > m.step:
        out.skipped = f"the program's own save of step {program_newest} is newer"
        return out
    step_path = os.path.join(folder, step_name(m.step))
    mine = [e for e in m.files if (e.name == METADATA and metadata) or (e.name != METADATA and e.rank in ranks)]
    # .metadata last: the save counts as finished for the program once it is there
    mine.sort(key=lambda e: e.name == METADATA)
    for e in mine:
        path = os.path.join(step_path, e.name)
        if _unchanged(verified, path, e):
            continue
        try:
            digest, size = hash_file(e.name, m.checksum_algo, root=step_path)
            if (digest, size) == (e.checksum, e.size):
                _remember(verified, path, e)
                continue
            out.damaged.append(e.name)
        except FileNotFoundError:
            pass
        except OSError as exc:  # a link, a FIFO, an unreadable file: replaced all the same
            out.damaged.append(e.name)
            log.warning("the program's %s: %s", path, exc)
        out.bytes += _fetch(tiers, m, e, folder, step_name(m.step), out)
        _remember(verified, path, e)
        out.fetched.append(e.name)
    return out


def _fetch(tiers: Sequence[Tier], m: Manifest, e: FileEntry, folder: str, step_rel: str, out: PutBack) -> int:
    """One file of the adopted save from the fastest tier whose copy is the manifest's bytes
    (checksum and size, checked while it is received), into place: a temporary name first,
    then renamed over the program's copy."""
    from slurmkit.store.manifest import step_dir

    problems = []
    nofollow.make_dirs(folder, step_rel)
    tmp = f"{step_rel}/.{e.name}.slurmkit-put-back"
    for t in tiers:
        local = os.path.join(folder, tmp)
        nofollow.remove(folder, tmp)  # a leftover, or a link planted there: removed, never written through
        try:
            digest, size = t.get_file_hashed(f"{step_dir(m.step)}/{e.name}", local, m.checksum_algo, e.size)
        except (TierError, OSError) as exc:
            problems.append(f"{t.name}: {exc}")
            continue
        if (digest, size) != (e.checksum, e.size):
            problems.append(f"{t.name}: its copy is not the adopted bytes (another save, or damaged)")
            nofollow.remove(folder, tmp)
            continue
        nofollow.rename(folder, tmp, f"{step_rel}/{e.name}")
        out.tier = out.tier or t.name
        return size
    raise AdoptError(f"adopted step {m.step}: no tier holds a verified {e.name} ({'; '.join(problems)})")


def retain(dest: Tier, keep: int) -> list[int]:
    """Retention on ``dest`` for adopted saves: ``keep`` newest committed steps stay. Their
    manifests were written only after every file was checked on ``dest`` (offer), so they
    count as verified without reading the bytes back."""
    from slurmkit.store.catalog import check_step
    from slurmkit.store.retention import gc_tier

    return gc_tier(dest, max(1, keep), set(), verified=lambda s: check_step(dest, s, deep=False).ok)


__all__ = ["AdoptError", "Acks", "Notice", "PutBack", "commit", "hash_entries", "newest", "offer", "own",
           "put_back", "read_acks", "refuse", "retain", "save_id", "step_files", "wait_acks", "writer_rank"]
