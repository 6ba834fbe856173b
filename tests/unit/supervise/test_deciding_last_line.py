"""Node 0 writes the failing rank's last word (``Evidence.last_line``, posted by its node) into
the ledger's failure event, the one place status and the end-of-wait summary read it from."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from slurmkit.failures.classes import FailureClass
from slurmkit.failures.classify import Evidence
from tests.unit.supervise.test_loop import Cluster, Script

F = FailureClass
SAID = "python: can't open file '/w/train.py': [Errno 2] No such file or directory"


def test_the_failure_event_carries_the_ranks_line(tmp_path: Path) -> None:
    c = Cluster(tmp_path, [Script(), Script(fail={0: F.USER_ERROR})])
    node = c.nodes[1]

    def stop() -> list[Evidence]:
        ev = node.poll(node.gen)
        if ev is None:
            return [Evidence(0.0, node.name, 0, "exit", F.PEER_FAILURE, "returncode -9")]
        return [replace(ev, kind="exit", detail="returncode 2", returncode=2, last_line=SAID)]

    node.stop = stop  # type: ignore[method-assign]
    c.run()
    (failure,) = c.ledger.of("failure")  # validated against the ledger's schema on append
    assert (failure["cls"], failure["node"], failure["evidence"]) == ("user_error", "n1", "returncode 2")
    assert failure["line"] == SAID


def test_no_line_no_field(tmp_path: Path) -> None:
    c = Cluster(tmp_path, [Script(), Script(fail={0: F.USER_ERROR})])
    c.run()
    (failure,) = c.ledger.of("failure")
    assert "line" not in failure
