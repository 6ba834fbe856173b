"""The fault menu: what a campaign can do to a run, and when.

A fault is a *kind* (what is done: a signal, a killed node, a warning) placed at a *moment*
read from the run's own ledger:

- ``after_save``: once the n-th checkpoint written since training (re)started after the
  previous fault is in the ledger, plus ``offset`` steps (always fewer than one interval, so
  the run has fresh checkpoint progress between faults and the policy never sees a crash loop
  that the campaign made up);
- ``during_restart``: the recovery window of the previous fault: the ranks of the next
  generation (or of the requeued allocation) have started and are restoring, training has not
  resumed. This is "node loss during a restore", "a time-limit warning during a restart".

Items that cannot be driven for real yet stay on the menu with ``implemented=False`` and the
reason, so a campaign report says what it did not try instead of silently skipping it.
"""

from __future__ import annotations

from dataclasses import dataclass

AFTER_SAVE = "after_save"
DURING_RESTART = "during_restart"
MOMENTS = (AFTER_SAVE, DURING_RESTART)


@dataclass(frozen=True)
class MenuItem:
    name: str
    moments: tuple[str, ...]  # where the planner may place it
    what: str  # what the driver does, for the report
    target: str  # "rank" (a rank 0..world-1), "node" (a train slot 0..nodes-1) or "job"
    excludes_node: bool = False  # the node it hits may rightly be excluded
    restarts: bool = True  # the recovery it causes restarts ranks (a during_restart may follow)
    implemented: bool = True
    why_not: str = ""


MENU: tuple[MenuItem, ...] = (
    MenuItem("rank_sigkill", (AFTER_SAVE, DURING_RESTART), "SIGKILL one rank", "rank"),
    MenuItem("rank_sigstop", (AFTER_SAVE,), "SIGSTOP one rank (a hang: no step, no heartbeat)", "rank"),
    MenuItem("nccl_abort", (AFTER_SAVE,),
             "the rank prints the NCCL async-error line and aborts (trainer's SLURMKIT_FAULT, "
             "armed at run time by removing its once-marker)", "rank"),
    MenuItem("node_loss", (AFTER_SAVE, DURING_RESTART),
             "tools/local-cluster kill-node: slurmd and every process of the node SIGKILLed, "
             "its NVMe directories removed; started again once the supervisor decided", "node",
             excludes_node=True),
    MenuItem("agent_sigkill", (AFTER_SAVE,), "SIGKILL the node agent of one train node", "node"),
    MenuItem("time_limit_warning", (AFTER_SAVE, DURING_RESTART),
             "SIGUSR1 to the batch shell, what Slurm's --signal=B:USR1@lead sends", "job"),
    MenuItem("two_at_once", (AFTER_SAVE,), "SIGKILL two ranks on different nodes within 0.3 s", "rank"),
    MenuItem("rank_sigkill_during_save", (AFTER_SAVE,),
             "SIGKILL one rank while the next save is being written: the driver polls the rank's "
             "node's NVMe tier for that step's .partial/ directory (DCP writing, not committed) "
             "and kills the rank while it is there", "rank"),
    MenuItem("s3_down_during_promotion", (AFTER_SAVE,),
             "the run's own S3 server (its object tier, promoted every save) is stopped between two "
             "saves, so the next save's promotion to S3 meets the outage; started again (same "
             "port, keys, data) once the ledger shows that promotion failing and pending", "job",
             restarts=False),
    MenuItem("nvme_full", (AFTER_SAVE,),
             "one node's NVMe directory under a size-limited tmpfs (a copy of its checkpoints), "
             "filled to ENOSPC; the filler is removed once the next save is over (committed on "
             "another tier, or failed), the tmpfs unmounted after the job", "node",
             restarts=False),
)

BY_NAME = {m.name: m for m in MENU}
IMPLEMENTED = tuple(m for m in MENU if m.implemented)


def item(name: str) -> MenuItem:
    try:
        return BY_NAME[name]
    except KeyError:
        raise KeyError(f"no fault {name!r} on the menu (known: {', '.join(BY_NAME)})") from None


def pairs() -> list[tuple[str, str]]:
    """Every (kind, moment) the planner can draw: what "covers the menu" means."""
    return [(m.name, moment) for m in IMPLEMENTED for moment in m.moments]
