"""The callable submitit pickles, kept apart from the agent so submitting imports no torch."""

from __future__ import annotations


def submitit_entry(run_dir: str) -> None:
    """Run the node agent for ``run_dir``; exit with its code (93 means do not requeue)."""
    from slurmkit.launch.agent import submitit_entry as run

    run(run_dir)
