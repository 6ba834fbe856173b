"""What the agent of rank 0's node learns from a third-party program without changing it.

The reference trainer beats, writes its metrics and saves through slurmkit's store. Any other
program under ``job.command`` (torchtitan, Lightning, a torchrun script) may do none of that
and still tell a lot: rank 0 prints its step and loss, and the program saves checkpoints in its
own folder. ``job.program`` picks the adapter that reads them (slurmkit.adapters; ``auto``
recognises it from the command), ``job.progress_pattern`` a regex for any other program's
lines, ``job.checkpoint_glob`` where its saves are.

- **Progress**: rank 0's output lines, as the agent reads them anyway (for NCCL lines), go
  through the adapter; the newest step, loss, tokens/s and MFU ride in this node's ``heartbeat``
  ledger sample, as figures reported with slurmkit.userapi do. Nothing more is read per step.
- **Generations**: the first step line of a generation records its ``train_started`` (the step
  it resumed from: its newest finished save), and the agent's last sample when the generation is
  stopped holds the newest step: the report's segments, goodput and steps lost, as for the
  reference trainer.
- **Hangs**: a program that never beats is timed by the steps its lines name
  (slurmkit.launch.monitor.RankMonitor.on_progress), a save it announces not counted.
- **Checkpoint credit**: every ``CKPT_SCAN_S`` the program's checkpoint folder is listed
  (bounded, untrusted: slurmkit.adapters.checkpoints). A finished save newer than the last one
  is recorded exactly as ``userapi.report_checkpoint`` records it: the progress marker node 0's
  crash-loop rule reads, and a ``ckpt_saved`` event of the ``user`` tier. One listing per 5 s
  on one node, whatever the job's size, and one more when a line says a save ended
  (torchtitan's "Finished saving"), so that a save is credited (and adopted: ``store.adopt``)
  within a poll of its end.

What the program does not print or save stays unknown: never a 0.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

from slurmkit import adapters
from slurmkit.adapters.command import LIGHTNING, NONE, REFERENCE, TORCHTITAN
from slurmkit.failures.programs import is_reference_trainer

log = logging.getLogger(__name__)
CKPT_SCAN_S = 5.0  # how often rank 0's node lists the program's checkpoint folder


class JobSettings(Protocol):
    command: list[str]
    program: str
    progress_pattern: str
    checkpoint_glob: str


class Heard(NamedTuple):
    """What one of rank 0's lines told: the step it names (None: none), and whether it starts
    (True) or ends (False) a save the program announces (None: neither)."""

    step: int | None
    saving: bool | None


class ProgramWatch:
    """The adapter of one job's program, fed rank 0's lines, asked for what it learned."""

    def __init__(self, adapter: str, *, command: Sequence[str], run_dir: str, pattern: str = "",
                 glob: str = "", clock: Callable[[], float] = time.monotonic) -> None:
        self.adapter = adapter
        self.pattern = adapters.compile_pattern(pattern) if pattern else None
        self.total = adapters.total_steps(adapter, command)
        self.glob: str | None = None
        if glob:
            folder, self.glob = adapters.split_glob(glob, run_dir)
            self.folders = [folder]
        else:
            self.folders = adapters.checkpoint_dirs(adapter, command, run_dir)
        self.latest: adapters.Progress | None = None
        self.step: int | None = None  # the newest step a line gave (a Lightning bar gives none)
        self.saved: int | None = None  # the newest checkpoint step recorded
        self._clock = clock
        self._scan_at = float("-inf")
        self._primed = False
        self._started = False  # this generation's train_started is recorded

    @classmethod
    def for_job(cls, job: JobSettings, run_dir: str) -> ProgramWatch | None:
        """None where there is nothing to read: the reference trainer (it reports itself) and
        ``job.program=none`` without a pattern or a glob."""
        command = [str(a) for a in job.command]
        adapter = adapters.resolve(job.program, command, reference_trainer=is_reference_trainer(command))
        if adapter == REFERENCE or (adapter not in (TORCHTITAN, LIGHTNING) and not job.progress_pattern
                                    and not job.checkpoint_glob):
            return None
        return cls(adapter, command=command, run_dir=run_dir, pattern=job.progress_pattern,
                   glob=job.checkpoint_glob)

    @property
    def reads_lines(self) -> bool:
        return self.pattern is not None or self.adapter in (TORCHTITAN, LIGHTNING)

    def on_line(self, rank: int, line: str) -> Heard | None:
        """A line rank ``rank`` printed (called from the rank's reader thread); what it told
        of the program's progress (for the rank monitor's clock), None when nothing."""
        if rank != 0 or not self.reads_lines:
            return None
        saving = adapters.save_phase(self.adapter, line)
        if saving is False:  # a save the program announces ended: its folder is listed at the next look
            self._scan_at = float("-inf")
        got = adapters.parse_line(self.adapter if self.pattern is None else NONE, line, self.pattern)
        if got is None:
            return None if saving is None else Heard(None, saving)
        if got.step is not None:
            self.step = got.step
        self.latest = got  # one reference assignment: the agent's thread reads the whole sample
        return Heard(got.step, saving)

    def begin_generation(self) -> None:
        """A new generation's ranks start: what the lines said of the last one is not theirs
        (the newest save is kept: the program resumes from it), and its folder is listed at the
        next look, so that a save finished just before the failure is known."""
        self.step = None
        self.latest = None
        self._started = False
        self._scan_at = float("-inf")

    def generation_start(self) -> int | None:
        """Once per generation, when its first step line came: the step it resumed from, for
        the ``train_started`` event the report's segments, goodput and steps lost are read
        from. The program resumes from its newest finished save (docs/trainers.md): that one,
        0 when none, where its folder is known; else the step before its first line (a lower
        bound of the work kept, exact for a program that prints every step). None otherwise."""
        step = self.step
        if self._started or step is None:
            return None
        self._started = True
        if self.folders:
            return self.saved if self.saved is not None and self.saved <= step else 0
        return max(0, step - 1)

    def sample(self) -> dict[str, Any]:
        """What rank 0's heartbeat sample gets from the lines: its step (when a line gave one),
        figures, the total its command names; {} when nothing is known."""
        out: dict[str, Any] = {}
        latest = self.latest
        if self.step is not None:
            out["step"] = self.step
        if latest is not None:
            figures = {k: getattr(latest, k) for k in ("loss", "tokens_per_s", "mfu", "tflops")}
            figures = {k: v for k, v in figures.items() if v is not None}
            if figures:
                out["metrics"] = figures
        if self.total is not None:
            out["total_steps"] = self.total
        return out

    def new_checkpoints(self) -> list[tuple[int, str]]:
        """The program's finished saves newer than the last recorded one, oldest first; lists
        its folders at most every CKPT_SCAN_S (else []). The first listing (the agent's start,
        before its ranks could save) only notes the newest save already there: an earlier
        allocation's, recorded then."""
        if not self.folders or self._clock() - self._scan_at < CKPT_SCAN_S:
            return []
        self._scan_at = self._clock()
        found: list[tuple[int, str]] = []
        for folder in self.folders:
            try:
                found += adapters.complete_checkpoints(self.adapter, folder, self.glob)
            except Exception as exc:  # noqa: BLE001 - a reader's bug must never end the agent
                log.warning("cannot list the program's checkpoints in %s: %r", folder, exc)
        if not self._primed:  # what was there when this agent started is not this allocation's
            self._primed = True
            self.saved = max((s for s, _ in found), default=None)
            return []
        newer = sorted((s, p) for s, p in found if self.saved is None or s > self.saved)
        if newer:
            self.saved = newer[-1][0]
        return newer
