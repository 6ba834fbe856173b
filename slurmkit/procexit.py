"""Leaving a process without interpreter finalization, once its outcome is recorded.

The rank processes and the node agents hold torch's C++ objects (gloo transport threads, the
TCPStore server and its libuv loop, store clients). Interpreter finalization runs their static
destructors while those threads may still run, and a std::thread destroyed while joinable
aborts the process ("terminate called without an active exception", SIGABRT). A rank that
aborts after ``train_finished`` reads as a crash to its agent (seen once in CI); node 0's agent
aborting after the job completed turns the job FAILED, since its exit code is the job's.
"""

from __future__ import annotations

import logging
import os
import sys


def leave(code: int) -> None:
    """Flush logging and the standard streams, then ``os._exit(code)``."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
