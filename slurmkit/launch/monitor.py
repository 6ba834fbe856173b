"""Watch one node's ranks: their log lines, exits and heartbeats become Evidence.

Lines arrive on the tee threads, exits on waiter threads (so each has an exact time), and
heartbeats are read by ``poll`` from the files the ranks replace atomically. Those files are
node-local (slurmkit.train.heartbeat.node_local_dir: /dev/shm): a poll costs a few local
reads per rank and nothing on the shared file system, however often it runs.

A program that never beats but prints its steps (torchtitan's metric line, a user's
``job.progress_pattern``; slurmkit.launch.programwatch reads rank 0's lines) is timed by those
lines instead (:meth:`RankMonitor.on_progress`): once two step lines came, no new one for
:data:`LINE_GAP_FACTOR` times the longest gap seen between two of them (at least
``heartbeat_timeout_s``) is a hang. A program logs every Kth step (torchtitan's
``--metrics.log_freq``, 10): the gap it keeps is its own measure. A save it announces (torchtitan's
``Saving the checkpoint`` ... ``Finished saving``) stops that clock until it is over.

A beat that names a phase (slurmkit.userapi.report_phase: an evaluation loop, a save) is a sign
of life without a new step: each new one restarts the clock, and while the last one says
``saving`` the clock stands (a save calls nothing until it is over).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

from slurmkit.contract import EXIT_CHECKPOINTED_ON_SIGNAL  # saved on SIGUSR1/SIGTERM, left on purpose
from slurmkit.contract import MAX_PHASE, PHASE_SAVING
from slurmkit.failures.classes import FailureClass
from slurmkit.failures.classify import DETAIL_LIMIT, Evidence, classify_exit, classify_line, telling_line
from slurmkit.untrusted import UntrustedDataError, parse_object, read_regular

log = logging.getLogger(__name__)

BEAT_BYTES = 64 * 1024  # one beat: {rank, step, time, pid, generation} and the trainer's sections
# A rank's last lines kept for its exit's evidence (the line that says why it died, a traceback's
# last line among them, often comes after a tear-down warning or two, and torchrun's summary
# box), each cut to DETAIL_LIMIT characters: at most 16 KB per rank, whatever it prints.
TAIL_LINES = 32
#: A program timed by its step lines: a hang after this many times its longest gap between two.
LINE_GAP_FACTOR = 3.0

# Lines that announce a failure on their own, before the rank dies (PyTorch sleeps after an
# NCCL error to let dumps finish: acting on the line saves that time). A GPU OOM is not one: a
# trainer may catch it and retry smaller; its rank's exit ends the generation (classify's
# CONFIRM_BY_EXIT). A hardware fault is: the node leaves the job whatever the rank does next
# (a GPU off the bus may leave it stuck in a CUDA call until the hang timeout).
TRIGGERING_LINES = frozenset({FailureClass.NCCL_TIMEOUT, FailureClass.NCCL_ERROR,
                              FailureClass.WATCHDOG_STUCK, FailureClass.HOST_OOM,
                              FailureClass.GPU_FAULT})


@dataclass
class _RankWatch:
    rank: int
    pid: int
    heartbeat_path: str
    started: float  # monotonic
    started_wall: float = 0.0  # epoch seconds at add_rank: older beats are a previous process's
    last_step: int | None = None
    last_change: float = 0.0  # monotonic time the step last advanced
    last_beat_wall: float = 0.0
    exit_code: int | None = None
    hang_reported: bool = False
    stopped_since: float | None = None  # monotonic: first poll that found it stopped (state T)
    refused: str = ""  # why its file was last refused (logged once per reason, not per poll)
    line_step: int | None = None  # the newest step its printed lines gave (a program that never beats)
    line_change: float = 0.0  # monotonic: when that step came (or its announced save ended)
    line_wall: float = 0.0
    line_gap: float = 0.0  # the longest time between two step lines so far (0: one line yet)
    saving: bool = False  # between the program's "saving" and "finished saving" lines
    beat_saving: bool = False  # its last beat said phase "saving" (slurmkit.userapi.report_phase)


def _proc_state(pid: int) -> str:
    """One-letter process state from /proc ('T' = stopped); '' when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


