"""Which program the job runs, and what its silence and its clean exit after a signal mean, by
whether it is known to follow slurmkit's contract (to beat every step, to exit 95 when it leaves
on a signal, to dump its stack on SIGUSR2).

One answer to "does job.command run slurmkit's reference trainer?" (:func:`is_reference_trainer`),
asked by the node agent (its rank monitor, the hang stacks, the warm standby), the supervisor
(exit 0 after a signal) and submit (the trainer's memory plan). Pure functions of the config's
choice and the job's command.
"""

from __future__ import annotations

from collections.abc import Sequence

#: The reference trainer, named as ``python -m`` takes it: the one program known to beat every step
#: (slurmkit.train.heartbeat.Heartbeat), exit 95 on a signal and dump its stack on SIGUSR2.
REFERENCE_TRAINER = "slurmkit.train"


def is_reference_trainer(command: Sequence[str]) -> bool:
    """Whether ``command`` runs the reference trainer: ``-m slurmkit.train`` among its
    arguments (``python -m slurmkit.train ...``, ``python -u -m slurmkit.train``, under a
    wrapper such as ``nsys profile python -m slurmkit.train``). A module that only starts with
    the name (``slurmkit.train.planner``), a script, or the name as another program's argument
    is not it."""
    args = list(command)
    return any(a == "-m" and b == REFERENCE_TRAINER for a, b in zip(args, args[1:], strict=False))


def reference_trainer_args(argv: Sequence[str]) -> list[str] | None:
    """The trainer's own arguments when ``argv`` is exactly ``<interpreter> -m slurmkit.train
    ARGS`` (no interpreter option, no wrapper: what a warm standby can run in its own process);
    None for any other command, the reference trainer started otherwise included."""
    args = list(argv)
    return args[3:] if len(args) >= 3 and is_reference_trainer(args[1:3]) else None


def expects_heartbeats(require_heartbeat: str, command: Sequence[str]) -> bool:
    """Whether a rank that has never beaten is a hang after the startup timeout.

    ``auto``: only for a program known to beat (``python -m slurmkit.train``). Any other program
    (a plain DDP script, a Lightning Trainer) may never write a heartbeat: killing it as a hang
    once the startup timeout passed would end every healthy run of it. Its ranks are judged
    from their first beat on, if one ever comes, and a stopped rank is still found (state T).
    """
    if require_heartbeat != "auto":
        return require_heartbeat == "true"
    return is_reference_trainer(command)


def exit0_is_completion(choice: str, command: Sequence[str]) -> bool:
    """Whether ranks that all exit 0 after a time-limit warning or a SIGTERM finished the run
    (supervisor.exit0_after_signal). ``auto``: only for a program known to follow the exit
    contract (``python -m slurmkit.train`` exits 95 when it leaves on a signal, 0 only when its
    training is done). Any other program may answer the signal by saving and exiting 0: taken
    for completion, the run would end for good at its first time limit; taken for leaving, a
    program that had in fact finished costs one short allocation, where it exits 0 at once."""
    if choice != "auto":
        return choice == "completed"
    return is_reference_trainer(command)
