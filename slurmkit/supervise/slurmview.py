"""What the Slurm controller says, as the supervisor uses it: node states, KillWait."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

from slurmkit.slurm.client import SlurmClient
from slurmkit.slurm.errors import SlurmError
from slurmkit.slurm.parsers import parse_duration_s
from slurmkit.slurm.runner import SubprocessRunner
from slurmkit.supervise.classes import FailureClass
from slurmkit.supervise.classify import Evidence

log = logging.getLogger(__name__)


def node_evidence(lost: list[str], env: Mapping[str, str]) -> list[Evidence]:
    """The controller's state of nodes whose agents went silent (no waiting: Slurm itself
    notices a dead slurmd only after SlurmdTimeout)."""
    if not lost:
        return []
    try:
        nodes = {n.name: n for n in SlurmClient(SubprocessRunner(env=env), timeout_s=5).nodes()}
    except SlurmError as exc:
        log.warning("scontrol show node failed: %s", exc)
        return []
    out = []
    for name in lost:
        if name in nodes:
            n = nodes[name]
            detail = f"slurm: {name} state={n.state}" + (f" reason={n.reason}" if n.reason else "")
            out.append(Evidence(time.time(), name, -1, "slurm", FailureClass.NODE_LOSS, detail))
    return out


def kill_wait_warning(planned_s: int, env: Mapping[str, str]) -> str | None:
    """A message when the controller's KillWait is shorter than the cluster profile says."""
    try:
        raw = SlurmClient(SubprocessRunner(env=env), timeout_s=10).config().get("KillWait", "")
    except SlurmError as exc:
        log.warning("could not read Slurm's KillWait: %s", exc)
        return None
    kill_wait = parse_duration_s(raw) if raw else None
    if kill_wait is None or kill_wait >= planned_s:
        return None
    return (f"Slurm's KillWait is {kill_wait} s but cluster.kill_wait_s={planned_s}: a final checkpoint "
            "after the time limit has less time than planned; set cluster.kill_wait_s to match")
