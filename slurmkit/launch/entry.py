"""The callable submitit pickles, kept apart from the agent so submitting imports no torch."""

from __future__ import annotations

import atexit
import logging
import os
import sys


def _leave_without_finalization(code: int) -> None:
    """The last thing the agent's process does, after submitit has written its result.

    By then the job's outcome is decided and recorded. What interpreter finalization would
    still do is tear down torch's C++ objects (the TCPStore server and its libuv loop, the
    alive thread's client) while their threads may still run; a std::thread destroyed while
    joinable aborts the process (SIGABRT), and on node 0 that abort is the job's exit code: a
    run that completed would end FAILED. The rank processes leave the same way
    (``slurmkit.train.__main__.exit_now``).
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def submitit_entry(run_dir: str) -> None:
    """Run the node agent for ``run_dir``; exit with its code (93 means do not requeue).

    A non-zero code leaves at once (the agent's own ``submitit_entry``); a zero one returns so
    submitit records the success, and the process then ends before finalization (atexit
    handlers run last-registered first, so this one runs before any other).
    """
    from slurmkit.launch.agent import submitit_entry as run

    run(run_dir)
    atexit.register(_leave_without_finalization, 0)
