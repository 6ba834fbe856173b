"""Who acts for node 0 once it is lost: one successor, elected through the run directory.

Node 0's loss takes the agents' store (and with it every channel between the agents) away, so
the survivors cannot agree through it. They agree through a few files of the run directory
instead, touched only on this failure path, never in the step loop:

- **The claim.** Node rank k leaves the ranks below it k-1 grace periods to claim the
  succession, then claims it itself with an exclusive create of ``<attempt>.successor``. The
  agent whose create succeeds is the successor; node rank 1 claims at once, so while it lives
  the others only watch; with node rank 1 lost as well, node rank 2 acts one grace period
  later, and so on.
- **Takeover.** A successor can die after its claim, before it recorded the failure and
  requeued. So the claimant keeps its claim fresh (it rewrites the claim's sequence number,
  in place, every poll) and the others watch it: a claim that has not changed for
  ``stall_s`` is given up, and the agents elect the next generation, ``<attempt>.successor.1``
  (then ``.2``, ...), with the same stagger counted from the stalled claimant's node rank, so
  the node rank just above it claims first. A claimant that finds a newer generation claimed
  leaves without acting. A claimant holds at most :data:`MAX_HOLD_S`; a hung one is replaced.
- **The outcome.** Whoever decided for the attempt (node 0 at its end, or the successor once
  it requeued or stopped) leaves ``<attempt>.done`` behind. An agent that finds the store gone
  reads it first: node 0 that completed, stopped or requeued the job is not lost, and a job it
  ended is never requeued again by a late agent (a slow spare still polling after node 0's
  exit barrier). Watchers of a claim leave once it appears.

Per agent and poll this costs O(1) file operations (the done marker, the current claim, the
next generation's name), on the failure path only. The run directory is shared and not
trusted: a claim or marker that is not a small regular file of this user (a link, someone
else's file) or holds garbage is refused with a Detected/Requirement/Fix message in the log and
treated as absent (a marker) or as a claim that never moves (a claim: it is taken over).

Every file is keyed by the attempt, like the rendezvous file, so a requeued job starts clean.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from slurmkit.atomic import atomic_write
from slurmkit.errors import ActionableError
from slurmkit.runfiles import RDZV_DIR
from slurmkit.untrusted import UntrustedDataError, parse_object

log = logging.getLogger(__name__)

#: Longest pause between two looks for a lower rank's claim (the grace period is the bound).
MAX_POLL_S = 1.0
#: The longest a successor holds its claim (the claim stops moving after it): its work is a few
#: bounded Slurm calls and ledger lines; one that is still at it is hung, and is replaced.
MAX_HOLD_S = 300.0
_MAX_FILE = 4096  # a claim or marker longer than this was not written by an agent
_RECORD_WIDTH = 512  # claims are rewritten in place at one width: a reader never sees them shrink
_MAX_NAME = 255


class SuccessionFileError(ActionableError):
    """A claim or done marker in the run directory that cannot be trusted."""


def claim_path(run_dir: str, attempt: str, generation: int = 0) -> str:
    name = f"{attempt}.successor" + (f".{int(generation)}" if generation else "")
    return os.path.join(run_dir, RDZV_DIR, name)


def done_path(run_dir: str, attempt: str) -> str:
    return os.path.join(run_dir, RDZV_DIR, f"{attempt}.done")


def _read_private(path: str) -> bytes | None:
    """The bytes of ``path``, None when it does not exist; SuccessionFileError when it is not
    a small regular file owned by this user (a link is never followed)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as exc:  # ELOOP: a symbolic link; EACCES: someone else's
        raise SuccessionFileError(f"cannot open {path}: {exc}",
                                  "a regular file written by one of this run's agents",
                                  f"remove {path} (someone may have planted it)") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SuccessionFileError(f"{path} is not a regular file", "a regular file written by one of "
                                      "this run's agents", f"remove {path} (someone may have planted it)")
        if st.st_uid != os.getuid():
            raise SuccessionFileError(f"{path} is owned by uid {st.st_uid}, not by this user ({os.getuid()})",
                                      "only the run's owner writes its succession files",
                                      f"remove {path} (someone else may have planted it)")
        if st.st_size > _MAX_FILE:
            raise SuccessionFileError(f"{path} holds {st.st_size} bytes", "a short record of an agent",
                                      f"remove {path}")
        return os.read(fd, _MAX_FILE)
    finally:
        os.close(fd)


