"""What ended a requeued job's previous attempt (slurmkit/supervise/exits/previous.py): the fake
Slurm controller (22.05's text formats) behind the real client, real done markers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from slurmkit.ledger.events import validate
from slurmkit.slurm.client import SlurmClient
from slurmkit.slurm.retry import RetryPolicy
from slurmkit.supervise.exits.previous import previous_attempt, record_previous
from slurmkit.supervise.exits.succession import Done, write_done
from testkit.fakeslurm import FakeSlurm

T0 = 1_700_000_000.0


class Events:
    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def append(self, event: str, **fields: object) -> None:
        validate(event, fields)  # the ledger's typed schema
        self.rows.append({"event": event, "t": T0, **fields})

    def of(self, name: str) -> list[dict[str, Any]]:
        return [r for r in self.rows if r["event"] == name]


def requeued_job(tmp_path: Path, by_node_failure: bool) -> tuple[FakeSlurm, SlurmClient, str]:
    """A job that ran on node1-node2 and was requeued: by Slurm (node2 failed) or by an
    admin's scontrol requeue; then started again on node3-node4."""
    now = [T0]
    fake = FakeSlurm({"debug": "node[1-4]"}, clock=lambda: now[0])
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\n#SBATCH --requeue\n#SBATCH -N 2\nx\n")
    job = fake.run(["sbatch", "--parsable", str(script)]).stdout.strip()
    fake.start(job, ["node1", "node2"])
    now[0] += 600
    if by_node_failure:
        fake.fail_node("node2")
    else:
        fake.run(["scontrol", "requeue", job])
    now[0] += 130
    fake.start(job, ["node3", "node4"])
    return fake, SlurmClient(fake, retry=RetryPolicy(max_attempts=1, jitter_s=0)), job


def test_a_first_allocation_has_no_previous_attempt(tmp_path: Path) -> None:
    assert previous_attempt(str(tmp_path), "12", 0, None) is None


def test_a_node_failure_slurm_requeued_alone_becomes_a_failure_and_its_decision(tmp_path: Path) -> None:
    fake, client, job = requeued_job(tmp_path, by_node_failure=True)
    prev = previous_attempt(str(tmp_path), job, 1, client)
    assert prev is not None
    assert (prev.attempt, prev.handled_by, prev.outcome) == (f"{job}-0", "slurm", "NODE_FAIL")
    assert prev.nodes == ["node1", "node2"] and prev.dead == ["node2"]
    assert prev.ended == T0 + 600
    ev = Events()
    record_previous(ev, prev, now=T0 + 730)
    (p,) = ev.of("previous_attempt")
    assert p["handled_by"] == "slurm" and p["outcome"] == "NODE_FAIL"
    (failure,) = ev.of("failure")
    assert failure["cls"] == "node_loss" and failure["node"] == "node2"
    assert failure["time_of_fault"] == T0 + 600 and "NODE_FAIL" in failure["evidence"]
    (decision,) = ev.of("decision")
    assert decision["action"] == "requeue" and decision["exclude"] == ["node2"]
    assert [r["event"] for r in ev.rows] == ["previous_attempt", "failure", "decision"]


def test_an_admin_requeue_is_recorded_without_a_failure(tmp_path: Path) -> None:
    fake, client, job = requeued_job(tmp_path, by_node_failure=False)
    prev = previous_attempt(str(tmp_path), job, 1, client)
    assert prev is not None and (prev.handled_by, prev.outcome) == ("slurm", "REQUEUED")
    assert prev.dead == []
    ev = Events()
    record_previous(ev, prev, now=T0)
    assert [r["event"] for r in ev.rows] == ["previous_attempt"]


def test_an_attempt_slurmkit_ended_itself_is_not_a_slurm_loss(tmp_path: Path) -> None:
    fake, client, job = requeued_job(tmp_path, by_node_failure=True)
    write_done(str(tmp_path), f"{job}-0", Done("requeueing", 0, "node1", 0))
    prev = previous_attempt(str(tmp_path), job, 1, client)
    assert prev is not None and (prev.handled_by, prev.outcome) == ("slurmkit", "requeueing")
    ev = Events()
    record_previous(ev, prev, now=T0)
    assert [r["event"] for r in ev.rows] == ["previous_attempt"]


def test_slurm_unreachable_leaves_what_it_could_not_ask_unknown(tmp_path: Path) -> None:
    fake, client, job = requeued_job(tmp_path, by_node_failure=True)
    fake.fail_next(10)
    prev = previous_attempt(str(tmp_path), job, 1, client)
    assert prev is not None and prev.outcome == "unknown" and prev.queued_s is None
    ev = Events()
    record_previous(ev, prev, now=T0)
    assert [r["event"] for r in ev.rows] == ["previous_attempt"]  # no guess at a failure


