"""Promotion: copy a committed step to a slower tier and commit it there.

File-based coordination, no collectives (so it cannot interleave with anything): every rank
copies the files it wrote; rank 0 then waits until every file of the manifest is present in
the destination with the right size, commits (rename where atomic), writes the manifest last,
verifies it and moves ``latest.json``. Files already present with the right size are not
copied again, so a promotion interrupted by an outage or a restart resumes where it stopped.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from slurmkit.store.catalog import check_step, write_latest
from slurmkit.store.manifest import MANIFEST, PARTIAL, FileEntry, Manifest, step_dir
from slurmkit.store.tier import Tier, TierError

log = logging.getLogger(__name__)


def staging_dir(dest: Tier, step: int) -> str:
    return f"{PARTIAL}/{step_dir(step)}.promote" if dest.renames_atomically() else step_dir(step)


def find_source(tiers: Sequence[Tier], dest: Tier, step: int, rank: int
                ) -> tuple[Tier, Manifest]:
    """The fastest tier (other than ``dest``) where ``step`` verifies for this rank's files."""
    problems = []
    for t in tiers:
        if t is dest:
            continue
        st = check_step(t, step, deep=False, files=lambda m: owned(m, rank))
        if st.ok and st.manifest is not None:
            return t, st.manifest
        problems.append(f"{t.name}: {st.problem}")
    raise TierError(f"step {step}: no source tier to promote from ({'; '.join(problems)})")


def owned(m: Manifest, rank: int, world_size: int | None = None) -> list[FileEntry]:
    """Files this rank copies: its own; rank 0 also adopts files of ranks that no longer exist."""
    ws = world_size if world_size is not None else m.world_size
    return [f for f in m.files if f.rank == rank or (rank == 0 and f.rank >= ws)]


def copy_file(src: Tier, dest: Tier, src_rel: str, dest_rel: str,
              on_bytes: Callable[[int], None] | None = None) -> None:
    """Copy one file between tiers (through a local temp file when neither side is local)."""
    local = src.local_path(src_rel)
    if local is not None:
        dest.put_file(local, dest_rel)
    else:
        with tempfile.TemporaryDirectory(prefix="slurmkit-copy-") as d:
            tmp = os.path.join(d, "f")
            src.get_file(src_rel, tmp)
            dest.put_file(tmp, dest_rel)
    if on_bytes is not None:
        on_bytes(dest.size(dest_rel))


def copy_files(src: Tier, dest: Tier, step: int, files: list[FileEntry], max_workers: int,
               on_bytes: Callable[[int], None] | None = None) -> int:
    """Copy ``files`` of ``step`` into the destination's staging dir; return bytes copied."""
    stage = staging_dir(dest, step)
    present = dest.sizes(stage)  # files copied before an outage or restart are kept
    todo = [f for f in files if present.get(f.name) != f.size]
    with ThreadPoolExecutor(max_workers=max_workers) as pool:
        futs = [pool.submit(copy_file, src, dest, f"{step_dir(step)}/{f.name}",
                            f"{stage}/{f.name}", on_bytes) for f in todo]
        for fut in futs:
            fut.result()
    return sum(f.size for f in todo)


def missing_in_staging(dest: Tier, step: int, m: Manifest) -> list[str]:
    present = dest.sizes(staging_dir(dest, step))
    return [f.name for f in m.files if present.get(f.name) != f.size]


def commit_promotion(dest: Tier, step: int, m: Manifest) -> None:
    """Rank 0: make the staged copy the committed step, manifest last, then verify + latest."""
    final = step_dir(step)
    stage = staging_dir(dest, step)
    if stage != final:
        if dest.exists(final):
            dest.rm(final, recursive=True)
        dest.commit(stage, final)
    dest.write_atomic(f"{final}/{MANIFEST}", m.with_tier(dest.name).to_json())
    st = check_step(dest, step, deep=False)
    if not st.ok:
        raise TierError(f"promoted step {step} on {dest.uri} did not verify: {st.problem}")
    write_latest(dest, step)


def wait_for_files(dest: Tier, step: int, m: Manifest, *, timeout_s: float,
                   clock: Callable[[], float], sleep: Callable[[float], None]) -> None:
    """Rank 0: poll the destination until every rank's files landed (file-based barrier)."""
    deadline = clock() + timeout_s
    delay = 0.05
    while missing := missing_in_staging(dest, step, m):
        if clock() > deadline:
            raise TierError(f"step {step} on {dest.uri}: other ranks' files did not arrive "
                            f"within {timeout_s:.0f} s (missing {missing[:3]})")
        sleep(delay)
        delay = min(delay * 2, 2.0)
