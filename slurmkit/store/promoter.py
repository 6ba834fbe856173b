"""The background promotion worker of one rank: drains the persistent queue with retries.

It survives its own failures: an exhausted retry leaves the entry queued, emits a
``ckpt_failed`` event and the worker goes on with other destinations; the queue is tried
again at the next save, after ``retry_pending_s``, or by the next process after a restart.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import tenacity

from slurmkit.store.catalog import check_step
from slurmkit.store.promote import (
    commit_promotion,
    copy_files,
    find_source,
    owned,
    wait_for_files,
)
from slurmkit.store.queue import PromotionQueue
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


class Promoter:
    def __init__(self, *, tiers: Sequence[Tier], queue: PromotionQueue, rank: int,
                 world_size: int, emit: Emit, gc: Callable[[Tier], None],
                 retry_attempts: int, retry_initial_s: float, retry_max_s: float,
                 retry_pending_s: float, commit_timeout_s: float, max_workers: int,
                 stagger_delay_s: float, clock: Callable[[], float],
                 sleep: Callable[[float], None]) -> None:
        self.tiers = list(tiers)
        self.by_name = {t.name: t for t in tiers}
        self.queue = queue
        self.rank = rank
        self.world_size = world_size
        self.emit = emit
        self.gc = gc
        self.retry = dict(attempts=retry_attempts, initial=retry_initial_s, max=retry_max_s)
        self.retry_pending_s = retry_pending_s
        self.commit_timeout_s = commit_timeout_s
        self.max_workers = max_workers
        self.stagger_delay_s = stagger_delay_s
        self.clock = clock
        self.sleep = sleep
        self.active: int | None = None  # step being promoted (retention must keep it)
        self._cv = threading.Condition()
        self._wake = False
        self._idle = True
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="slurmkit-promoter", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        with self._cv:
            self._wake = True
            self._idle = False
            self._cv.notify_all()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until a round found nothing it could do; True unless the timeout hit."""
        with self._cv:
            return self._cv.wait_for(lambda: self._idle and not self._wake, timeout)

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join()

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
        failed: set[str] = set()
        for step, dest_name in self.queue.entries():
            if dest_name in failed or self._stop:
                continue
            dest = self.by_name.get(dest_name)
            if dest is None:
                log.warning("dropping promotion of step %d to unconfigured tier %s",
                            step, dest_name)
                self.queue.remove(step, dest_name)
                continue
            if self.stagger_delay_s > 0:
                self.sleep(self.stagger_delay_s)
            self.active = step
            try:
                self._promote_with_retry(step, dest)
            except Exception as exc:  # any failure keeps the entry queued for a later round
                failed.add(dest_name)
                log.error("promotion of step %d to %s failed, kept in queue: %s",
                          step, dest.uri, exc)
                self.emit({"event": "ckpt_failed", "step": step, "tier": dest.name,
                           "uri": dest.uri, "phase": "promote", "pending": True,
                           **error_fields(exc)})
                continue
            finally:
                self.active = None
            self.queue.remove(step, dest_name)
            self._gc_all(dest)

    def _gc_all(self, dest: Tier) -> None:
        try:
            self.gc(dest)
        except Exception as exc:  # retention problems must not stop promotions
            log.error("retention on %s failed: %s", dest.uri, exc)

    def _promote_with_retry(self, step: int, dest: Tier) -> None:
        r = self.retry
        retrying = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(int(r["attempts"])),
            wait=tenacity.wait_exponential(multiplier=r["initial"], max=r["max"]),
            retry=tenacity.retry_if_exception_type((TierError, OSError)),
            sleep=self.sleep, reraise=True,
            before_sleep=lambda rs: log.warning(
                "promotion of step %d to %s: attempt %d failed (%s), retrying",
                step, dest.uri, rs.attempt_number, rs.outcome.exception() if rs.outcome else ""),
        )
        retrying(self._promote, step, dest)

    def _promote(self, step: int, dest: Tier) -> None:
        if self.rank == 0 and check_step(dest, step, deep=False).ok:
            return  # already there (finished by an earlier process)
        t0 = self.clock()
        src, m = find_source(self.tiers, dest, step, self.rank)
        nbytes = copy_files(src, dest, step, owned(m, self.rank, self.world_size),
                            self.max_workers)
        if self.rank != 0:
            return
        wait_for_files(dest, step, m, timeout_s=self.commit_timeout_s, clock=self.clock,
                       sleep=self.sleep)
        commit_promotion(dest, step, m)
        seconds = max(self.clock() - t0, 1e-9)
        log.info("step %d durable on %s (%s) after %.1f s", step, dest.name, dest.uri, seconds)
        self.emit({"event": "ckpt_durable", "step": step, "tier": dest.name, "uri": dest.uri,
                   "source": src.name, "bytes": m.total_bytes, "copied_bytes": nbytes,
                   "seconds": round(seconds, 3)})


def default_clock() -> float:
    return time.time()