def _record(raw: bytes | None, path: str) -> dict[str, object] | None:
    """The JSON object in ``raw``; SuccessionFileError for garbage (None: still empty)."""
    if raw is None or not raw.strip():
        return None
    try:  # within limits: 2,000 brackets nest past Python's recursion limit, 4,000 digits are an int
        return parse_object(raw, max_bytes=_MAX_FILE)
    except UntrustedDataError as exc:
        raise SuccessionFileError(f"{path} does not hold an agent's record ({exc}: {raw[:40]!r})",
                                  "the JSON object an agent wrote", f"remove {path}") from None


def _name(value: object) -> str:
    if not isinstance(value, str) or not value or len(value) > _MAX_NAME or not value.isprintable():
        raise TypeError(f"not a node name: {value!r}"[:80])
    return value


def _claimant(path: str) -> tuple[str, int] | None:
    """(node, node rank) of a claim; None when empty or unreadable (refusals are raised)."""
    data = _record(_read_private(path), path)
    if data is None:
        return None
    try:
        rank = data["node_rank"]
        if not isinstance(rank, int) or rank < 0:
            raise TypeError(f"not a node rank: {rank!r}")
        return _name(data["node"]), rank
    except (KeyError, TypeError) as exc:
        raise SuccessionFileError(f"{path} holds a malformed claim ({exc})", "node and node rank",
                                  f"remove {path}") from None


def read_claim(path: str) -> str:
    """Who claimed (``node (node rank k)``), for messages; "" when unreadable or still empty."""
    try:
        who = _claimant(path)
    except SuccessionFileError:
        return ""
    return f"{who[0]} (node rank {who[1]})" if who else ""


# ------------------------------------------------------------------ the outcome marker
@dataclass(frozen=True)
class Done:
    """What the attempt's decision maker did before it left (``<attempt>.done``)."""

    outcome: str  # the supervisor state it left in: completed, requeueing, stopped, ...
    exit_code: int
    node: str  # who wrote it
    node_rank: int


def write_done(run_dir: str, attempt: str, done: Done) -> None:
    """Leave the marker (atomically: a temporary file renamed over it). A failure to write is
    logged, never raised: the decision maker is leaving, and a late agent without the marker
    still acts (as before the marker existed)."""
    path = done_path(run_dir, attempt)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        atomic_write(path, json.dumps({"outcome": done.outcome, "exit_code": done.exit_code, "node": done.node,
                                       "node_rank": done.node_rank, "t": time.time()}), mode=0o600)
    except OSError as exc:
        log.error("could not leave the done marker %s: %s", path, exc)


def clear_done(run_dir: str, attempt: str) -> None:
    """Node 0, as the attempt starts: a marker of an earlier run under this attempt's name
    (a reused run directory in local mode) must not make a loss look like an end."""
    try:
        os.unlink(done_path(run_dir, attempt))
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.error("could not remove the old done marker: %s", exc)


def read_done(run_dir: str, attempt: str) -> Done | None:
    """The marker; None when absent. One that cannot be trusted is refused in the log and
    counts as absent: the agent then acts as if node 0 were lost, the safe side (a successor
    that requeues a job Slurm requeued already does not requeue it again)."""
    path = done_path(run_dir, attempt)
    try:
        data = _record(_read_private(path), path)
        if data is None:
            return None
        code, rank = data["exit_code"], data["node_rank"]
        if not isinstance(code, int) or not 0 <= code <= 255 or not isinstance(rank, int) or rank < 0:
            raise TypeError(f"exit code {code!r}, node rank {rank!r}")
        return Done(_name(data["outcome"]), code, _name(data["node"]), rank)
    except (KeyError, TypeError) as exc:
        log.error("%s", SuccessionFileError(f"{path} holds a malformed done marker ({exc})",
                                            "outcome, exit code, node, node rank", f"remove {path}"))
    except SuccessionFileError as exc:
        log.error("%s", exc)
    return None


