"""The flight recorder's trace on request, for any process-group backend.

torch records every collective a process group issues in a ring buffer (the flight recorder,
``TORCH_FR_BUFFER_SIZE`` entries, which the node agent sets). ProcessGroupNCCL dumps it itself
when its FIFO is written to (``TORCH_FR_DEBUG_INFO_PIPE_FILE``); gloo has no such FIFO, so a
hung CPU job left no trace. The reference trainer therefore serves one of its own:

- the agent names a node-local FIFO (``$SLURMKIT_FR_PIPE``) and a node-local output file
  (``$SLURMKIT_FR_FILE``) per rank and generation;
- a daemon thread reads the FIFO, and for each write dumps the recorder as JSON (never a
  pickle: the agent reads it, and nothing read from a file may run code) to the output file,
  whole (written beside it, then renamed);
- the thread runs while the main thread is blocked inside a collective or a device wait, since
  torch releases the GIL there; a stopped rank answers once the agent continues it.

Nothing of this runs per step: one thread blocked in ``read`` until a hang is being examined.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Callable, Mapping

from slurmkit.atomic import atomic_write

PIPE_ENV = "SLURMKIT_FR_PIPE"
FILE_ENV = "SLURMKIT_FR_FILE"


def dumper(backend: str) -> Callable[[], bytes] | None:
    """The recorder's JSON dump for ``backend`` in this torch build, None when it has none."""
    try:
        import torch._C._distributed_c10d as c10d
    except ImportError:
        return None
    names = ("_dump_nccl_trace_json", "_dump_fr_trace_json") if backend == "nccl" else ("_dump_fr_trace_json",)
    found = [fn for name in names if (fn := getattr(c10d, name, None)) is not None]
    if not found:
        return None

    def dump() -> bytes:
        return bytes(found[0](includeCollectives=True, onlyActive=False))
    return dump


def write_whole(path: str, data: bytes) -> None:
    """``data`` at ``path``, never a part of it: written beside it, then renamed."""
    os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)
    atomic_write(path, data, mode=0o600)


def _serve(rfd: int, pipe: str, out: str, dump: Callable[[], bytes]) -> None:
    while True:
        try:
            if os.read(rfd, 64):  # blocks until the agent writes: never end-of-file (see serve)
                write_whole(out, dump())
        except Exception as exc:  # a broken recorder must never take the rank down
            print(f"slurmkit: the flight recorder's trace could not be served from {pipe}: {exc}",
                  file=sys.stderr, flush=True)
            return


def serve(backend: str, environ: Mapping[str, str] = os.environ) -> threading.Thread | None:
    """Start the thread that answers the agent's FIFO; None when the agent named none (the
    trainer run by hand), the backend has no recorder, or the FIFO could not be made.

    The FIFO is held open for reading from here on, not opened per request: a thread blocked in
    ``open`` stops counting as a reader while its process is stopped, and a SIGSTOPped rank is
    the one whose trace matters most. The process holds a writer too, so a read blocks until a
    request comes and never sees end-of-file after the agent closes its end.
    """
    pipe, out = environ.get(PIPE_ENV, ""), environ.get(FILE_ENV, "")
    dump = dumper(backend) if pipe and out else None
    if dump is None:
        return None
    try:
        os.makedirs(os.path.dirname(pipe) or ".", mode=0o700, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(pipe)  # a FIFO of an earlier generation, or anything else left there
        os.mkfifo(pipe, 0o600)
        rfd = os.open(pipe, os.O_RDONLY | os.O_NONBLOCK)
        os.open(pipe, os.O_WRONLY)  # kept open for the process's life (see above)
        os.set_blocking(rfd, True)
    except OSError as exc:
        print(f"slurmkit: no flight-recorder FIFO at {pipe} ({exc}); a hang will have no trace",
              file=sys.stderr, flush=True)
        return None
    thread = threading.Thread(target=_serve, args=(rfd, pipe, out, dump), name="slurmkit-flight-recorder",
                              daemon=True)
    thread.start()
    return thread
