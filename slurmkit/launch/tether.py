"""Ranks die with their agent: ``python -m slurmkit.launch.tether AGENT_PID -- PROGRAM ...``.

A rank runs in its own session (the agent signals it as a group), so when its agent dies by
SIGKILL (the OOM killer, a chaos campaign, an admin) nothing ends it: under
``proctrack/linuxproc`` Slurm tracks processes by parentage and loses a rank reparented to init,
which then outlives the requeue and the job and holds its GPU (seen in a chaos campaign: a
rank of the killed node-0 agent still running after the job had COMPLETED). Under cgroups Slurm
ends it with the step, later.

The tether asks the kernel to SIGKILL this process when the agent's thread that started it
ends (``prctl(PR_SET_PDEATHSIG)``, kept across ``execve``), checks that the agent is still its
parent (it may have died before the request), then execs the program in place: no process is
added, and the program's pid, environment and session are the rank's. A warm standby
(slurmkit.launch.standby) calls :func:`arm` itself.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Sequence

MODULE = "slurmkit.launch.tether"
PR_SET_PDEATHSIG = 1
EXIT_ORPHANED = 1  # the agent died before the rank could tie itself to it


def arm(parent_pid: int) -> bool:
    """SIGKILL this process when ``parent_pid`` (its parent) dies. False where the kernel has
    no such request (not Linux); exits at once if the parent is already gone."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        armed = libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        armed = False
    if os.getppid() != parent_pid:  # died (or was never it) before the request took effect
        print(f"slurmkit tether: agent {parent_pid} is gone (parent is {os.getppid()}): not starting",
              file=sys.stderr, flush=True)
        os._exit(EXIT_ORPHANED)
    return armed


def command(parent_pid: int, argv: Sequence[str]) -> list[str]:
    """``argv`` started through the tether to ``parent_pid``; with ``-P`` (Python 3.11+) the
    working directory (the run directory) is not searched for the tether's own modules."""
    safe = ["-P"] if sys.version_info >= (3, 11) else []
    return [sys.executable, *safe, "-m", MODULE, str(parent_pid), "--", *argv]


def main(args: Sequence[str]) -> int:
    if len(args) < 3 or not args[0].isdigit() or args[1] != "--":
        print("usage: python -m slurmkit.launch.tether AGENT_PID -- PROGRAM [ARGS...]", file=sys.stderr)
        return 2
    arm(int(args[0]))
    program = list(args[2:])
    try:
        os.execvp(program[0], program)
    except OSError as exc:
        print(f"slurmkit tether: cannot run {program[0]!r}: {exc}", file=sys.stderr, flush=True)
        return 127
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