class RankMonitor:
    def __init__(self, node: str, generation: int, *, heartbeat_timeout_s: float,
                 startup_timeout_s: float, require_heartbeat: bool = True,
                 wall: Callable[[], float] = time.time,
                 mono: Callable[[], float] = time.monotonic,
                 proc_state: Callable[[int], str] = _proc_state) -> None:
        self.node = node
        self.generation = generation
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.startup_timeout_s = startup_timeout_s
        # False: a rank without a first beat is no hang by the clock (failures.programs.expects_heartbeats).
        self.require_heartbeat = require_heartbeat
        self._wall, self._mono, self._proc_state = wall, mono, proc_state
        self._lock = threading.Lock()
        self._ranks: dict[int, _RankWatch] = {}
        self._early_exits: dict[int, int] = {}  # exits seen before add_rank (a rank that died at once)
        self._tails: dict[int, deque[str]] = {}  # rank -> its last TAIL_LINES lines
        self._exit_at: dict[int, int] = {}  # rank -> index in ``evidence`` of its exit
        self.evidence: list[Evidence] = []
        self.triggered: Evidence | None = None  # the first evidence that ends the generation

    def add_rank(self, rank: int, pid: int, heartbeat_path: str) -> None:
        # The waiter thread starts before add_rank is called: a rank that exits at once reports
        # its exit first. Keep that exit, else the rank would later be taken for a hang.
        with self._lock:
            watch = _RankWatch(rank, pid, heartbeat_path, started=self._mono(),
                               started_wall=self._wall(), exit_code=self._early_exits.pop(rank, None))
            self._ranks[rank] = watch

    def _record(self, ev: Evidence, trigger: bool) -> None:
        with self._lock:
            self.evidence.append(ev)
            if trigger and self.triggered is None:
                self.triggered = ev

    def state_of(self, pid: int) -> str:
        """The process's one-letter state ('T' = stopped, '' = gone), as the hang checks read it."""
        return self._proc_state(pid)

    def report(self, ev: Evidence) -> None:
        """Evidence the agent found itself (a failed pre-flight): it ends the generation."""
        self._record(ev, True)

    # ------------------------------------------------------------ callbacks from threads
    def on_line(self, rank: int, line: str) -> None:
        with self._lock:
            tail = self._tails.get(rank)
            if tail is None:
                tail = self._tails[rank] = deque(maxlen=TAIL_LINES)
            tail.append(line[:DETAIL_LIMIT])
            if rank in self._exit_at:
                # The pipe is read after the process ended: its last lines come after its exit.
                self._update_last_line(rank)
        cls = classify_line(line)
        if cls is not None:
            self._record(Evidence(self._wall(), self.node, rank, "line", cls, line.strip()),
                         cls in TRIGGERING_LINES)

    def on_progress(self, rank: int, step: int | None, *, saving: bool | None = None) -> None:
        """What one of rank ``rank``'s printed lines says (its adapter read it): the step it
        names (None: none), and whether it starts (True) or ends (False) an announced save
        (None: neither). Called from the rank's reader thread."""
        now = self._mono()
        with self._lock:
            w = self._ranks.get(rank)
            if w is None or w.exit_code is not None:
                return
            if saving is not None:
                if w.saving and not saving:
                    w.line_change = now  # the save's own time is no gap between steps
                w.saving = saving
            if step is None or step == w.line_step:
                return
            if w.line_step is not None:
                w.line_gap = max(w.line_gap, now - w.line_change)
            w.line_step, w.line_change, w.line_wall = step, now, self._wall()

    def _update_last_line(self, rank: int) -> None:
        """The exit evidence of ``rank`` with its newest telling line (the lock held)."""
        at = self._exit_at[rank]
        old = self.evidence[at]
        new = replace(old, last_line=telling_line(self._tails.get(rank, ())))
        if new.last_line != old.last_line:
            self.evidence[at] = new
            if self.triggered is old:
                self.triggered = new

    def on_exit(self, rank: int, returncode: int) -> None:
        with self._lock:
            w = self._ranks.get(rank)
            if w is not None:
                w.exit_code = returncode
            else:
                self._early_exits[rank] = returncode
        if returncode in (0, EXIT_CHECKPOINTED_ON_SIGNAL):
            return
        cls = classify_exit(returncode)
        if cls is None:  # cannot happen for a non-zero code; never let a waiter thread raise
            return
        with self._lock:
            ev = Evidence(self._wall(), self.node, rank, "exit", cls, f"returncode {returncode}", returncode,
                          last_line=telling_line(self._tails.get(rank, ())))
            self.evidence.append(ev)
            self._exit_at[rank] = len(self.evidence) - 1
            if self.triggered is None:
                self.triggered = ev

    # ------------------------------------------------------------ polled
    def poll(self) -> dict[int, dict[str, object]]:
        """Read heartbeats; report hangs. Returns the latest beat per rank (for the ledger)."""
        now = self._mono()
        beats: dict[int, dict[str, object]] = {}
        for w in self._ranks.values():
            if w.exit_code is not None:
                continue
            try:
                got = self._current_beat(w)
            except Exception as exc:  # a reader's bug must never end the node's agent
                self._refuse(w, f"unreadable: {exc!r:.200}")
                got = None
            if got is not None:
                beat, step, written = got
                beats[w.rank] = beat
                phase = beat.get("phase")
                busy = isinstance(phase, str) and phase.isidentifier() and len(phase) <= MAX_PHASE
                if step != w.last_step or (busy and written > w.last_beat_wall):
                    # a new step, or a new sign of life outside the steps (an evaluation loop)
                    w.last_step, w.last_change = step, now
                    w.last_beat_wall = written
                w.beat_saving = busy and phase == PHASE_SAVING
            self._check_hang(w, now)
        return beats

    def final_step(self, rank: int) -> int | None:
        """The newest step ``rank`` beat, read once more from its file (a rank that exited
        after the last poll); None when it never beat."""
        w = self._ranks.get(rank)
        if w is None:
            return None
        try:
            got = self._current_beat(w)
        except Exception:  # noqa: BLE001 - as in poll: a reader's bug must never end the agent
            got = None
        return got[1] if got is not None else w.last_step

    def _current_beat(self, w: _RankWatch) -> tuple[dict[str, object], int, float] | None:
        """The rank's beat (with its step and time) if this process wrote it. A requeued job
        starts again at generation 0, and its heartbeat files still hold the last beats of the
        previous allocation: those are older than the rank, and taking them would start the hang
        timer before the first step."""
        try:
            beat = _read_beat(w.heartbeat_path)
        except UntrustedDataError as exc:
            self._refuse(w, str(exc))
            return None
        if beat is None or str(beat.get("generation")) != str(self.generation):
            return None
        # Written by any program (the file's path is in $SLURMKIT_HEARTBEAT_FILE): a beat
        # without an integer step or a numeric time is no beat, never the agent's crash.
        step, written = beat.get("step"), beat.get("time")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            self._refuse(w, f"step={step!r:.40} is not a step")
            return None
        if isinstance(written, bool) or not isinstance(written, (int, float)) or not math.isfinite(written):
            self._refuse(w, f"time={written!r:.40} is not a time")
            return None
        w.refused = ""
        if written < w.started_wall:
            return None
        return beat, step, float(written)

    def _refuse(self, w: _RankWatch, why: str) -> None:
        """Name a refused heartbeat in the agent's log, once per reason (not on every poll)."""
        if why != w.refused:
            w.refused = why
            log.warning("rank %d: heartbeat %s refused: %s", w.rank, w.heartbeat_path, why)

    def _check_hang(self, w: _RankWatch, now: float) -> None:
        if w.hang_reported:
            return
        if w.beat_saving:  # a save calls nothing until it is over: its clock restarts after it
            w.last_change = now
            return
        if w.last_step is None and w.line_gap > 0 and not w.saving:
            self._check_lines(w, now)
            return
        if w.last_step is None and not self.require_heartbeat:
            self._check_stopped(w, now)
            return
        if w.last_step is None:
            if now - w.started <= self.startup_timeout_s:
                return
            detail = f"no heartbeat {now - w.started:.1f} s after start"
            when = self._wall()
        else:
            if now - w.last_change <= self.heartbeat_timeout_s:
                return
            detail = f"no step after step {w.last_step} for {now - w.last_change:.1f} s"
            when = w.last_beat_wall
        if self._proc_state(w.pid) == "T":
            # A stopped process is where a hang starts: its peers stall behind it.
            detail += " (process stopped, state T)"
            when -= 1.0
        w.hang_reported = True
        self._record(Evidence(when, self.node, w.rank, "heartbeat", FailureClass.HANG, detail), True)

    def _check_lines(self, w: _RankWatch, now: float) -> None:
        """A program timed by its step lines (it never beat): no new step for LINE_GAP_FACTOR
        times its longest gap so far, at least heartbeat_timeout_s."""
        with self._lock:
            step, since, gap, wall = w.line_step, now - w.line_change, w.line_gap, w.line_wall
        limit = max(self.heartbeat_timeout_s, LINE_GAP_FACTOR * gap)
        if since <= limit:
            return
        detail = (f"no step line after step {step} for {since:.1f} s (the program's own output; "
                  f"its longest gap between two so far {gap:.1f} s)")
        if self._proc_state(w.pid) == "T":
            detail += " (process stopped, state T)"
            wall -= 1.0
        w.hang_reported = True
        self._record(Evidence(wall, self.node, w.rank, "heartbeat", FailureClass.HANG, detail), True)

    def _check_stopped(self, w: _RankWatch, now: float) -> None:
        """A rank that never beats is a hang only by its process state: stopped (SIGSTOP, a
        debugger, a job-control stop) for longer than heartbeat_timeout_s. One /proc read of a
        node-local pseudo file per poll and rank."""
        if self._proc_state(w.pid) != "T":
            w.stopped_since = None
            return
        if w.stopped_since is None:
            w.stopped_since = now
        if now - w.stopped_since <= self.heartbeat_timeout_s:
            return
        w.hang_reported = True
        detail = (f"process stopped (state T) for {now - w.stopped_since:.1f} s, no heartbeat yet "
                  "(supervisor.require_heartbeat: this program is not required to beat)")
        self._record(Evidence(self._wall() - 1.0, self.node, w.rank, "heartbeat", FailureClass.HANG, detail), True)


def _read_beat(path: str) -> dict[str, object] | None:
    """The beat at ``path``; None when there is none yet (or it is being replaced), and
    UntrustedDataError when what is there is not a beat (not a regular file, not a JSON object
    within slurmkit.untrusted's limits)."""
    try:
        return parse_object(read_regular(path, BEAT_BYTES), max_bytes=BEAT_BYTES)
    except OSError:
        return None
