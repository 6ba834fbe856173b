"""Start one rank as a child process and tee its output, line by line, to its own log."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

LineSink = Callable[[int, str], None]  # (global rank, line without newline)


@dataclass
class RankProcess:
    rank: int
    local_rank: int
    proc: subprocess.Popen[bytes]
    log_path: str
    reader: threading.Thread = field(repr=False)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def signal(self, sig: int) -> None:
        """Signal the rank's whole process group (it may have children of its own): for
        stopping it, where nothing of the rank may stay behind."""
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def notify(self, sig: int) -> None:
        """Signal the rank's own process only: for a warning it is to act on (SIGUSR1 before
        the time limit). Its children (DataLoader workers, a compiler's helpers) never installed
        a handler, and the default action of SIGUSR1 is to terminate: signalled as a group, they
        died and the rank failed with them instead of checkpointing."""
        try:
            os.kill(self.proc.pid, sig)
        except ProcessLookupError:
            pass


#: The most of one line held in the agent's memory: a rank that prints megabytes without a
#: newline (a progress bar redrawn with \r for hours, a dump of binary data) is written to its
#: log and passed to the sink in pieces of this size, never buffered whole.
MAX_LINE_BYTES = 1 << 20


def _tee(rank: int, stream, path: str, sink: LineSink | None) -> None:
    with open(path, "ab", buffering=0) as out:
        for raw in iter(lambda: stream.readline(MAX_LINE_BYTES), b""):
            out.write(raw)
            if sink is not None:
                try:
                    sink(rank, raw.decode("utf-8", "replace").rstrip("\n"))
                except Exception:  # a broken scanner must never stop the log from being written
                    log.exception("line sink failed on rank %d", rank)
    stream.close()


def _wait(rank: int, proc: subprocess.Popen[bytes], on_exit: Callable[[int, int], None]) -> None:
    code = proc.wait()
    try:
        on_exit(rank, code)
    except Exception:  # the exit must still be seen by the polling loop; log and go on
        log.exception("exit callback failed on rank %d", rank)


def spawn_rank(argv: Sequence[str], env: Mapping[str, str], *, rank: int, local_rank: int,
               log_path: str, sink: LineSink | None = None, cwd: str | None = None,
               on_exit: Callable[[int, int], None] | None = None) -> RankProcess:
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    proc = subprocess.Popen(list(argv), env=dict(env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True, cwd=cwd)
    return watch_rank(proc, rank=rank, local_rank=local_rank, log_path=log_path, sink=sink, on_exit=on_exit)


def watch_rank(proc: subprocess.Popen[bytes], *, rank: int, local_rank: int, log_path: str,
               sink: LineSink | None = None,
               on_exit: Callable[[int, int], None] | None = None) -> RankProcess:
    """A started rank process (its own session, output piped) as a RankProcess: its output teed
    to ``log_path`` and ``sink``, its exit reported to ``on_exit``. A warm standby that becomes
    a rank (slurmkit.launch.standby) is watched from then on, as a rank spawned cold."""
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    assert proc.stdout is not None  # noqa: S101 - guaranteed by stdout=PIPE
    reader = threading.Thread(target=_tee, args=(rank, proc.stdout, log_path, sink),
                              name=f"tee-rank{rank}", daemon=True)
    reader.start()
    if on_exit is not None:
        threading.Thread(target=_wait, args=(rank, proc, on_exit), name=f"wait-rank{rank}",
                         daemon=True).start()
    return RankProcess(rank=rank, local_rank=local_rank, proc=proc, log_path=log_path, reader=reader)


def stop_ranks(ranks: Sequence[RankProcess], *, grace_s: float, sleep: Callable[[float], None],
               clock: Callable[[], float]) -> None:
    """SIGTERM every live rank, SIGKILL what is left after ``grace_s``; reap them all."""
    for r in ranks:
        if r.poll() is None:
            r.signal(signal.SIGCONT)  # a stopped (SIGSTOP) rank cannot act on SIGTERM
            r.signal(signal.SIGTERM)
    deadline = clock() + grace_s
    while clock() < deadline and any(r.poll() is None for r in ranks):
        sleep(0.05)
    for r in ranks:
        if r.poll() is None:
            r.signal(signal.SIGKILL)
    for r in ranks:
        r.proc.wait()
        r.reader.join(timeout=5)
