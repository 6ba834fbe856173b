"""Fault injection for the supervisor's tests: make a chosen rank fail at a chosen step.

``SLURMKIT_FAULT="kind:rank:step[:once]"``, several joined by ``;``. Kinds:

- ``raise``: raise RuntimeError (a user-code error, exit 1)
- ``nccl_abort``: print a realistic NCCL async-error line, then ``os.abort()`` (SIGABRT)
- ``hang``: stop stepping and heartbeating forever (a silent hang)
- ``exit``: ``os._exit(1)`` (a rank that dies without a traceback)
- ``data_stall``: print one line, then sleep inside ``stalled_data_loading`` forever: a data
  loader stuck on a file system, while the other ranks wait in the step's all-reduce (the hang
  whose root the node agents find from the ranks' stacks)

``once`` fires only the first time over the whole run: a marker file under
``$SLURMKIT_RUN_DIR/faults/`` survives restarts, so the restarted job runs through.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from slurmkit.errors import ConfigError

KINDS = ("raise", "nccl_abort", "hang", "exit", "data_stall")
DATA_STALL_LINE = "injected fault: data_stall"  # printed before the sleep (tests wait for it)


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int  # fires before this step (1-based) is computed
    once: bool = False

    @property
    def marker_name(self) -> str:
        return f"{self.kind}-rank{self.rank}-step{self.step}.fired"


def parse_faults(spec: str) -> list[Fault]:
    """Parse ``SLURMKIT_FAULT``; an empty string means no faults."""
    faults = []
    for item in filter(None, (part.strip() for part in spec.split(";"))):
        parts = item.split(":")
        bad = len(parts) not in (3, 4) or parts[0] not in KINDS or (
            len(parts) == 4 and parts[3] != "once")
        if not bad:
            try:
                rank, step = int(parts[1]), int(parts[2])
            except ValueError:
                bad = True
        if bad:
            raise ConfigError(
                detected=f"SLURMKIT_FAULT item {item!r}",
                requirement=f"kind:rank:step[:once] with kind in {', '.join(KINDS)}",
                fix="e.g. SLURMKIT_FAULT='nccl_abort:1:5:once;hang:0:9'",
            )
        faults.append(Fault(parts[0], rank, step, once=len(parts) == 4))
    return faults


def nccl_error_line(rank: int) -> str:
    """The line ProcessGroupNCCL logs when a peer dies (matches the supervisor's classifier)."""
    return (f"[rank{rank}]:[E ProcessGroupNCCL.cpp:1234] [PG 0 Rank {rank}] NCCL error: "
            "remote process exited or there was a network error")


class FaultInjector:
    """Fires this rank's faults at their step; ``marker_dir`` holds the ``once`` markers."""

    def __init__(self, faults: list[Fault], *, rank: int, marker_dir: str | None,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.faults = [f for f in faults if f.rank == rank]
        self.rank = rank
        self.marker_dir = marker_dir
        self._sleep = sleep

    def _claim(self, fault: Fault) -> bool:
        """True if the fault should fire now (an unfired ``once`` fault is marked first)."""
        if not fault.once:
            return True
        if self.marker_dir is None:
            raise ConfigError(
                detected=f"a ':once' fault ({fault.kind}) without SLURMKIT_RUN_DIR",
                requirement="once-faults keep their marker under $SLURMKIT_RUN_DIR/faults/",
                fix="set SLURMKIT_RUN_DIR or drop ':once'",
            )
        os.makedirs(self.marker_dir, exist_ok=True)
        try:
            fd = os.open(os.path.join(self.marker_dir, fault.marker_name),
                         os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        os.close(fd)
        return True

    def before_step(self, step: int) -> None:
        """Call before computing ``step``; may raise, abort, exit or never return."""
        for fault in self.faults:
            if fault.step == step and self._claim(fault):
                self._fire(fault, step)

    def _fire(self, fault: Fault, step: int) -> None:
        if fault.kind == "raise":
            raise RuntimeError(f"injected fault: raise on rank {self.rank} at step {step}")
        if fault.kind == "nccl_abort":
            print(nccl_error_line(self.rank), file=sys.stderr, flush=True)
            sys.stdout.flush()
            os.abort()
        if fault.kind == "exit":
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        if fault.kind == "data_stall":
            print(f"{DATA_STALL_LINE} on rank {self.rank} before step {step}", flush=True)
            self.stalled_data_loading()
        while True:  # "hang": no step, no heartbeat, until the supervisor kills us
            self._sleep(3600.0)

    def stalled_data_loading(self) -> None:
        """Where a rank whose data loader is stuck sleeps (named so in its stack)."""
        while True:
            self._sleep(3600.0)