def test_a_successor_jobs_first_allocation_reports_its_predecessors_last_attempt(tmp_path: Path) -> None:
    """A run handed to a successor job (supervise/exits/successor.py) starts with restart count 0;
    its previous attempt is the predecessor's, named by the handover's environment."""
    now = [T0]
    fake = FakeSlurm({"debug": "node[1-4]"}, clock=lambda: now[0])
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\n#SBATCH -N 2\nx\n")
    old = fake.run(["sbatch", "--parsable", str(script)]).stdout.strip()
    fake.start(old, ["node1", "node2"])
    write_done(str(tmp_path), f"{old}-0", Done("requeueing", 0, "node1", 0))
    now[0] += 300
    new = fake.run(["sbatch", "--parsable", str(script)]).stdout.strip()
    fake.finish(old)
    now[0] += 20
    fake.start(new, ["node3", "node4"])
    client = SlurmClient(fake, retry=RetryPolicy(max_attempts=1, jitter_s=0))
    prev = previous_attempt(str(tmp_path), new, 0, client, predecessor=f"{old}-0")
    assert prev is not None
    assert (prev.attempt, prev.handled_by, prev.outcome) == (f"{old}-0", "slurmkit", "requeueing")
    assert prev.nodes == ["node1", "node2"]  # the predecessor's accounting, not the new job's
    assert prev.queued_s == 20  # the successor's own wait
    ev = Events()
    record_previous(ev, prev, now=T0)
    assert [r["event"] for r in ev.rows] == ["previous_attempt"]
    # what the environment says is checked: not an attempt, or this job's own, is no predecessor
    for bad in ("", "12", "x-0", f"{new}-0", "1-0\n"):
        assert previous_attempt(str(tmp_path), new, 0, client, predecessor=bad) is None


def test_where_sacct_has_failed_node_the_blamed_node_is_named_even_when_it_is_back(tmp_path: Path) -> None:
    # Slurm 23.02+: sacct's FailedNode names the node Slurm blamed for the NODE_FAIL. By the time
    # the next allocation asks, node2 is back (ReturnToService): only FailedNode still names it.
    fake, _, job = requeued_job(tmp_path, by_node_failure=True)
    fake.failed_node_field = True
    fake.run(["scontrol", "update", "NodeName=node2", "State=RESUME"])
    client = SlurmClient(fake, retry=RetryPolicy(max_attempts=1, jitter_s=0), failed_node_field=True)
    prev = previous_attempt(str(tmp_path), job, 1, client)
    assert prev is not None and prev.outcome == "NODE_FAIL" and prev.dead == []
    assert prev.failed_node == "node2" and prev.blamed == ["node2"]
    assert ["sacct", "--duplicates", "--parsable2", "--noheader", "-o",
            "JobID,JobName,State,ExitCode,Start,End,Elapsed,NodeList,Reason,FailedNode", "-j", job] in fake.calls
    ev = Events()
    record_previous(ev, prev, now=T0 + 730)
    (p,) = ev.of("previous_attempt")
    assert p["failed_node"] == "node2"
    (failure,) = ev.of("failure")
    assert failure["node"] == "node2" and "FailedNode" in failure["evidence"]


def test_without_the_field_the_node_is_only_what_slurm_calls_dead_now(tmp_path: Path) -> None:
    # 22.05: sacct refuses FailedNode, so the client does not ask (the site probe said no); a
    # node that is back by then is named nowhere, and the event has no failed_node.
    fake, client, job = requeued_job(tmp_path, by_node_failure=True)
    fake.run(["scontrol", "update", "NodeName=node2", "State=RESUME"])
    prev = previous_attempt(str(tmp_path), job, 1, client)
    assert prev is not None and prev.outcome == "NODE_FAIL" and prev.failed_node is None and prev.blamed == []
    assert not any("FailedNode" in " ".join(c) for c in fake.calls)
    ev = Events()
    record_previous(ev, prev, now=T0 + 730)
    assert "failed_node" not in ev.of("previous_attempt")[0]
    assert ev.of("failure")[0]["node"] == ""


def test_a_failed_node_outside_the_runs_nodes_is_not_believed(tmp_path: Path) -> None:
    fake, _, job = requeued_job(tmp_path, by_node_failure=True)
    fake.failed_node_field = True
    fake.jobs[job].history[-1].failed_node = "node9"  # accounting that contradicts itself
    client = SlurmClient(fake, retry=RetryPolicy(max_attempts=1, jitter_s=0), failed_node_field=True)
    prev = previous_attempt(str(tmp_path), job, 1, client)
    assert prev is not None and prev.failed_node is None and prev.blamed == ["node2"]
