"""The callable submitit pickles, kept apart from the agent so submitting imports no torch."""

from __future__ import annotations

import atexit

from slurmkit.procexit import leave


def submitit_entry(run_dir: str) -> None:
    """Run the node agent for ``run_dir``; exit with its code (93 means do not requeue).

    A non-zero code leaves at once (the agent's own ``submitit_entry``); a zero one returns so
    submitit records the success, and the process then ends before finalization (atexit
    handlers run last-registered first, so this one runs before any other): node 0's exit
    code is the job's, and a C++ teardown abort there would turn a completed run FAILED
    (slurmkit.procexit).
    """
    from slurmkit.launch.agent import submitit_entry as run

    run(run_dir)
    atexit.register(leave, 0)
