"""Stop requests from Slurm (SIGUSR1 time-limit warning, SIGTERM preemption/cancel).

The handler only records the signal: the trainer checks the flag at the next step boundary,
agrees with the other ranks, checkpoints there and exits with ``EXIT_CHECKPOINTED_ON_SIGNAL``.
Nothing that allocates, locks or does I/O runs inside the handler.
"""

from __future__ import annotations

import signal
from types import FrameType

# "Saved, not finished" (slurmkit.contract): the supervisor requeues the job, unlike 93.
from slurmkit.contract import EXIT_CHECKPOINTED_ON_SIGNAL

__all__ = ["EXIT_CHECKPOINTED_ON_SIGNAL", "STOP_SIGNALS", "StopRequest"]
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class StopRequest:
    """A flag set by SIGUSR1/SIGTERM (or by ``request()``); ``signum`` is the first signal."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def request(self, signum: int = 0) -> None:
        if self.signum is None:
            self.signum = signum

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.request(signum)

    def install(self) -> StopRequest:
        """Route the stop signals to this flag (main thread only, as Python requires)."""
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()
