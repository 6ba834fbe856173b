"""Node 0's open-file limit, which the agents' store needs to grow with the job.

The agents' TCPStore on node 0 holds one socket per connection of every agent: its main loop,
its beats (slurmkit.supervise.liveness.Beater), its end-of-generation watch
(slurmkit.supervise.endwatch) and, during pre-flight, its clock and link checks. At 2,048 nodes
that is about 10,000 sockets in node 0's agent. Slurm starts the job with the submitting
shell's limits (``PropagateResourceLimits``, ALL by default), and a login shell's soft limit
is often 1,024: the store would stop accepting agents at about 200 nodes, and the agents past
that would time out connecting. So node 0's agent raises its soft limit (up to the hard one,
which a process may do by itself) before the agents connect, and says so, with the fix, when
even the hard limit is too low.
"""

from __future__ import annotations

import resource
from collections.abc import Callable

#: Store connections per agent at most (main loop, beats, end watch, clock check, link check).
CONNECTIONS_PER_AGENT = 5
#: Descriptors node 0's agent needs besides: its ranks' pipes, logs, the ledger, torch, Python.
OWN_FDS = 256


def store_fds_needed(num_nodes: int) -> int:
    """Open files node 0's agent needs for a job of ``num_nodes`` agents."""
    return CONNECTIONS_PER_AGENT * int(num_nodes) + OWN_FDS


def raise_fd_limit(needed: int, *,
                   getrlimit: Callable[[int], tuple[int, int]] = resource.getrlimit,
                   setrlimit: Callable[[int, tuple[int, int]], None] = resource.setrlimit) -> str | None:
    """Raise this process's soft RLIMIT_NOFILE to ``needed`` (at most to the hard limit).
    Returns None when the limit is enough now, else a Detected/Requirement/Fix message."""
    soft, hard = getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return None
    target = needed if hard == resource.RLIM_INFINITY or hard >= needed else hard
    try:
        setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as exc:
        return (f"Detected: node 0's open-file limit is {soft} and could not be raised to {target} "
                f"({exc}). Requirement: {needed} open files for the agents' store of this job. Fix: "
                f"raise `ulimit -n` (soft and hard) where the job is submitted, or ask the site for "
                f"a higher nofile limit on the compute nodes.")
    if target < needed:
        return (f"Detected: node 0's open-file limit is capped at {hard} (hard), raised from {soft}. "
                f"Requirement: {needed} open files for the agents' store of this job "
                f"({CONNECTIONS_PER_AGENT} per agent). Fix: raise the hard nofile limit on the "
                f"compute nodes (/etc/security/limits.conf, or the slurmd unit's LimitNOFILE with "
                f"PropagateResourceLimits), or run fewer nodes per job.")
    return None
