"""What the Slurm controller says, as the supervisor uses it: node states, KillWait.

Every query goes through the :class:`SlurmClient` the supervisor was given (the real CLI in a
job, the fake controller in tests), never through a runner built here. Queries made while the
agents wait for a decision use a short retry budget (:data:`DECISION_RETRY`): a slow slurmctld
delays a decision by seconds at most, and the decision is then taken on the agents' evidence
alone.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Collection

from slurmkit.slurm.client import SlurmClient
from slurmkit.slurm.errors import SlurmError
from slurmkit.slurm.parsers import parse_duration_s
from slurmkit.slurm.retry import RetryPolicy
from slurmkit.failures.classes import FailureClass
from slurmkit.failures.classify import Evidence

log = logging.getLogger(__name__)

#: Backoff for the controller while a decision waits: 3 tries within 6 s (0.5 s, then ~1 s,
#: with jitter so 2,048 agents that fail together do not hit a recovering slurmctld together).
DECISION_RETRY = RetryPolicy(max_attempts=3, max_delay_s=6.0, initial_wait_s=0.5, max_wait_s=2.0,
                             jitter_s=0.5)
#: Per-command timeout of those queries.
DECISION_TIMEOUT_S = 5.0
#: How long a lost agent's slurmd gets to accept a connection (a dead host never answers).
SLURMD_PROBE_TIMEOUT_S = 2.0

#: Slurm's SlurmdPort when slurm.conf sets none.
DEFAULT_SLURMD_PORT = 6818

#: Does the slurmd at (address, port) accept a connection?
SlurmdProbe = Callable[[str, int], bool]


def slurmd_answers(addr: str, port: int, timeout_s: float = SLURMD_PROBE_TIMEOUT_S) -> bool:
    """True when the node's slurmd accepts a TCP connection (nothing is sent: the daemon only
    logs a connection that carried no message). Slurm's node state alone cannot tell a killed
    agent from a dead node at decision time: slurmctld still calls a dead node MIXED until
    SlurmdTimeout (300 s by default) has passed; the daemon itself answers at once or never."""
    try:
        with socket.create_connection((addr, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def node_health(names: Collection[str], client: SlurmClient,
                probe: SlurmdProbe = slurmd_answers) -> dict[str, tuple[str, bool | None]]:
    """``{node: (Slurm's state, whether its slurmd answers)}`` for the nodes Slurm knows; one
    bounded ``scontrol show node`` for all of them, then one probe per node Slurm does not call
    dead (None: not probed, or no port known). An unreachable controller gives ``{}``."""
    from slurmkit.supervise.liveness import slurm_says_dead

    if not names:
        return {}
    try:
        found = client.bounded(DECISION_RETRY, DECISION_TIMEOUT_S).nodes(list(names))
    except SlurmError as exc:
        log.warning("scontrol show node %s failed: %s", ",".join(names), exc)
        return {}
    out: dict[str, tuple[str, bool | None]] = {}
    default: str | None = None
    for n in found:
        state = "+".join([n.state, *n.flags])
        port = n.raw.get("Port", "")
        if not port and not slurm_says_dead(state):
            # scontrol prints a node's Port only where it differs from the cluster's SlurmdPort:
            # on most sites no node has one (seen here: node1 on the default port was never
            # probed, so a SIGKILLed agent there could not be told from a dead node)
            default = _slurmd_port(client) if default is None else default
            port = default
        alive = (probe(n.node_addr or n.node_hostname or n.name, int(port))
                 if port.isdigit() and not slurm_says_dead(state) else None)
        out[n.name] = (state, alive)
    return out


def _slurmd_port(client: SlurmClient) -> str:
    """The cluster's SlurmdPort (one bounded ``scontrol show config``); Slurm's default 6818
    when the controller does not say."""
    try:
        value = client.bounded(DECISION_RETRY, DECISION_TIMEOUT_S).config().get("SlurmdPort", "").strip()
    except SlurmError as exc:
        log.warning("scontrol show config failed: %s", exc)
        value = ""
    return value if value.isdigit() else str(DEFAULT_SLURMD_PORT)


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
