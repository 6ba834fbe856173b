"""What a program's silence and its clean exit after a signal mean, by whether it is known to
follow slurmkit's contract (to beat every step, to exit 95 when it leaves on a signal).

Pure functions of the config's choice and the job's command: the node agent reads the first
(its rank monitor, slurmkit.launch.monitor), the supervisor the second (slurmkit.supervise.loopbase).
"""

from __future__ import annotations

from collections.abc import Sequence

# Programs known to beat every step (slurmkit.train.heartbeat.Heartbeat), named as `-m` takes them.
BEATING_MODULES = frozenset({"slurmkit.train"})


def expects_heartbeats(require_heartbeat: str, command: Sequence[str]) -> bool:
    """Whether a rank that has never beaten is a hang after the startup timeout.

    ``auto``: only for a program known to beat (``python -m slurmkit.train``). Any other program
    (a plain DDP script, a Lightning Trainer) may never write a heartbeat: killing it as a hang
    once the startup timeout passed would end every healthy run of it. Its ranks are judged
    from their first beat on, if one ever comes, and a stopped rank is still found (state T).
    """
    if require_heartbeat != "auto":
        return require_heartbeat == "true"
    args = list(command)
    return any(a == "-m" and b in BEATING_MODULES for a, b in zip(args, args[1:], strict=False))


def exit0_is_completion(choice: str, command: Sequence[str]) -> bool:
    """Whether ranks that all exit 0 after a time-limit warning or a SIGTERM finished the run
    (supervisor.exit0_after_signal). ``auto``: only for a program known to follow the exit
    contract (``python -m slurmkit.train`` exits 95 when it leaves on a signal, 0 only when its
    training is done). Any other program may answer the signal by saving and exiting 0: taken
    for completion, the run would end for good at its first time limit; taken for leaving, a
    program that had in fact finished costs one short allocation, where it exits 0 at once."""
    if choice != "auto":
        return choice == "completed"
    args = list(command)
    return any(a == "-m" and b in BEATING_MODULES for a, b in zip(args, args[1:], strict=False))
