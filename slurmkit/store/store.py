"""CheckpointStore: the API the trainer and the supervisor call.

Threads of one rank: the training thread (``save`` snapshots and returns), one background
writer (DCP to the primary tier, commit), one promoter (slower tiers, retention). With
``overlap_snapshot`` the writer starts with the snapshot and serializes a tensor as soon as
its staging copy is done (staging.FillGate). A save's handle resolves at the commit; queueing its promotions and
retention follow on the writer thread (``wait()`` covers both). With a
process group, the store holds two coordinators made at init (a collective call on every
rank), each one connection to the job's rendezvous store (coord.py; O(1) per rank, no
world-sized group): one for the writer, one for the training thread's decisions and for
restore; and,
with more than one node, a 2-rank gloo group per buddy pair (buddy.py) for the copies of
each node's files on its ring neighbours and for a spare's fetch before a restore.
"""

from __future__ import annotations

import logging
import os
import secrets
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from slurmkit.errors import ConfigError, SlurmkitError
from slurmkit.store import nofollow
from slurmkit.store.catalog import VerifiedCache, check_step, list_steps, read_manifest
from slurmkit.store.config import StoreConfig, store_env
from slurmkit.store.buddy import Links, Ring
from slurmkit.store.coord import Coordinator, coord_secret, coordinators, side_store
from slurmkit.store.manifest import Manifest, ManifestError, step_dir
from slurmkit.store.promote import save_id
from slurmkit.store.promoter import Promoter, error_fields, withdraw_step
from slurmkit.store.recovery import recover
from slurmkit.store.restore import RestoreResult, restore_newest
from slurmkit.store.retention import gc_tier
from slurmkit.store.staging import FillGate, StagingBuffers, fill
from slurmkit.store.tier import FsspecTier, Tier, TierError, expand_env, make_tier
from slurmkit.store.writer import SAVE_ERRORS, PrimaryWriter, tier_lock

log = logging.getLogger(__name__)
Event = dict[str, Any]
NODE_TIERS = ("nvme", "scratch")  # tiers that are one node's own directory
SHARED_TIERS = ("lustre", "object")  # every node reads them


