"""Run checks at the same time, each with its own deadline.

A check that hangs (nvidia-smi on a GPU that fell off the bus, a stat on a hung NFS mount, or
only a loaded node) is left behind in its daemon thread and gets its timeout verdict; the
pre-flight goes on. Missing a deadline is no evidence against a node (a busy machine misses
them too), so the pre-flight gives every timeout ``wait`` and re-checks with a longer one. A check
whose previous run is still blocked is not started again (that would pile up stuck threads on a
hung mount): it gets its timeout verdict at once. A check that raises is a bug or an
environment this code does not know, never evidence against the node: it is ``skipped`` with
the exception, so a fault in pre-flight itself cannot drain a cluster.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from slurmkit.health.result import CheckResult, Verdict

log = logging.getLogger(__name__)
_GRACE = 1.2  # the runner waits this many times a check's deadline before it gives up on it


@dataclass(frozen=True)
class Timeout:
    """What a check that misses its deadline means: its verdict and the message parts."""

    verdict: Verdict
    requirement: str
    fix: str


@dataclass
class Check:
    name: str
    run: Callable[[float], CheckResult]  # called with its deadline in seconds (for its own subprocesses)
    timeout_s: float
    on_timeout: Timeout
    # False: a check among nodes (the link test), run once per generation; its "wait" does not
    # hold the node for re-checks (alone, it would find no peers).
    rerun: bool = True
    _thread: threading.Thread | None = field(default=None, repr=False)
    _started: float = field(default=0.0, repr=False)


def _timed_out(check: Check, waited_s: float, deadline_s: float, still_blocked: bool) -> CheckResult:
    how = (f"its previous run is still blocked after {waited_s:.1f} s" if still_blocked
           else f"no answer within {deadline_s:g} s")
    return CheckResult(check.name, check.on_timeout.verdict, f"{check.name}: {how}",
                       check.on_timeout.requirement, check.on_timeout.fix,
                       {"timed_out": True}, duration_s=waited_s)


def run_checks(checks: Sequence[Check], *, scale: float = 1.0,
               clock: Callable[[], float] = time.monotonic) -> list[CheckResult]:
    """Every check's result, in the order given; returns when each has finished or passed its
    deadline, ``scale`` times its ``timeout_s`` (so after about the longest deadline at most)."""
    slots: list[list[CheckResult]] = [[] for _ in checks]
    started: list[threading.Thread | None] = []
    t0 = clock()
    for check, slot in zip(checks, slots):
        if check._thread is not None and check._thread.is_alive():
            started.append(None)
            continue

        def body(check: Check = check, slot: list[CheckResult] = slot) -> None:
            t = clock()
            try:
                result = check.run(check.timeout_s * scale)
            except Exception as exc:  # noqa: BLE001 - a broken check is reported, never fatal
                log.exception("pre-flight check %s raised", check.name)
                result = CheckResult(check.name, Verdict.SKIPPED, f"the check itself failed: {exc!r}"[:500])
            slot.append(replace(result, duration_s=clock() - t))

        thread = threading.Thread(target=body, name=f"preflight-{check.name}", daemon=True)
        check._thread, check._started = thread, clock()
        thread.start()
        started.append(thread)
    results: list[CheckResult] = []
    for check, slot, maybe in zip(checks, slots, started):
        if maybe is None:
            results.append(_timed_out(check, clock() - check._started, check.timeout_s * scale, still_blocked=True))
            continue
        # A little past the deadline the check itself was given, so that its own subprocess
        # timeout (which says more than "no answer") is what reports a slow command.
        maybe.join(max(0.0, t0 + check.timeout_s * scale * _GRACE - clock()))
        results.append(slot[0] if slot else _timed_out(check, clock() - t0, check.timeout_s * scale,
                                                       still_blocked=False))
    return results
