"""Stop requests from Slurm (SIGUSR1 time-limit warning, SIGTERM preemption/cancel), and the
stack dump a node agent asks a hung rank for (STACK_SIGNAL).

The handler only records the signal: the trainer checks the flag at the next step boundary,
agrees with the other ranks, checkpoints there and exits with ``EXIT_CHECKPOINTED_ON_SIGNAL``.
Nothing that allocates, locks or does I/O runs inside the handler.
"""

from __future__ import annotations

import faulthandler
import os
import signal
from collections.abc import Mapping
from types import FrameType
from typing import IO

# "Saved, not finished" (slurmkit.contract): the supervisor requeues the job, unlike 93.
from slurmkit.contract import EXIT_CHECKPOINTED_ON_SIGNAL

__all__ = ["EXIT_CHECKPOINTED_ON_SIGNAL", "STACK_FILE_ENV", "STACK_SIGNAL", "STOP_SIGNALS", "StopRequest",
           "register_stack_dump"]
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
# Asks for every thread's Python stack (slurmkit.launch.stackdump), sent by the agent before it
# kills a hung generation. Not SIGUSR1 (the time-limit warning) nor SIGTERM (preemption, stop);
# not SIGQUIT (Ctrl-\ and a core dump by default; torchrun forwards it as a stop) nor SIGABRT
# (how NCCL's watchdog ends a process). SIGUSR2 is Slurm's and torch's to use for nothing. Its
# default action still terminates, so the agent sends it only to a process that runs this
# trainer and whose /proc status shows a handler for it.
STACK_SIGNAL = signal.SIGUSR2
STACK_FILE_ENV = "SLURMKIT_STACK_FILE"  # set by the agent: a node-local file per rank


def register_stack_dump(env: Mapping[str, str]) -> IO[str] | None:
    """Dump all threads' stacks to ``$SLURMKIT_STACK_FILE`` on STACK_SIGNAL; the open file (kept
    open for faulthandler, which writes to its descriptor from inside the signal), or None when
    the variable is unset or the file cannot be opened. faulthandler's handler is C code: it
    runs even while the main thread is blocked inside a collective, where a Python handler
    would wait for the collective to return."""
    path = env.get(STACK_FILE_ENV)
    if not path:
        return None
    try:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        stacks = open(path, "w", encoding="utf-8")  # noqa: SIM115 - open for the process's life
    except OSError:
        return None
    faulthandler.register(STACK_SIGNAL, file=stacks, all_threads=True)
    return stacks


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
