"""Before a restore: bring every file this node's ranks need onto its NVMe, from its peers.

A spare that replaced a lost node starts with an empty NVMe; a node whose ranks need
replicated items that DCP put into another node's files lacks those. Both are fetched over
gloo from a node holding them (the buddy copies of buddy.py), then the ordinary restore
(restore.py) finds everything on the local tier and verifies it as usual. So a save that
never reached the shared tier is still restored after a node loss, and the spare ends up
holding its slot's files and its buddy role again.

Steps (every rank, collective):
  1. each rank reports, for the newest steps on its node, which slots' files are complete
     there and whether the manifest and ``.metadata`` are (one listing per step, gathered
     on rank 0 only);
  2. rank 0 chooses the newest step whose every slot is complete on some node;
  3. ranks lacking the manifest or ``.metadata`` get them from the nearest node holding them;
  4. each rank names the files it lacks (to rank 0): those DCP's load planner says it reads,
     plus its own and its buddy role's files; one rank per node fetches each, from a holder;
  5. received files are verified against the manifest before their final rename; the
     manifest is written last, so the step appears on the node only once complete.
Rank 0 makes both transfer plans and hands each rank only the transfers it takes part in
(coord.scatter_json), and the fetch statistics go to rank 0 only: a rank sends and receives
O(its own transfers), whatever the job size (rank 0, the planner, receives O(N) reports, as
for a save's manifest). Transfers run pair by pair in one global order of pairs, each rank
its own subset of it in that order (no cycle of waiting ranks).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from slurmkit.store.buddy import Links, Pair, Ring, _pair, _plain_name, exchange
from slurmkit.store import nofollow
from slurmkit.store.catalog import list_steps, read_manifest, step_sizes
from slurmkit.store.coord import MAX_REASON, CoordinationError, Coordinator
from slurmkit.store.manifest import (
    MANIFEST,
    METADATA,
    Manifest,
    ManifestError,
    hash_file,
    step_dir,
)
from slurmkit.store.tier import FsspecTier, TierError
from slurmkit.store.writer import tier_lock

log = logging.getLogger(__name__)
Transfer = tuple[int, int, str]  # (server rank, requester rank, file name)


def node_report(tier: FsspecTier, ring: Ring, newest: int) -> dict[str, Any]:
    """{step: {"slots": complete writer slots, "meta": manifest and .metadata here}} for the
    ``newest`` steps with a readable manifest on this node."""
    out: dict[str, Any] = {}
    try:
        steps = list_steps(tier)
    except TierError as exc:
        log.warning("cannot list %s: %s", tier.uri, exc)
        return out
    for step in steps:
        if len(out) >= newest:
            break
        try:
            m = read_manifest(tier, step)
            sizes = step_sizes(tier, step)  # (regular files only, no link followed)
        except (ManifestError, TierError):
            continue
        if m.world_size != ring.world_size:
            continue
        complete: dict[int, bool] = {}
        for f in m.files:
            if f.name == METADATA:
                continue
            s = ring.slot_of(f.rank)
            complete[s] = complete.get(s, True) and sizes.get(f.name) == f.size
        meta = next((f for f in m.files if f.name == METADATA), None)
        out[str(step)] = {"slots": sorted(s for s, ok in complete.items() if ok),
                          "meta": meta is not None and sizes.get(METADATA) == meta.size}
    return out


def choose_step(reports: list[dict[str, Any]], ring: Ring) -> int | None:
    """Newest step whose every slot is complete on some node, with a manifest somewhere."""
    steps = sorted({int(s) for r in reports for s in r}, reverse=True)
    for step in steps:
        held = {s for r in reports for s in r.get(str(step), {}).get("slots", [])}
        meta = any(r.get(str(step), {}).get("meta") for r in reports)
        if meta and held >= set(range(ring.slots)):
            return step
    return None


def _server(ring: Ring, reports: list[dict[str, Any]], requester: int, step: int,
            ok: Callable[[dict[str, Any]], bool], slots: list[int]) -> int | None:
    """The rank of the first slot in ``slots`` (not the requester's own) whose report for
    ``step`` satisfies ``ok``; the same local rank as the requester spreads the load."""
    local = requester % ring.local_world
    for s in slots:
        if s == ring.slot_of(requester):
            continue
        cand = s * ring.local_world + local
        if ok(reports[cand].get(str(step), {})):
            return cand
    return None


def plan_metadata(ring: Ring, reports: list[dict[str, Any]], step: int) -> list[Transfer]:
    """Manifest and .metadata for every rank whose node lacks them, from the nearest node
    that has them (ring order)."""
    plan: list[Transfer] = []
    for r, rep in enumerate(reports):
        if rep.get(str(step), {}).get("meta"):
            continue
        order = [(ring.slot_of(r) + j) % ring.slots for j in range(1, ring.slots)]
        srv = _server(ring, reports, r, step, lambda x: bool(x.get("meta")), order)
        if srv is not None:
            plan += [(srv, r, MANIFEST), (srv, r, METADATA)]
    return plan


def plan_files(ring: Ring, reports: list[dict[str, Any]], step: int,
               needs: list[list[list[Any]]]) -> list[Transfer]:
    """One fetch per (node, file): by the node's lowest rank that lacks it, from the first
    holder of the file's writer (its own node, then its buddies). ``needs``: per rank,
    [file name, writer rank] pairs (gathered: every rank computes the same plan)."""
    plan: list[Transfer] = []
    taken: set[tuple[int, str]] = set()
    for r, wanted in enumerate(needs):
        for name, w in wanted:
            key = (ring.slot_of(r), name)
            if key in taken or not (isinstance(w, int) and 0 <= w < ring.world_size):
                continue
            slot = ring.slot_of(w)

            def holds(x: dict[str, Any], slot: int = slot) -> bool:
                return slot in x.get("slots", [])

            srv = _server(ring, reports, r, step, holds, ring.holder_slots(w))
            if srv is not None:
                taken.add(key)
                plan.append((srv, r, name))
    return plan


def run_plan(plan: list[Transfer], links: Links, rank: int, tier: FsspecTier, step: int,
             sizes: dict[str, int], algo: str) -> dict[str, tuple[str, int] | None]:
    """Carry out the transfers this rank takes part in, pair by pair in one global order.
    Received files land under temporary names in the step directory: (name -> (checksum,
    size) or None), the caller verifies and renames."""
    pairs: dict[Pair, list[Transfer]] = {}
    for t in plan:
        pairs.setdefault(_pair(t[0], t[1]), []).append(t)
    links.ensure(p for p in pairs if rank in p)
    d = tier.local_path(step_dir(step))
    root = tier.local_path("")
    if d is None or root is None:
        raise TierError(f"{tier.uri} is not a local path")
    if nofollow.is_link(root, step_dir(step)):
        raise TierError(f"{d} is a symbolic link; a step directory must be a directory")
    os.makedirs(d, exist_ok=True)
    got: dict[str, tuple[str, int] | None] = {}
    for pair in sorted(pairs):
        if rank not in pair:
            continue
        peer = pair[1] if pair[0] == rank else pair[0]
        # a link or anything but a regular file is never read: sent as missing (no path)
        send = [(n, os.path.join(d, n) if _size(os.path.join(d, n)) >= 0 else "",
                 sizes.get(n, _size(os.path.join(d, n))))
                for s, _, n in pairs[pair] if s == rank]
        recv = [(n, os.path.join(d, f".fetch-{rank}-{n}")) for s, r, n in pairs[pair]
                if r == rank]
        got.update(exchange(links, peer, send, recv, algo))
    return got


def _size(path: str) -> int:
    """Size of the regular file ``path`` (a file of a step directory: neither it nor the
    step directory followed if a link); -1 when missing, a link or not a regular file."""
    head, name = os.path.split(path)
    root, step = os.path.split(head)
    try:
        return nofollow.size(root, f"{step}/{name}")
    except OSError:
        return -1


def _mine(plan: list[Transfer], rank: int) -> list[list[Any]]:
    return [list(t) for t in plan if rank in (t[0], t[1])]


def _own_plan(got: Any) -> list[Transfer]:
    """This rank's part of a plan from rank 0, checked (a malformed one is refused)."""
    if not isinstance(got, dict) or not isinstance(got.get("plan"), list):
        raise CoordinationError(f"malformed transfer plan from rank 0: {got!r}"[:300])
    out: list[Transfer] = []
    for t in got["plan"]:
        if not (isinstance(t, list) and len(t) == 3 and all(
                isinstance(x, int) and not isinstance(x, bool) for x in t[:2])
                and isinstance(t[2], str)):
            raise CoordinationError(f"malformed transfer from rank 0: {t!r}"[:300])
        out.append((t[0], t[1], t[2]))
    return out


def recover(template: dict[Any, Any], tier: FsspecTier, ring: Ring, links: Links,
            coord: Coordinator, emit: Callable[[dict[str, Any]], None], *,
            newest: int = 2) -> int | None:
    """Fetch what this node lacks of the newest step the job's nodes hold between them;
    returns that step (None: none, or nothing to fetch anywhere). Collective."""
    from slurmkit.store.restore import files_needed
    from slurmkit.store.safe_reader import load_metadata

    t0 = time.perf_counter()
    root = coord.rank == coord.root
    reports = coord.gather_json(node_report(tier, ring, newest))  # rank 0 only
    per_rank: list[Any] | None = None
    if root:
        assert reports is not None
        chosen = choose_step(reports, ring)
        plan = plan_metadata(ring, reports, chosen) if chosen is not None else []
        per_rank = [{"step": chosen, "plan": _mine(plan, r)} for r in range(coord.world_size)]
    first = coord.scatter_json(per_rank)
    step = first.get("step") if isinstance(first, dict) else None
    if not isinstance(step, int) or isinstance(step, bool):
        return None  # (every rank: rank 0 sent the same verdict to all)
    plan1 = _own_plan(first)
    d = tier.local_path(step_dir(step)) or ""
    problems: list[str] = []
    fetched: dict[str, int] = {}
    got = run_plan(plan1, links, ring.rank, tier, step, {}, "crc32")
    manifest_body: bytes | None = None
    m: Manifest | None = None
    if MANIFEST in got:
        tmp = os.path.join(d, f".fetch-{ring.rank}-{MANIFEST}")
        try:
            with open(tmp, "rb") as f:
                manifest_body = f.read()
            m = Manifest.from_json(manifest_body)
            if m.step != step:
                raise ManifestError(f"a peer sent the manifest of step {m.step}")
        except (OSError, ManifestError) as exc:
            problems.append(f"manifest from a peer: {exc}")
            manifest_body, m = None, None
        finally:
            _unlink(tmp)
    else:
        with contextlib.suppress(ManifestError, TierError):
            m = read_manifest(tier, step)
    if m is not None and METADATA in got:
        tmp = os.path.join(d, f".fetch-{ring.rank}-{METADATA}")
        if got[METADATA] is not None:  # sent before its manifest arrived: hash it now
            got[METADATA] = hash_file(tmp, m.checksum_algo)
        _accept(m, d, ring.rank, METADATA, got[METADATA], problems, fetched)
    need: list[str] = []
    if m is not None:
        need = _lacking(template, m, d, ring, files_needed, load_metadata, problems)
    writer = {f.name: f.rank for f in m.files} if m is not None else {}
    needs = coord.gather_json([[n, writer[n]] for n in need])  # rank 0 only
    if root:
        assert needs is not None and reports is not None
        plan = plan_files(ring, reports, step, needs)
        per_rank = [{"plan": _mine(plan, r)} for r in range(coord.world_size)]
    plan2 = _own_plan(coord.scatter_json(per_rank))
    sizes = {f.name: f.size for f in m.files} if m is not None else {}
    got = run_plan(plan2, links, ring.rank, tier, step, sizes, m.checksum_algo if m else "crc32")
    for name, res in got.items():
        if m is not None:
            _accept(m, d, ring.rank, name, res, problems, fetched)
    if manifest_body is not None and not problems:
        with tier_lock(tier):  # written last: the step now exists on this node
            if not tier.exists(f"{step_dir(step)}/{MANIFEST}"):
                tier.write_atomic(f"{step_dir(step)}/{MANIFEST}", manifest_body)
    servers = sorted({s for s, r, _ in plan1 + plan2 if r == ring.rank})
    stats = coord.gather_json({"files": len(fetched), "bytes": sum(fetched.values()),
                               "from": servers, "problem": "; ".join(problems)[:MAX_REASON]})
    if stats is not None:  # rank 0: the one event for the whole job
        moved = {r: s for r, s in enumerate(stats) if s["files"] or s["problem"]}
        if moved:
            emit({"event": "ckpt_fetched", "step": step, "tier": tier.name,
                  "seconds": round(time.perf_counter() - t0, 3),
                  "bytes": sum(s["bytes"] for s in stats),
                  "ranks": {str(r): s for r, s in moved.items()}})
    for p in problems:
        log.warning("fetching step %d from peers: %s", step, p)
    return step


def _lacking(template: dict[Any, Any], m: Manifest, d: str, ring: Ring,
             files_needed: Callable[..., set[str] | None], load_metadata: Callable[[bytes], Any],
             problems: list[str]) -> list[str]:
    """Files this rank reads (DCP's planner) or keeps (own, buddy role) that are not here."""
    role = {ring.rank, *ring.sources()}
    want = {f.name for f in m.files if f.rank in role and f.name != METADATA}
    try:
        md = load_metadata(nofollow.read_bytes(os.path.dirname(d),
                                               f"{os.path.basename(d)}/{METADATA}"))
        needed = files_needed(template, md)
    except Exception as exc:  # noqa: BLE001 - the restore itself reports a bad .metadata
        problems.append(f".metadata unreadable: {exc}")
        needed = None
    names = {f.name for f in m.files}
    want |= (needed if needed is not None else names) & names
    have = {n for n in want if _size(os.path.join(d, n)) == _entry_size(m, n)}
    return sorted(n for n in want - have if _plain_name(n))


def _entry_size(m: Manifest, name: str) -> int:
    return next((f.size for f in m.files if f.name == name), -1)


def _accept(m: Manifest, d: str, rank: int, name: str, res: tuple[str, int] | None,
            problems: list[str], fetched: dict[str, int]) -> None:
    """Rename a received file into place once it matches the manifest."""
    tmp = os.path.join(d, f".fetch-{rank}-{name}")
    entry = next((f for f in m.files if f.name == name), None)
    if entry is None or res is None:
        problems.append(f"{name}: the peer did not have it")
        _unlink(tmp)
        return
    if res != (entry.checksum, entry.size):
        problems.append(f"{name}: the received copy does not match the manifest")
        _unlink(tmp)
        return
    os.replace(tmp, os.path.join(d, name))
    fetched[name] = entry.size


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)

