"""What the Slurm controller says, as the supervisor uses it: node states, KillWait.

Every query goes through the :class:`SlurmClient` the supervisor was given (the real CLI in a
job, the fake controller in tests), never through a runner built here. Queries made while the
agents wait for a decision use a short retry budget (:data:`DECISION_RETRY`): a slow slurmctld
delays a decision by seconds at most, and the decision is then taken on the agents' evidence
alone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from slurmkit.slurm.client import SlurmClient
from slurmkit.slurm.errors import SlurmError
from slurmkit.slurm.parsers import parse_duration_s
from slurmkit.slurm.retry import RetryPolicy
from slurmkit.supervise.classes import FailureClass
from slurmkit.supervise.classify import Evidence

log = logging.getLogger(__name__)

#: Backoff for the controller while a decision waits: 3 tries within 6 s (0.5 s, then ~1 s,
#: with jitter so 2,048 agents that fail together do not hit a recovering slurmctld together).
DECISION_RETRY = RetryPolicy(max_attempts=3, max_delay_s=6.0, initial_wait_s=0.5, max_wait_s=2.0,
                             jitter_s=0.5)
#: Per-command timeout of those queries.
DECISION_TIMEOUT_S = 5.0


def node_evidence(lost: list[str], client: SlurmClient,
                  retry: RetryPolicy = DECISION_RETRY,
                  now: Callable[[], float] = time.time) -> list[Evidence]:
    """The controller's state of nodes whose agents went silent, asked for those nodes only.

    No waiting for Slurm to agree: it notices a dead slurmd only after SlurmdTimeout. An
    unreachable controller gives no evidence (logged), never an exception.
    """
    if not lost:
        return []
    try:
        found = client.bounded(retry, DECISION_TIMEOUT_S).nodes(lost)
    except SlurmError as exc:
        log.warning("scontrol show node %s failed: %s", ",".join(lost), exc)
        return []
    nodes = {n.name: n for n in found}
    out = []
    for name in lost:
        if name in nodes:
            n = nodes[name]
            detail = f"slurm: {name} state={n.state}" + (f" reason={n.reason}" if n.reason else "")
            out.append(Evidence(now(), name, -1, "slurm", FailureClass.NODE_LOSS, detail))
    return out


def kill_wait_warning(planned_s: int, client: SlurmClient) -> str | None:
    """A message when the controller's KillWait is shorter than the cluster profile says."""
    try:
        raw = client.bounded(DECISION_RETRY, 10.0).config().get("KillWait", "")
    except SlurmError as exc:
        log.warning("could not read Slurm's KillWait: %s", exc)
        return None
    kill_wait = parse_duration_s(raw) if raw else None
    if kill_wait is None or kill_wait >= planned_s:
        return None
    return (f"Slurm's KillWait is {kill_wait} s but cluster.kill_wait_s={planned_s}: a final checkpoint "
            "after the time limit has less time than planned; set cluster.kill_wait_s to match")