# ------------------------------------------------------------------ the claim
class Claim:
    """A claim this agent won: it acts for node 0. ``keep_fresh`` rewrites the claim's sequence
    number while it acts, so the others know it lives; ``superseded``: the others gave it up."""

    def __init__(self, run_dir: str, attempt: str, generation: int, fd: int, node: str, node_rank: int) -> None:
        self.run_dir, self.attempt, self.generation = run_dir, attempt, generation
        self.path = claim_path(run_dir, attempt, generation)
        self.node, self.node_rank = node, node_rank
        self._fd: int | None = fd
        self._seq = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.refresh()

    def refresh(self) -> None:
        with self._lock:
            if self._fd is None:
                return
            self._seq += 1
            rec = json.dumps({"node_rank": self.node_rank, "node": self.node, "pid": os.getpid(),
                              "generation": self.generation, "seq": self._seq, "t": time.time()})
            try:
                os.pwrite(self._fd, rec.ljust(_RECORD_WIDTH).encode(), 0)
                os.fsync(self._fd)
            except OSError as exc:  # the others may take over; superseded() then says so
                log.warning("could not refresh the succession claim %s: %s", self.path, exc)

    def keep_fresh(self, interval_s: float, max_hold_s: float = MAX_HOLD_S) -> Claim:
        def run() -> None:
            deadline = time.monotonic() + max_hold_s
            while not self._stop.wait(interval_s) and time.monotonic() < deadline:
                self.refresh()

        self._thread = threading.Thread(target=run, name="succession-claim", daemon=True)
        self._thread.start()
        return self

    def superseded(self) -> bool:
        """Whether the others gave this claim up and claimed the next generation."""
        return os.path.lexists(claim_path(self.run_dir, self.attempt, self.generation + 1))

    def release(self) -> None:
        """Stop refreshing (the claim stays: the done marker says how it ended)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def _create(path: str) -> int | None:
    """O_CREAT|O_EXCL: of any agents that try at once exactly one gets the fd, on a local disk
    and on NFS v3+ or Lustre alike. Anything already at the path (a link too) makes it fail."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        return None


def elect(path: str, node_rank: int, node: str, *, grace_s: float,
          clock: Callable[[], float] = time.monotonic,
          sleep: Callable[[float], None] = time.sleep) -> bool:
    """True when this agent (``node_rank`` >= 1) wins the claim at ``path`` (one generation,
    no takeover: :func:`succeed` is the whole protocol).

    It waits ``(node_rank - 1) * grace_s`` for a claim by a lower node rank, then claims.
    """
    deadline = clock() + max(node_rank - 1, 0) * grace_s
    poll_s = min(max(grace_s / 4, 0.01), MAX_POLL_S)
    while not os.path.lexists(path):
        left = deadline - clock()
        if left <= 0:
            break
        sleep(min(poll_s, left))
    else:
        return False
    fd = _create(path)
    if fd is None:
        return False
    os.write(fd, json.dumps({"node_rank": node_rank, "node": node, "pid": os.getpid(), "t": time.time()}).encode())
    os.close(fd)
    return True


@dataclass(frozen=True)
class Watched:
    """This agent did not act: the successor (or node 0) finished, as its marker says."""

    done: Done


def succeed(run_dir: str, attempt: str, node_rank: int, node: str, n_nodes: int, *, grace_s: float,
            stall_s: float, clock: Callable[[], float] = time.monotonic,
            sleep: Callable[[float], None] = time.sleep) -> Claim | Watched:
    """Run the succession (module docstring) until this agent holds a claim (it acts; call
    ``keep_fresh`` and ``release``) or the done marker says someone else finished. Bounded:
    each claim either moves to the marker or is given up after ``stall_s`` (at most
    :data:`MAX_HOLD_S` while it moves), and every generation is claimed by another agent."""
    poll_s = min(max(grace_s / 4, 0.01), MAX_POLL_S)
    generation, after_rank = 0, 0  # the generation to claim; whose stalled claim it follows
    since = clock()  # when this generation became open (as this agent saw it)
    refused: set[str] = set()
    last: bytes | None = None
    moved = since  # when the current claim last changed
    watching = False
    while True:
        done = read_done(run_dir, attempt)
        if done is not None:
            return Watched(done)
        path = claim_path(run_dir, attempt, generation)
        if os.path.lexists(claim_path(run_dir, attempt, generation + 1)):
            # A newer generation was claimed (this agent came late, or others gave this one up).
            generation, since, watching = generation + 1, clock(), False
            continue
        if not watching and os.path.lexists(path):
            watching, last, moved = True, None, clock()
        if watching:
            try:
                raw = _read_private(path)
            except SuccessionFileError as exc:  # never moves: taken over after stall_s
                if path not in refused:
                    refused.add(path)
                    log.error("%s", exc)
                raw = b"<refused>"
            if raw != last:
                last, moved = raw, clock()
            elif clock() - moved >= stall_s:
                try:
                    who = _claimant(path)
                except SuccessionFileError:
                    who = None
                after_rank = who[1] if who else 0
                log.error("succession claim %s has not moved for %.1f s: claiming generation %d",
                          path, clock() - moved, generation + 1)
                generation, since, watching = generation + 1, clock(), False
                continue
        else:
            # The node rank just above the claimant being followed goes first (node 0 at first).
            order = (node_rank - after_rank) % n_nodes or n_nodes
            if clock() - since >= (order - 1) * grace_s:
                fd = _create(path)
                if fd is not None:
                    return Claim(run_dir, attempt, generation, fd, node, node_rank)
                continue  # someone else was first: watch it
        sleep(poll_s)
