"""The background promotion worker of one rank, driven by the manifests on its primary tier.

There is no queue to lose: what is due is read from the tiers each round. A committed step
on this rank's primary tier whose manifest names a slower tier in ``promote_to`` is due there
until that tier's ``latest.json`` reaches it. Each round, per destination, only the newest
due step is promoted; older due steps are superseded and dropped (``ckpt_dropped``). So
whatever set of nodes the job has now (a spare that never saw the older steps, a requeue on
other nodes, a restarted process), the ranks meet on the newest step they all hold, and
nothing older can block a tier.

Per destination and step, a rank copies its files (promote.py) and acknowledges. Rank 0
commits once every copying rank acknowledged; it gives up a step when one refuses (no tier
holds a verified copy of its file), when the deadline passes (``commit_timeout_s``: a rank
that lost the files, or died), or when a newer due step appears. Every one of these is a
ledger event; a failing destination (an outage) leaves the step due, reported as
``ckpt_failed`` with ``pending: true`` and tried again at the next save, after
``retry_pending_s``, or by the next process.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import tenacity

from slurmkit.store.catalog import VerifiedCache, check_step, list_steps, read_latest, read_manifest
from slurmkit.store.manifest import MANIFEST, Manifest, ManifestError, step_dir
from slurmkit.store.promote import (
    SourceError,
    commit_promotion,
    copiers,
    copy_files,
    has_ack,
    holders,
    owned,
    read_acks,
    same_save,
    save_id,
    write_ack,
)
from slurmkit.store.tier import Tier, TierError

log = logging.getLogger(__name__)
Emit = Callable[[dict[str, Any]], None]


def error_fields(exc: BaseException) -> dict[str, Any]:
    """Event fields that say what went wrong, with a reason a supervisor can match on."""
    text = f"{type(exc).__name__}: {exc}"
    cause: BaseException | None = exc
    full = False
    while cause is not None:
        full = full or getattr(cause, "errno", None) in (errno.ENOSPC, errno.EDQUOT)
        cause = cause.__cause__ or cause.__context__
    full = full or "No space left" in text
    return {"error": text[:500], "reason": "disk_full" if full else "io_error"}


def _transient(exc: BaseException) -> bool:
    return isinstance(exc, (TierError, OSError)) and not isinstance(exc, SourceError)


class Promoter:
    def __init__(self, *, primary: Tier, tiers: Sequence[Tier], rank: int, world_size: int,
                 emit: Emit, gc: Callable[[Tier], None], verified: VerifiedCache,
                 retry_attempts: int, retry_initial_s: float, retry_max_s: float,
                 retry_pending_s: float, commit_timeout_s: float, max_workers: int,
                 stagger_delay_s: float, clock: Callable[[], float],
                 sleep: Callable[[float], None],
                 withdraw: Callable[[Tier, Manifest], None] | None = None) -> None:
        self.primary = primary
        self.tiers = [primary] + [t for t in tiers if t is not primary]  # sources, fastest first
        self.dests = self.tiers[1:]
        self.rank = rank
        self.world_size = world_size
        self.emit = emit
        self.gc = gc
        self.verified = verified
        self.withdraw = withdraw
        self.retry = dict(attempts=retry_attempts, initial=retry_initial_s, max=retry_max_s)
        self.retry_pending_s = retry_pending_s
        self.commit_timeout_s = commit_timeout_s
        self.max_workers = max_workers
        self.stagger_delay_s = stagger_delay_s
        self.clock = clock
        self.sleep = sleep
        self.active: int | None = None  # step being promoted (retention must keep it)
        self._noted: dict[int, Manifest] = {}  # saves of this process on a fallback tier
        self._done: dict[str, int] = {}  # dest -> newest step this rank finished with
        self._dropped: set[tuple[int, str]] = set()
        self._durable_seen: dict[str, int] = {}  # dest -> newest step seen durable there
        self._cv = threading.Condition()
        self._wake = True  # the first round picks up what an earlier process left due
        self._idle = False
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="slurmkit-promoter", daemon=True)
        self._thread.start()

    # -- control ----------------------------------------------------------------------
    def wake(self) -> None:
        with self._cv:
            self._wake = True
            self._idle = False
            self._cv.notify_all()

    def note(self, m: Manifest) -> None:
        """A save of this process committed on a tier other than the primary (the primary
        failed): its promotions are due too, though the primary's listing lacks it."""
        noted = {**self._noted, m.step: m}
        self._noted = {s: noted[s] for s in sorted(noted)[-4:]}  # the newest few suffice

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until a round found nothing it could do; True unless the timeout hit."""
        with self._cv:
            return self._cv.wait_for(lambda: self._idle and not self._wake, timeout)

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join()

    def protected(self) -> set[int]:
        """Steps retention must keep on this node: per destination the newest due step not
        known durable there, and the one being copied. Read from the manifests, so every
        rank sharing the node's directory protects the same steps (one rank may still be
        copying what another already delivered)."""
        steps = set()
        for dest in self.dests:
            m = self._newest_due(dest)
            if m is not None and m.step > self._durable_seen.get(dest.name, -1):
                steps.add(m.step)
        if self.active is not None:
            steps.add(self.active)
        return steps

    def pending(self) -> list[tuple[int, str]]:
        """(step, destination) due and not yet durable there, as this rank sees it now."""
        out = []
        for dest in self.dests:
            m = self._newest_due(dest)
            if m is not None and m.step > self._done.get(dest.name, -1) \
                    and m.step > self._durable(dest):
                out.append((m.step, dest.name))
        return sorted(out)

    # -- rounds -------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._wake or self._stop, self.retry_pending_s)
                if self._stop:
                    return
                self._wake = False
                self._idle = False
            try:
                self._round()
            except Exception:  # the worker must never die silently; report and keep going
                log.exception("promotion round failed unexpectedly")
            with self._cv:
                self._idle = True
                self._cv.notify_all()

    def _round(self) -> None:
        due = {dest.name: self._due_saves(dest) for dest in self.dests}
        for dest in self.dests:  # superseded steps are reported before anything waits
            for old in due[dest.name][1:]:
                self._drop(old.step, dest, f"superseded by step {due[dest.name][0].step}")
        for dest in self.dests:  # one failing destination never holds up another for good
            if self._stop:
                return
            try:
                self._serve(dest)
            except Exception as exc:
                log.exception("promotion to %s failed unexpectedly", dest.uri)
                self.emit({"event": "ckpt_failed", "tier": dest.name, "uri": dest.uri,
                           "phase": "promote", "pending": True, **error_fields(exc)})

    def _due_saves(self, dest: Tier) -> list[Manifest]:
        """Committed saves on the primary (and this process's fallback saves) that name
        ``dest`` in promote_to, newest first."""
        found: dict[int, Manifest] = {s: m for s, m in self._noted.items()
                                      if dest.name in m.promote_to}
        try:
            steps = list_steps(self.primary)
        except TierError as exc:
            log.warning("cannot list %s: %s", self.primary.uri, exc)
            steps = []
        for s in steps:
            if s in found:
                continue
            try:
                m = read_manifest(self.primary, s)
            except (ManifestError, TierError):
                continue  # not committed here (being written, killed, or withdrawn)
            if dest.name in m.promote_to:
                found[s] = m
        return [found[s] for s in sorted(found, reverse=True)]

    def _newest_due(self, dest: Tier) -> Manifest | None:
        due = self._due_saves(dest)
        return due[0] if due else None

    def _durable(self, dest: Tier) -> int:
        """The newest step committed on ``dest`` (its latest.json; -1: none or unreadable)."""
        latest = read_latest(dest)
        step = -1 if latest is None else latest
        self._durable_seen[dest.name] = max(step, self._durable_seen.get(dest.name, -1))
        return step

    def _serve(self, dest: Tier) -> None:
        due = self._due_saves(dest)
        if not due or due[0].step <= self._done.get(dest.name, -1):
            return  # nothing new: no request to the destination at all
        m = due[0]
        if m.step <= max(self._durable(dest), self._durable_seen.get(dest.name, -1)):
            self._done[dest.name] = m.step
            return
        for old in due[1:]:
            self._drop(old.step, dest, f"superseded by step {m.step}")
        if self.stagger_delay_s > 0:
            self.sleep(self.stagger_delay_s)
        self.active = m.step
        try:
            self._promote(m, dest)
        except Exception as exc:  # past the copies (the acknowledgements, the commit): still due
            log.exception("promotion of step %d to %s failed, still due", m.step, dest.uri)
            self.emit({"event": "ckpt_failed", "step": m.step, "tier": dest.name, "uri": dest.uri,
                       "phase": "promote", "pending": True, **error_fields(exc)})
        finally:
            self.active = None

    def _drop(self, step: int, dest: Tier, why: str) -> None:
        """Rank 0 reports (once) a due step that will never be promoted to ``dest``."""
        if step <= self._done.get(dest.name, -1) or step <= self._durable_seen.get(dest.name, -1) \
                or (step, dest.name) in self._dropped:
            return
        self._dropped.add((step, dest.name))
        if self.rank == 0:
            log.info("promotion of step %d to %s dropped: %s", step, dest.uri, why)
            self.emit({"event": "ckpt_dropped", "step": step, "tier": dest.name,
                       "uri": dest.uri, "phase": "promote", "reason": why})

    def _retrying(self, what: str, step: int, dest: Tier) -> tenacity.Retrying:
        r = self.retry
        return tenacity.Retrying(
            stop=tenacity.stop_after_attempt(int(r["attempts"])),
            wait=tenacity.wait_exponential(multiplier=r["initial"], max=r["max"]),
            retry=tenacity.retry_if_exception(_transient),
            sleep=self.sleep, reraise=True,
            before_sleep=lambda rs: log.warning(
                "%s of step %d to %s: attempt %d failed (%s), retrying", what, step,
                dest.uri, rs.attempt_number, rs.outcome.exception() if rs.outcome else ""),
        )

    def _promote(self, m: Manifest, dest: Tier) -> None:
        step, t0 = m.step, self.clock()
        mine = owned(m, self.rank, self.world_size)
        sources = holders(self.tiers, dest, m)

        def deliver() -> int:
            if not mine or has_ack(dest, m, self.rank):
                return 0  # nothing to copy, or delivered before a restart
            n = copy_files(sources, dest, m, mine, self.max_workers)
            write_ack(dest, m, self.rank)
            return n

        try:
            copied = self._retrying("promotion", step, dest)(deliver)
        except SourceError as exc:
            if not same_save(self.primary, step, save_id(m)):  # retention took it meanwhile
                log.info("step %d left %s before its promotion to %s: superseded", step,
                         self.primary.uri, dest.uri)
                self._done[dest.name] = step
                return
            self._refuse(m, dest, exc)
            return
        except Exception as exc:  # the destination failed: the step stays due
            log.error("promotion of step %d to %s failed, still due: %s", step, dest.uri, exc)
            self.emit({"event": "ckpt_failed", "step": step, "tier": dest.name,
                       "uri": dest.uri, "phase": "promote", "pending": True,
                       **error_fields(exc)})
            return
        if self.rank != 0:
            self._done[dest.name] = step
            return
        verdict = self._await_copies(m, dest)
        if verdict is None:
            return  # stopping: still due for the next process
        if verdict:
            if verdict.startswith("superseded"):
                self._drop(step, dest, verdict)
                self._done[dest.name] = step
            else:
                self._done[dest.name] = step
                log.error("promotion of step %d to %s abandoned: %s", step, dest.uri, verdict)
                self.emit({"event": "ckpt_failed", "step": step, "tier": dest.name,
                           "uri": dest.uri, "phase": "promote", "pending": False,
                           "error": verdict[:500], "reason": "promotion_abandoned"})
            return
        try:
            self._retrying("commit", step, dest)(commit_promotion, dest, m)
        except Exception as exc:
            log.error("commit of step %d on %s failed, still due: %s", step, dest.uri, exc)
            self.emit({"event": "ckpt_failed", "step": step, "tier": dest.name,
                       "uri": dest.uri, "phase": "promote", "pending": True,
                       **error_fields(exc)})
            return
        self._done[dest.name] = step
        self._durable_seen[dest.name] = max(step, self._durable_seen.get(dest.name, -1))
        self.verified.mark(dest, step, save_id(m))
        seconds = max(self.clock() - t0, 1e-9)
        log.info("step %d durable on %s (%s) after %.1f s", step, dest.name, dest.uri, seconds)
        self.emit({"event": "ckpt_durable", "step": step, "tier": dest.name, "uri": dest.uri,
                   "source": sources[0].name if sources else "", "bytes": m.total_bytes,
                   "copied_bytes": copied, "verified": "checksum on destination",
                   "seconds": round(seconds, 3)})
        try:
            self.gc(dest)
        except Exception as exc:  # retention problems must not stop promotions
            log.error("retention on %s failed: %s", dest.uri, exc)

    def _await_copies(self, m: Manifest, dest: Tier) -> str | None:
        """Rank 0: "" once every copying rank acknowledged; else why the step is given up
        (a refusal, the deadline, a newer due step); None when the worker is stopping."""
        need = copiers(m, self.world_size)
        deadline = self.clock() + self.commit_timeout_s
        delay = 0.05
        while True:
            try:
                acks = read_acks(dest, m)
            except TierError as exc:
                log.warning("cannot read acknowledgements of step %d on %s: %s", m.step,
                            dest.uri, exc)
                acks = {}
            refused = {r: p for r, p in acks.items() if p}
            if refused:
                return "; ".join(f"rank {r}: {p}" for r, p in sorted(refused.items()))
            missing = sorted(need - acks.keys())
            if not missing:
                return ""
            newer = self._newest_due(dest)
            if newer is not None and newer.step > m.step:
                return f"superseded by step {newer.step}"
            if self.clock() > deadline:
                return (f"ranks {missing[:8]} did not deliver their files within "
                        f"{self.commit_timeout_s:.0f} s (node replaced or rank gone?)")
            if self._stop:
                return None
            self.sleep(delay)
            delay = min(delay * 2, 2.0)

    def _refuse(self, m: Manifest, dest: Tier, exc: SourceError) -> None:
        """No tier holds a verified copy of one of this rank's files. Say so to rank 0 (an
        acknowledgement that refuses, so it need not wait for the deadline) and never try
        this save again. When this node holds the files but they do not verify, the save is
        damaged: ``ckpt_rejected``, and it is withdrawn from the node. When the node does not
        hold them (a spare, a requeue onto other nodes), the save was simply never here."""
        self._done[dest.name] = m.step
        mine = owned(m, self.rank, self.world_size)
        try:
            present = self.primary.sizes(step_dir(m.step))
        except TierError:
            present = {}
        damaged = all(f.name in present for f in mine)
        with contextlib.suppress(TierError, OSError):
            write_ack(dest, m, self.rank, str(exc) if damaged else
                      f"rank {self.rank}: this node does not hold its files of step {m.step} "
                      "(replaced node or moved job)")
        if not damaged:
            log.warning("step %d: this node does not hold rank %d's files, cannot promote "
                        "to %s", m.step, self.rank, dest.uri)
            return
        log.error("step %d cannot be promoted to %s: %s", m.step, dest.uri, exc)
        self.emit({"event": "ckpt_rejected", "step": m.step, "tier": dest.name,
                   "uri": dest.uri, "phase": "promote", "reason": str(exc)[:500]})
        st = check_step(self.primary, m.step, deep=True,
                        files=lambda mm: [f for f in mm.files if f in mine])
        if st.manifest is not None and not st.ok and save_id(st.manifest) == save_id(m):
            self.verified.forget(self.primary, m.step)
            if self.withdraw is not None:
                self.withdraw(self.primary, m)
            log.error("step %d withdrawn from %s: %s", m.step, self.primary.uri, st.problem)


def withdraw_step(tier: Tier, m: Manifest, lock: Callable[[Tier], Any]) -> None:
    """Remove the manifest of save ``m`` (not of a different save of the step) from a
    node-local tier, so neither retention nor restore counts it there any more."""
    if tier.local_path("") is None:
        return
    with lock(tier):
        try:
            current = read_manifest(tier, m.step)
        except (ManifestError, TierError):
            return
        if save_id(current) == save_id(m):  # the tier's rm: through no link (nofollow.py)
            tier.rm(f"{step_dir(m.step)}/{MANIFEST}")


def default_clock() -> float:
    return time.time()
