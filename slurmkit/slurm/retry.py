"""Retrying Slurm commands that failed for a transient reason.

A busy or restarting slurmctld makes the CLI fail with a handful of well-known messages; those
are worth retrying with backoff. Errors that describe the request itself (bad job id, bad
partition, policy violations) are permanent: retrying only delays the user's error message.

A command that may have reached the controller before failing (a socket timeout, our own
timeout) could have taken effect. Those are retried only for idempotent commands: retrying
``sbatch`` after an ambiguous failure could queue the job twice.
"""

from __future__ import annotations

import enum
import inspect
import logging
import shlex
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import tenacity

from slurmkit.slurm.errors import SlurmCommandError, SlurmCommandTimeout
from slurmkit.slurm.runner import CommandResult, CommandRunner

# The first wait of tenacity's jittered backoff: `multiplier` in newer tenacity (which warns on
# `initial`), `initial` before it (pyproject allows tenacity>=8.2).
_FIRST_WAIT = ("multiplier" if "multiplier" in inspect.signature(tenacity.wait_exponential_jitter).parameters
               else "initial")

log = logging.getLogger(__name__)


class Disposition(enum.Enum):
    """What a failure means for a retry."""

    #: The request never reached the controller: safe to retry any command.
    NOT_DELIVERED = "not_delivered"
    #: The request may have been processed: retry only idempotent commands.
    AMBIGUOUS = "ambiguous"
    #: The request itself is wrong: never retry.
    PERMANENT = "permanent"
    #: Nothing recognised: do not retry (an unknown error is surfaced at once).
    UNKNOWN = "unknown"


#: Stable fragments of Slurm messages, checked in order: permanent ones first, so a message
#: that mentions both (e.g. a socket error while reporting an invalid job) is not retried.
ERROR_PATTERNS: tuple[tuple[str, Disposition], ...] = (
    ("Invalid job id specified", Disposition.PERMANENT),
    ("Invalid partition name specified", Disposition.PERMANENT),
    ("Requested node configuration is not available", Disposition.PERMANENT),
    ("Invalid account or account/partition combination", Disposition.PERMANENT),
    ("Job violates accounting/QOS policy", Disposition.PERMANENT),
    ("Invalid qos specification", Disposition.PERMANENT),
    ("Invalid generic resource (gres) specification", Disposition.PERMANENT),
    ("Invalid node name specified", Disposition.PERMANENT),
    ("Requested time limit is invalid", Disposition.PERMANENT),
    ("Access/permission denied", Disposition.PERMANENT),
    ("Job/step already completing or completed", Disposition.PERMANENT),
    ("Only batch jobs are accepted or processed", Disposition.PERMANENT),
    ("Requested operation is presently disabled", Disposition.PERMANENT),
    ("Job is no longer pending execution", Disposition.PERMANENT),
    ("Job has already finished", Disposition.PERMANENT),
    ("Slurm accounting storage is disabled", Disposition.PERMANENT),
    ("Unable to contact slurm controller", Disposition.NOT_DELIVERED),
    ("Transport endpoint is not connected", Disposition.NOT_DELIVERED),
    ("Connection refused", Disposition.NOT_DELIVERED),
    ("Socket timed out on send/recv operation", Disposition.AMBIGUOUS),
    ("slurm_load_jobs error: Socket timed out", Disposition.AMBIGUOUS),
    ("Zero Bytes were transmitted or received", Disposition.AMBIGUOUS),
    ("Slurm backup controller in standby mode", Disposition.NOT_DELIVERED),
    ("Resource temporarily unavailable", Disposition.AMBIGUOUS),
)

#: Commands (by their first arguments) that must not run twice by accident.
NON_IDEMPOTENT: tuple[tuple[str, ...], ...] = (
    ("sbatch",),
    ("scontrol", "requeue"),
    ("scontrol", "requeuehold"),
)


def classify(error: SlurmCommandError) -> Disposition:
    """Map a failed command to a :class:`Disposition` from :data:`ERROR_PATTERNS`."""
    text = error.output
    for fragment, disposition in ERROR_PATTERNS:
        if fragment in text:
            return disposition
    if isinstance(error, SlurmCommandTimeout):
        return Disposition.AMBIGUOUS
    return Disposition.UNKNOWN


def is_idempotent(args: list[str]) -> bool:
    """True when running ``args`` twice has the same effect as once."""
    return not any(tuple(args[: len(prefix)]) == prefix for prefix in NON_IDEMPOTENT)


def should_retry(error: BaseException, args: list[str]) -> bool:
    """Retry decision for one failure of ``args``."""
    if not isinstance(error, SlurmCommandError):
        return False
    disposition = classify(error)
    if disposition is Disposition.NOT_DELIVERED:
        return True
    return disposition is Disposition.AMBIGUOUS and is_idempotent(args)


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with jitter for transient controller errors.

    Attributes:
        max_attempts: total tries including the first (1 disables retries).
        max_delay_s: stop retrying once this many seconds passed since the first try.
        initial_wait_s: wait before the second try; doubles each time.
        max_wait_s: cap of one wait, before jitter.
        jitter_s: up to this many random seconds added to each wait, so many clients that
            failed together do not hammer a recovering controller together.
        sleep: the function that waits (tests pass a recorder).
    """

    max_attempts: int = 5
    max_delay_s: float = 120.0
    initial_wait_s: float = 1.0
    max_wait_s: float = 30.0
    jitter_s: float = 1.0
    sleep: Callable[[float], None] = field(default=time.sleep, compare=False)

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if min(self.max_delay_s, self.initial_wait_s, self.max_wait_s, self.jitter_s) < 0:
            raise ValueError("retry delays must be >= 0")


class RetryingRunner:
    """A :class:`CommandRunner` that retries another runner's transient failures."""

    def __init__(self, inner: CommandRunner, policy: RetryPolicy | None = None) -> None:
        self.inner = inner
        self.policy = policy or RetryPolicy()

    def _retrying(self, args: list[str]) -> tenacity.Retrying:
        p = self.policy
        return tenacity.Retrying(
            stop=(tenacity.stop_after_attempt(p.max_attempts)
                  | tenacity.stop_after_delay(p.max_delay_s)),
            wait=tenacity.wait_exponential_jitter(
                max=p.max_wait_s, jitter=p.jitter_s, **{_FIRST_WAIT: p.initial_wait_s}),
            retry=tenacity.retry_if_exception(lambda exc: should_retry(exc, args)),
            sleep=p.sleep,
            before_sleep=lambda state: self._log_retry(args, state),
            reraise=True,
        )

    @staticmethod
    def _log_retry(args: list[str], state: tenacity.RetryCallState) -> None:
        wait_s = state.next_action.sleep if state.next_action else 0.0
        exc = state.outcome.exception() if state.outcome else None
        log.warning("`%s` failed (attempt %d), retrying in %.1f s: %s",
                    shlex.join(args), state.attempt_number, wait_s, exc)

    def run(
        self,
        args: list[str],
        *,
        timeout_s: float = 30,
        input: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> CommandResult:
        """See :meth:`CommandRunner.run`; transient failures are retried per the policy."""
        for attempt in self._retrying(args):
            with attempt:
                return self.inner.run(args, timeout_s=timeout_s, input=input, env=env)
        raise AssertionError("unreachable: tenacity reraises the last error")  # pragma: no cover