class SaveHandle:
    """The future of one save. ``blocking_s``: seconds save() held the training thread."""

    def __init__(self, step: int, future: Future[Manifest | None] | None, blocking_s: float,
                 skipped: bool = False) -> None:
        self.step = step
        self.blocking_s = blocking_s
        self.skipped = skipped
        self._future = future

    def done(self) -> bool:
        return self._future is None or self._future.done()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the primary-tier commit. True: committed; False: skipped or failed (the
        failure was reported as a ``ckpt_failed`` event). Raises TimeoutError on timeout."""
        if self._future is None:
            return False
        return self._future.result(timeout) is not None


class CheckpointStore:
    def __init__(self, cfg: StoreConfig, tiers: list[FsspecTier], primary: FsspecTier, *,
                 rank: int, world_size: int, node: str, config_hash: str,
                 on_event: Callable[[Event], None] | None, fg: Coordinator, bg: Coordinator,
                 token: str, clock: Callable[[], float], sleep: Callable[[float], None],
                 ring: Ring | None = None, links: Links | None = None) -> None:
        self.cfg = cfg
        self.tiers = tiers  # restorable tiers, fastest first
        self.primary = primary
        self.rank, self.world_size, self.node = rank, world_size, node
        self.fg, self.bg = fg, bg
        self.ring, self.links = ring, links
        self.clock = clock
        self._on_event = on_event
        self._staging = StagingBuffers()
        # the primary first; other local tiers take over when it fails (e.g. a full NVMe)
        local = [primary] + [t for t in tiers if t is not primary and t.local_path("")]
        # buddy copies only where a tier is one node's own (the shared tiers hold every file)
        self._writers = [PrimaryWriter(t, bg, algo=cfg.checksum, write_threads=cfg.write_threads,
                                       config_hash=config_hash, clock=clock, token=token,
                                       direct_io=cfg.direct_io,
                                       ring=ring if t.name in NODE_TIERS else None, links=links)
                         for t in local]
        self._shared_steps: set[int] = set()  # saves that must reach the shared tier
        self._final_steps: set[int] = set()  # saves that must reach every slower tier
        self._writer = self._writers[0]
        self._decided: dict[int, list[str]] = {}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="slurmkit-ckpt")
        self._inflight: SaveHandle | None = None
        self._job: Future[None] | None = None  # the background job of the in-flight save
        self._saves = 0
        self._last_object = clock()
        self._closed = False
        self._lock = threading.Lock()
        # what is due for promotion is read from the manifests on the tiers (no queue file):
        # whatever nodes this job runs on, the promoter finds the newest due save there
        self._verified = VerifiedCache()
        self._promoter = Promoter(
            primary=primary, tiers=tiers, rank=rank, world_size=world_size,
            emit=self._emit, gc=self._gc, verified=self._verified,
            retry_attempts=cfg.retry_attempts,
            retry_initial_s=cfg.retry_initial_s, retry_max_s=cfg.retry_max_s,
            retry_pending_s=cfg.retry_pending_s, commit_timeout_s=cfg.commit_timeout_s,
            max_workers=cfg.max_concurrent_copies,
            stagger_delay_s=(rank % cfg.stagger_slots) * cfg.stagger_s, clock=clock, sleep=sleep,
            withdraw=lambda t, m: withdraw_step(t, m, tier_lock))

    @classmethod
    def from_config(cls, cfg: StoreConfig, *, rank: int, world_size: int, node: str,
                    env: Mapping[str, str], config_hash: str = "",
                    on_event: Callable[[Event], None] | None = None,
                    clock: Callable[[], float] = time.time,
                    sleep: Callable[[float], None] = time.sleep) -> CheckpointStore:
        """Build the store. With world_size > 1 every rank must call this (it makes groups).

        ``env["LOCAL_WORLD_SIZE"]`` (ranks per node, set by the node agent) enables the buddy
        copies of ``store.replicas``; without it the node layout is unknown and they are off."""
        env = store_env(cfg, env)  # + $SLURMKIT_RUN_ID: the run, not the job, names the tiers
        fg, bg = _coordinators(rank, world_size, cfg.coord_timeout_s,
                               coord_secret(env) if world_size > 1 else None)
        ring = Ring(rank, world_size, int(env.get("LOCAL_WORLD_SIZE") or 0), cfg.replicas)
        links = Links(rank)
        if ring.enabled and world_size > 1:
            if not _dist_ready():  # the pair groups are gloo groups of the job's process group
                raise ConfigError(
                    detected=f"store.replicas={cfg.replicas} (buddy copies) on {ring.slots} "
                             "nodes but torch.distributed is not initialized",
                    requirement="a process group before CheckpointStore.from_config",
                    fix="call torch.distributed.init_process_group() first, or set "
                        "store.replicas=0")
            links = Links(rank, side_store(fg, "pairs"), cfg.coord_timeout_s)
            links.ensure(ring.ring_pairs())  # every rank, in one global order (buddy.Links)
        token = fg.broadcast_json(secrets.token_hex(4))
        tiers: list[FsspecTier] = []
        if cfg.nvme_uri:
            tiers.append(make_tier("nvme", f"{cfg.nvme_uri.rstrip('/')}/{node}", env))
        if cfg.lustre_uri:
            tiers.append(make_tier("lustre", cfg.lustre_uri, env))
        if cfg.object_uri:
            tiers.append(make_tier("object", cfg.object_uri, env, cfg.s3_profile))
        primary = next((t for t in tiers if t.local_path("") is not None), None)
        if primary is None:  # no local tier: DCP writes to a node-local scratch directory
            base = expand_env(cfg.scratch_dir, env) if cfg.scratch_dir else tempfile.gettempdir()
            primary = make_tier("scratch", os.path.join(base, f"slurmkit-{token}", node), env)
        _secure_tiers([primary, *tiers], rank)
        return cls(cfg, tiers, primary, rank=rank, world_size=world_size, node=node,
                   config_hash=config_hash, on_event=on_event, fg=fg, bg=bg, token=token,
                   clock=clock, sleep=sleep, ring=ring, links=links)

    def _emit(self, event: Event) -> None:
        event = {**event, "rank": self.rank, "node": self.node, "time": self.clock()}
        if self._on_event is None:
            return
        try:
            self._on_event(event)
        except Exception:  # a broken event sink must not break checkpointing
            log.exception("on_event callback failed for %s", event.get("event"))

    # -- save -------------------------------------------------------------------------
    def save(self, step: int, state: dict[str, Any], *, shared: bool = False,
             final: bool = False) -> SaveHandle:
        """Snapshot ``state`` and return; the write and the promotions run in the background.

        ``shared``: this save also goes to the shared tier whatever the promotion interval
        (the stop checkpoint; see ``wait_shared``). ``final``: the run's last save (the
        trained model) goes to every slower tier whatever the intervals: node NVMe does not
        outlive the job at most sites, and a run that ends between two promotions would
        otherwise leave its result on node-local disks only."""
        if self._closed:
            raise SlurmkitError("CheckpointStore.save() after close()")
        if shared:
            self._shared_steps.add(step)
        if final:
            self._final_steps.add(step)
        t0 = time.perf_counter()
        prev = self._inflight
        if self.fg.any_true(prev is not None and not prev.done()):
            if self.cfg.busy_policy == "skip":
                log.warning("skipping save of step %d: the previous save is still writing", step)
                self._emit({"event": "ckpt_skipped", "step": step, "phase": "save",
                            "reason": "previous save still in flight (busy_policy=skip)"})
                return SaveHandle(step, None, time.perf_counter() - t0, skipped=True)
            if prev is not None:
                prev.wait()
            waited = time.perf_counter() - t0
            log.info("save of step %d waited %.2f s for the previous save", step, waited)
            self._emit({"event": "ckpt_waited", "step": step, "waited_s": round(waited, 3),
                        "reason": "previous save still in flight (busy_policy=wait)"})
        flat, copies = self._staging.prepare(state)
        gate = FillGate([key for key, _, _ in copies])
        fut: Future[Manifest | None] = Future()
        if self.cfg.overlap_snapshot:  # the writer serializes each tensor once it is copied
            self._job = self._pool.submit(self._persist, step, flat, gate, fut)
        try:
            fill(copies, gate)
        except BaseException:
            gate.abort()  # an overlapping writer fails this save (ckpt_failed), never waits
            raise
        if not self.cfg.overlap_snapshot:
            self._job = self._pool.submit(self._persist, step, flat, gate, fut)
        blocking = time.perf_counter() - t0
        self._inflight = SaveHandle(step, fut, blocking)
        return self._inflight

    def _decide(self, step: int) -> list[str]:
        """Rank 0 only: where this save gets promoted (broadcast in the manifest)."""
        if step not in self._decided:
            self._decided = {step: self._decide_new(step)}
        return self._decided[step]

    def _decide_new(self, step: int) -> list[str]:
        self._saves += 1
        names = {t.name for t in self.tiers}
        dests = []
        if self.primary.name == "scratch" and self.tiers:
            dests.append(self.tiers[0].name)
        every = self.cfg.lustre_every_saves
        forced = step in self._shared_steps
        final = step in self._final_steps
        if "lustre" in names and self.primary.name != "lustre" and (
                forced or final or (every and self._saves % every == 0)):
            dests.append("lustre")
        elif forced and "object" in names and self.primary.name not in SHARED_TIERS:
            dests.append("object")  # no Lustre: the object store is the shared tier
        every, minutes = self.cfg.object_every_saves, self.cfg.object_every_min
        due = final or bool(every and self._saves % every == 0) or bool(
            minutes and self.clock() - self._last_object >= minutes * 60)
        if "object" in names and self.primary.name != "object" and due \
                and "object" not in dests:
            self._last_object = self.clock()
            dests.append("object")
        return sorted(set(dests), key=dests.index)

    def _persist(self, step: int, flat: dict[str, Any], gate: FillGate,
                 done: Future[Manifest | None]) -> None:
        """Write and commit (then resolve ``done``: the handle, and the staging buffers are
        free again); then queue promotions and apply retention."""
        try:
            m, tier = self._write_primary(step, flat, gate)
        except BaseException as exc:  # never leave the handle unresolved
            done.set_exception(exc)
            raise
        done.set_result(m)
        if m is not None and tier is not None:
            self._after_commit(m, tier)

    def _write_primary(self, step: int, flat: dict[str, Any], gate: FillGate
                       ) -> tuple[Manifest | None, FsspecTier | None]:
        t0 = time.perf_counter()
        for w in self._writers:
            try:
                m = w.write(step, self._saves_seq(), flat, self._decide, gate)
                break
            except SAVE_ERRORS as exc:  # the writer thread reports every failure as an event
                log.error("checkpoint step %d failed on %s: %s", step, w.tier.uri, exc)
                self._emit({"event": "ckpt_failed", "step": step, "tier": w.tier.name,
                            "uri": w.tier.uri, "phase": "save", **error_fields(exc)})
        else:
            return None, None
        seconds = time.perf_counter() - t0
        if self.rank == 0:
            # nodes holding each file: with buddy copies the step survives losing a node
            copies = 1 + (w.ring.copies if w.ring is not None else 0)
            self._emit({"event": "ckpt_saved", "step": step, "tier": w.tier.name,
                        "uri": w.tier.uri, "bytes": m.total_bytes, "copies": copies,
                        "seconds": round(seconds, 3), "promote_to": m.promote_to})
        return m, w.tier

    def _after_commit(self, m: Manifest, tier: FsspecTier) -> None:
        # the writer hashed every file while writing it: this save is deep-verified here
        self._verified.mark(tier, m.step, save_id(m))
        if tier is not self.primary:
            self._promoter.note(m)
        self._gc(tier)
        self._promoter.wake()

    def _saves_seq(self) -> int:
        with self._lock:
            self._seq = getattr(self, "_seq", 0) + 1
            return self._seq

    # -- retention --------------------------------------------------------------------
    def _keep(self, tier: Tier) -> int:
        return {"nvme": self.cfg.keep_nvme, "lustre": self.cfg.keep_lustre,
                "object": self.cfg.keep_object}.get(tier.name, 1)

    def _gc(self, tier: Tier) -> None:
        """Retention on one tier: node-local tiers by every rank (locked), shared by rank 0.

        Only deep-verified steps count (see ``_verified_here``); the steps still due for a
        promotion (and the one being copied) are kept."""
        shared = self._is_shared(tier)
        if shared and self.rank != 0:
            return
        protected = self._promoter.protected()
        try:
            # hash what is not known yet before taking the lock (other ranks commit under it)
            known: dict[int, bool] = {}
            for s in list_steps(tier):
                known[s] = self._verified_here(tier, s)
                if sum(known.values()) >= self._keep(tier):
                    break
            with tier_lock(None if shared else tier):
                gc_tier(tier, self._keep(tier), protected,
                        lambda s: known[s] if s in known else self._verified_here(tier, s))
        except SlurmkitError as exc:
            log.error("retention on %s failed: %s", tier.uri, exc)

    def _is_shared(self, tier: Tier) -> bool:
        return tier.name in ("lustre", "object") and tier is not self.primary

    def _verified_here(self, tier: Tier, step: int) -> bool:
        """``step`` deep-verifies on ``tier`` as far as this rank must know.

        A save this process wrote or promoted was verified then (cached). Otherwise: on a
        node's own tier, this rank's files are hashed (each rank its own, so a node reads
        its data once); a file that does not match withdraws the save from the node. On a
        shared tier a manifest is only ever written after every file it names verified there
        (the writer hashes while writing, a promotion checks the destination after each
        copy), so the manifest and the sizes are checked, not every byte again by rank 0.
        """
        try:
            m = read_manifest(tier, step)
        except (ManifestError, TierError):
            return False
        sid = save_id(m)
        if self._verified.get(tier, step) == sid:
            return True
        if self._is_shared(tier):
            ok = check_step(tier, step, deep=False).ok
        else:
            mine = [f for f in m.files if f.rank == self.rank]
            st = check_step(tier, step, deep=True, files=lambda _: mine)
            ok = st.ok
            if not ok and st.manifest is not None and mine and tier.exists(
                    f"{step_dir(step)}/{mine[0].name}"):
                log.error("step %d on %s fails deep verification, withdrawn: %s", step,
                          tier.uri, st.problem)
                self._emit({"event": "ckpt_rejected", "step": step, "tier": tier.name,
                            "uri": tier.uri, "phase": "retention", "reason": st.problem})
                withdraw_step(tier, m, tier_lock)
        if ok:
            self._verified.mark(tier, step, sid)
        return ok

    # -- waiting, restore, queries ----------------------------------------------------
    def wait(self, timeout: float | None = None) -> None:
        """Wait for this rank's in-flight save and for its promotions to settle (done, or
        failed and queued for a later retry)."""
        if self._inflight is not None:
            self._inflight.wait(timeout)
        self._settle(timeout)
        self._promoter.wait_idle(timeout)

    def _settle(self, timeout: float | None) -> None:
        """Wait for the in-flight save's after-commit work (queueing promotions, retention);
        its failures were logged by the job itself."""
        if self._job is not None:
            self._job.exception(timeout)

    def shared_tier(self) -> FsspecTier | None:
        """The tier every node of any later allocation reads: Lustre, else the object store."""
        by_name = {t.name: t for t in self.tiers}
        return by_name.get("lustre") or by_name.get("object")

    def wait_shared(self, step: int, timeout: float | None = None) -> bool:
        """Wait until ``step`` (saved with ``shared=True``) is committed on the shared tier;
        True when every rank sees it there (or there is no shared tier). Collective: a rank
        exits as checkpointed only when a requeue onto other nodes can resume it."""
        self.wait(timeout)
        tier = self.shared_tier()
        if tier is None or tier is self.primary:
            return True
        missing = False
        self.fg.barrier()  # every rank's promotions settled before the one check
        if self.rank == 0:  # one check of the shared tier, not one per rank
            status = check_step(tier, step, deep=False)
            missing = not status.ok
            if missing:
                log.error("stop checkpoint of step %d is not on %s: %s", step, tier.uri,
                          status.problem)
        return not self.fg.any_true(missing)

    def pending_promotions(self) -> list[tuple[int, str]]:
        """(step, tier) saves due on a slower tier and not durable there yet (this rank's
        view, from the manifests; only the newest per tier: older ones are superseded)."""
        return self._promoter.pending()

    def restore(self, template_state: dict[str, Any]) -> RestoreResult | None:
        """Load the newest step that verifies on any tier into ``template_state`` (in place)."""
        if self._inflight is not None:
            self._inflight.wait()
        self._settle(None)
        # per rank: ranks of one node share the primary tier, and each removes its download
        # after loading it (a shared directory would vanish under a slower rank)
        if self.ring is not None and self.ring.enabled and self.links is not None \
                and self.primary.name in NODE_TIERS:
            # what this node lacks of the newest save on NVMe (a spare: everything) comes
            # from its peers first, so that save is restored without the shared tier
            recover(template_state, self.primary, self.ring, self.links, self.fg, self._emit,
                    newest=self.cfg.keep_nvme)
        scratch = self._restore_scratch()
        return restore_newest(template_state, self.tiers or [self.primary], self.fg,
                              scratch, self._emit)

    def _restore_scratch(self) -> str:
        """Where this rank downloads from slower tiers: ``.restore/rank_N`` on the primary
        tier, made without following a link (a planted one would receive the checkpoint);
        a private temporary directory when that is refused or the primary is not local."""
        root, rel = self.primary.local_path(""), f".restore/rank_{self.rank}"
        if root is not None:
            try:
                nofollow.make_dirs(root, rel)
                return os.path.join(root, rel)
            except OSError as exc:
                log.warning("restore downloads go to a private temporary directory: %s", exc)
        return os.path.join(tempfile.mkdtemp(prefix="slurmkit-restore-"), rel)

    def latest_verified(self) -> int | None:
        """Newest step that deep-verifies on any tier (as ``_verified_here`` decides)."""
        best: int | None = None
        for t in self.tiers:
            for s in list_steps(t):
                if best is not None and s <= best:
                    break
                if self._verified_here(t, s):
                    best = s
                    break
        return best

    def close(self) -> None:
        """Finish the in-flight save, stop the workers; pending promotions stay queued."""
        if self._closed:
            return
        self._closed = True
        if self._inflight is not None:
            self._inflight.wait()
        self._pool.shutdown(wait=True)
        self._promoter.wait_idle(timeout=None)
        self._promoter.stop()


def _dist_ready() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _secure_tiers(tiers: list[FsspecTier], rank: int) -> None:
    """Refuse, before anything is written, a local tier another user could read or replace
    (tiertrust.UnsafeTierError, a ConfigError: restarting cannot help); rank 0 logs the
    warnings (a group-writable shared tier)."""
    seen: set[str] = set()
    for t in tiers:
        if t.uri in seen:
            continue
        seen.add(t.uri)
        for warning in t.secure(shared=t.name in SHARED_TIERS):
            if rank == 0:
                log.warning("%s", warning)


def _coordinators(rank: int, world_size: int, timeout_s: float = 1800.0,
                  secret: bytes | None = None) -> tuple[Coordinator, Coordinator]:
    """The training thread's and the writer's coordinators: each one client connection to
    the job's rendezvous store (coord.py), no process group, nothing world-sized."""
    if world_size <= 1:
        return Coordinator(None, rank, 1), Coordinator(None, rank, 1)
    import torch.distributed as dist

    if not dist.is_initialized():
        raise ConfigError(
            detected=f"world_size={world_size} but torch.distributed is not initialized",
            requirement="a process group before CheckpointStore.from_config on every rank",
            fix="call torch.distributed.init_process_group() first (or use world_size=1)",
        )
    if dist.get_world_size() != world_size or dist.get_rank() != rank:
        raise ConfigError(
            detected=f"rank/world_size {rank}/{world_size} but the process group says "
                     f"{dist.get_rank()}/{dist.get_world_size()}",
            requirement="the store's rank and world size match torch.distributed",
            fix="pass rank=dist.get_rank(), world_size=dist.get_world_size()",
        )
    if secret is None:
        log.warning("no run directory ($SLURMKIT_RUN_DIR): the checkpoint coordinator's "
                    "values on the job's store are not signed")
    fg, bg = coordinators(rank, world_size, ("fg", "bg"), timeout_s, secret)
    return fg, bg
