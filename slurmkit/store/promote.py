"""Promotion: copy one committed save to a slower tier, verify it there, commit it.

File-based coordination, no collectives (so it cannot interleave with anything):

  * the staging prefix is unique per save (``.partial/step_N.promote-<save id>``, the id a
    hash of the manifest's contents), so two saves of one step never share files and a
    leftover of another save is never mistaken for a copy of this one;
  * every rank copies the files it wrote, each from the fastest tier where that file
    deep-verifies against the manifest (checksum, not size), and compares the checksum on
    the destination after the copy (the server's CRC32 where it returns one for the whole
    object, else the bytes read back); a file already in the staging prefix is kept only
    when its destination checksum matches, never on its size;
  * each rank then writes an acknowledgement (or the reason it cannot deliver) next to the
    staging prefix; rank 0 waits for all of them, moves the staged files into ``step_N``,
    writes the manifest last and moves ``latest.json``.

So a manifest on a slower tier is only ever written once every file it names verified on
that tier: there, "committed" means "deep-verified when it was copied".
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from slurmkit.store import nofollow
from slurmkit.store.catalog import (
    check_file,
    check_metadata,
    check_step,
    read_manifest,
    write_latest,
)
from slurmkit.store.manifest import (
    MANIFEST,
    METADATA,
    PARTIAL,
    FileEntry,
    Manifest,
    ManifestError,
    step_dir,
)
from slurmkit.store.tier import Tier, TierError

log = logging.getLogger(__name__)
ACKS = "acks"


class SourceError(TierError):
    """No tier holds a copy of a file that verifies: retrying cannot help (the save is bad)."""


def save_id(m: Manifest) -> str:
    """Names one save of one step: equal for the same save on every tier, different for a
    re-save of the step (other bytes or another write time)."""
    body = json.dumps([m.step, m.created_unix, m.checksum_algo,
                       sorted((f.name, f.size, f.checksum) for f in m.files)])
    return hashlib.sha256(body.encode()).hexdigest()[:16]


def staging_dir(step: int, sid: str) -> str:
    return f"{PARTIAL}/{step_dir(step)}.promote-{sid}"


def acks_dir(step: int, sid: str) -> str:
    return f"{staging_dir(step, sid)}.{ACKS}"


def owned(m: Manifest, rank: int, world_size: int | None = None) -> list[FileEntry]:
    """Files this rank copies: its own; rank 0 also adopts files of ranks that no longer exist."""
    ws = world_size if world_size is not None else m.world_size
    return [f for f in m.files if f.rank == rank or (rank == 0 and f.rank >= ws)]


def copiers(m: Manifest, world_size: int) -> set[int]:
    """The ranks that must acknowledge a promotion of ``m`` in a world of ``world_size``."""
    return {f.rank if f.rank < world_size else 0 for f in m.files}


def same_save(tier: Tier, step: int, sid: str) -> bool:
    """``tier`` holds a committed manifest of exactly this save of ``step``."""
    try:
        return save_id(read_manifest(tier, step)) == sid
    except (ManifestError, TierError):
        return False


def holders(tiers: Sequence[Tier], dest: Tier, m: Manifest) -> list[Tier]:
    """The tiers (fastest first, not ``dest``) whose manifest of the step is this save."""
    sid = save_id(m)
    return [t for t in tiers if t is not dest and same_save(t, m.step, sid)]


def copy_file(src: Tier, dest: Tier, src_rel: str, dest_rel: str) -> None:
    """Copy one file between tiers (through a local temp file when neither side is local).

    A local source is opened once without following a link and copied from that descriptor
    (through its /proc/self/fd name, which every tier's put_file can open): a file swapped
    for a link after it verified is refused, never read."""
    root = src.local_path("")
    if root is not None:
        try:
            fd = nofollow.open_fd(root, src_rel)
        except OSError as exc:
            raise TierError(f"{src.name} tier: {src_rel!r} cannot be read: {exc}") from exc
        try:
            dest.put_file(f"/proc/self/fd/{fd}", dest_rel)
        finally:
            os.close(fd)
        return
    with tempfile.TemporaryDirectory(prefix="slurmkit-copy-") as d:
        tmp = os.path.join(d, "f")
        src.get_file(src_rel, tmp)
        dest.put_file(tmp, dest_rel)


def verify_copy(dest: Tier, rel: str, e: FileEntry, algo: str) -> str | None:
    """Why the copy of ``e`` at ``rel`` on ``dest`` is not the manifest's bytes (or None)."""
    try:
        size = dest.size(rel)
        if size != e.size:
            return f"{e.name} on {dest.name} has {size} bytes, manifest says {e.size}"
        if dest.checksum(rel, algo) != e.checksum:
            return f"checksum mismatch in {e.name} on {dest.name} after the copy"
    except (TierError, OSError) as exc:
        return f"{e.name} on {dest.name}: {exc}"
    return None


def promote_file(sources: Sequence[Tier], dest: Tier, step: int, e: FileEntry, algo: str,
                 stage: str, manifest: Manifest | None = None) -> int:
    """Put a verified copy of ``e`` into ``stage`` on ``dest``; return the bytes copied.

    A file already staged (an interrupted attempt of this very save) is kept only when its
    checksum on the destination matches the manifest. The source is the fastest tier where
    the file deep-verifies (for ``.metadata``: and restore's reader accepts it, checked
    against ``manifest``); every copy is checked on the destination."""
    rel = f"{stage}/{e.name}"
    if dest.exists(rel) and verify_copy(dest, rel, e, algo) is None:
        return 0
    problems = []
    for src in sources:
        bad = check_file(src, step, e, algo, deep=True)
        if bad is None and e.name == METADATA:  # restore's reader must accept it, too
            bad = check_metadata(src, step, manifest) if manifest is not None else None
        if bad is not None:
            problems.append(f"{src.name}: {bad}")
            continue
        copy_file(src, dest, f"{step_dir(step)}/{e.name}", rel)
        bad = verify_copy(dest, rel, e, algo)
        if bad is None:
            return e.size
        dest.rm(rel)
        raise TierError(f"step {step}: {bad}")  # retried: the source verified, the copy did not
    raise SourceError(f"step {step}: no tier holds a verified {e.name} "
                      f"({'; '.join(problems) or 'no tier holds this save'})")


def copy_files(sources: Sequence[Tier], dest: Tier, m: Manifest, files: list[FileEntry],
               max_workers: int, on_bytes: Callable[[int], None] | None = None) -> int:
    """Verified copies of ``files`` of save ``m`` into its staging prefix; bytes copied.

    Requests per file, never a listing of the staging prefix (which holds every rank's
    files: listing it on every rank would grow with the square of the job)."""
    stage = staging_dir(m.step, save_id(m))

    def one(e: FileEntry) -> int:
        n = promote_file(sources, dest, m.step, e, m.checksum_algo, stage, m)
        if on_bytes is not None:
            on_bytes(e.size)
        return n

    with ThreadPoolExecutor(max_workers=max(1, max_workers)) as pool:
        return sum(pool.map(one, files))


def write_ack(dest: Tier, m: Manifest, rank: int, problem: str | None = None) -> None:
    """This rank's part of the promotion is verified on ``dest`` (or cannot be: ``problem``)."""
    body = json.dumps({"rank": rank, "ok": problem is None, "problem": problem})
    dest.write_atomic(f"{acks_dir(m.step, save_id(m))}/rank_{rank}.json", body.encode())


def has_ack(dest: Tier, m: Manifest, rank: int) -> bool:
    return dest.exists(f"{acks_dir(m.step, save_id(m))}/rank_{rank}.json")


def read_acks(dest: Tier, m: Manifest) -> dict[int, str | None]:
    """rank -> None (delivered, verified) or the reason it cannot deliver; one listing, then
    one read per refusal only."""
    d = acks_dir(m.step, save_id(m))
    acks: dict[int, str | None] = {}
    for name in dest.ls(d):
        if not (name.startswith("rank_") and name.endswith(".json")):
            continue
        try:
            rank = int(name[5:-5])
        except ValueError:
            continue
        acks[rank] = None
    for rank in list(acks):
        try:
            with dest.open(f"{d}/rank_{rank}.json", "rb") as f:
                body = json.loads(f.read())
            if not body.get("ok", False):
                acks[rank] = str(body.get("problem") or "refused")[:500]
        except (TierError, ValueError, TypeError) as exc:
            acks[rank] = f"unreadable acknowledgement: {exc}"
    return acks


def commit_promotion(dest: Tier, m: Manifest, sid: str | None = None) -> None:
    """Rank 0: make the staged save the committed step, manifest last, then latest.json.

    An older save of the step on ``dest`` is made invisible (manifest first) before its
    files are replaced. ``sid``: the save's staging id where it is not the manifest's own
    (an adopted save is staged before its manifest exists: slurmkit.store.adopt)."""
    step, sid = m.step, sid or save_id(m)
    final, stage = step_dir(step), staging_dir(step, sid)
    present = dest.sizes(stage)
    missing = [f.name for f in m.files if present.get(f.name) != f.size]
    if missing:
        raise TierError(f"step {step} on {dest.uri}: staged copy lacks {missing[:3]}")
    if dest.exists(final):
        dest.rm(f"{final}/{MANIFEST}")
        dest.rm(final, recursive=True)
    dest.commit(stage, final)
    dest.write_atomic(f"{final}/{MANIFEST}", m.with_tier(dest.name).to_json())
    st = check_step(dest, step, deep=False)
    if not st.ok:
        raise TierError(f"promoted step {step} on {dest.uri} did not verify: {st.problem}")
    write_latest(dest, step)
    dest.rm(acks_dir(step, sid), recursive=True)


def promote_step(sources: Sequence[Tier], dest: Tier, m: Manifest, max_workers: int = 4,
                 on_bytes: Callable[[int], None] | None = None) -> int:
    """One process promotes a whole save (the CLI): verified copies of every file, commit."""
    n = copy_files(sources, dest, m, m.files, max_workers, on_bytes)
    commit_promotion(dest, m)
    return n
