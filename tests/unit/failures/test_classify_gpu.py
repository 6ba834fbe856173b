"""Hardware faults, survivable lines and the trainer's config-error marker, from line to decision.

The lines are real formats (NVIDIA's Xid catalogue, cudaGetErrorString, NCCL's net_ib.cc, the
trainer's own stderr); the decisions come from the real policy. The trainer runs as a real
process under the agent's real rank spawner and monitor.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from slurmkit.contract import CONFIG_ERROR_MARKER, EXIT_CONFIG_ERROR
from slurmkit.gpufaults import DEFAULT_BAD_XIDS
from slurmkit.health.kernel_log import Message, scan
from slurmkit.launch.ranks import spawn_rank
from slurmkit.failures.classes import CLASS_INFO, FailureClass
from slurmkit.failures.classify import (CONFIRM_WINDOW_S, Evidence, classify_exit, classify_line,
                                         printable_detail, root_cause)
from slurmkit.launch.monitor import RankMonitor
from slurmkit.supervise.policy import Action, Decision, History, Limits, decide
from tests.unit.failures.test_classify import T0, exit_ev, line_ev

F = FailureClass
LIMITS = Limits(max_restarts=5, max_restarts_without_progress=3)
XID79 = "[  812.334455] NVRM: Xid (PCI:0000:3b:00): 79, pid=4321, name=python, GPU has fallen off the bus."
ECC = "[rank1]: RuntimeError: CUDA error: uncorrectable ECC error encountered"
NIC = "node3:4321:4400 [0] NCCL WARN NET/IB : mlx5_0:1 Got async event : local catastrophic error"
NCCL_REMOTE = ("[rank0]:[E ProcessGroupNCCL.cpp:1234] [PG 0 Rank 0] NCCL error: remote process exited "
               "or there was a network error")
HANDLED_OOM = ("2026-12-01 19:40:02 rank0 myapp WARNING caught torch.OutOfMemoryError: CUDA out of memory. "
               "Tried to allocate 2.00 GiB. retrying with micro_batch=2")


# The root-cause scenarios are built as in test_classify.py, with its helpers.
line, exit_ = line_ev, exit_ev


def decision(ev: list[Evidence], spares: list[str]) -> Decision:
    failure = root_cause(ev)
    assert failure is not None
    d, _ = decide(failure, History(), ckpt_step=100, limits=LIMITS, spare_nodes=spares, lost_nodes=[])
    return d


# ------------------------------------------------------------------ hardware faults

def test_a_hardware_fault_sends_its_node_away_on_the_first_occurrence() -> None:
    info = CLASS_INFO[F.GPU_FAULT]
    assert info.restartable and info.bad_node  # elsewhere the job goes on; this node is out
    # node2's GPU fell off the bus under rank 3; node1's rank 0 then saw NCCL's remote error first.
    ev = [line(10.0, 0, NCCL_REMOTE), exit_(10.4, 0, -6),
          line(10.2, 3, XID79, "node2"), exit_(11.0, 3, -6, "node2")]
    failure = root_cause(ev)
    assert failure is not None and (failure.cls, failure.node, failure.rank) == (F.GPU_FAULT, "node2", 3)
    assert failure.evidence == XID79  # the line itself goes into the ledger
    with_spare = decision(ev, ["node9"])
    assert (with_spare.action, with_spare.exclude) == (Action.REPLACE_NODE, ("node2",))
    without = decision(ev, [])
    assert (without.action, without.exclude) == (Action.REQUEUE, ("node2",))


@pytest.mark.parametrize("text", [XID79, ECC, NIC])
def test_a_hardware_line_needs_no_exit_to_count(text: str) -> None:
    # The rank may go on (or hang in a CUDA call) and be stopped with the others: the node is bad.
    failure = root_cause([line(5.0, 2, text, "node2"), exit_(70.0, 2, -15, "node2"), exit_(69.0, 0, -11)])
    assert failure is not None and (failure.cls, failure.node) == (F.GPU_FAULT, "node2")


def test_the_classifier_reads_xids_as_the_preflight_check_does() -> None:
    # One pattern for both: an Xid line fails the pre-flight if and only if it is a hardware fault here.
    xids = [13, 31, 43, 45, *DEFAULT_BAD_XIDS]
    for xid in xids:
        text = f"NVRM: Xid (PCI:0000:3b:00): {xid}, pid=4321, name=python, Channel 0x10"
        found, _ = scan([Message(None, text)], DEFAULT_BAD_XIDS, None)
        assert (classify_line(text) == F.GPU_FAULT) == bool(found), xid
        assert (classify_line(text) is None) != bool(found), xid


@pytest.mark.parametrize("text", [
    "loading /scratch/run7/dmesg_xid_79.txt for the post-mortem",  # a file name is no Xid
    "NVRM: Xid (PCI:0000:3b:00): 13, pid=4321, name=python, Graphics Exception",  # an application's own
    "Volatile Uncorrectable ECC errors: 0",  # a healthy counter
    "[  901.002211] EDAC MC0: 1 CE memory read error on CPU_SrcID#0_MC#0_Chan#1_DIMM#0",  # corrected
    "node3:4321:4400 [0] NCCL WARN NET/IB : Got async event : GID table change",  # not a fault
    "node3:4321:4321 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB ; OOB ib0:10.0.0.3<0>",
])
def test_hardware_lookalikes_do_not_classify(text: str) -> None:
    assert classify_line(text) is None


def test_a_cuda_error_that_a_bug_can_cause_is_suspect_not_bad_at_once() -> None:
    info = CLASS_INFO[F.CUDA_ERROR]
    assert info.restartable and info.suspect_node and not info.bad_node
    ima = "[rank2]: RuntimeError: CUDA error: an illegal memory access was encountered"
    ev = [line(1.0, 2, ima, "node2"), exit_(1.3, 2, 1, "node2")]
    first = decision(ev, ["node9"])
    assert first.action == Action.RESTART  # once is maybe the code: same nodes
    failure = root_cause(ev)
    assert failure is not None
    _, h = decide(failure, History(), 100, LIMITS, ["node9"], [])
    again, _ = decide(failure, h, 200, LIMITS, ["node9"], [])
    assert (again.action, again.exclude) == (Action.REPLACE_NODE, ("node2",))  # twice on node2: the node


def test_the_evidence_line_goes_to_the_ledger_clean_and_short() -> None:
    raw = "\x1b[31m" + ECC + "\r\x07" + "x" * 900
    failure = root_cause([Evidence(T0, "node2", 1, "line", F.GPU_FAULT, raw)])
    assert failure is not None
    assert all(c.isprintable() for c in failure.evidence) and len(failure.evidence) <= 500
    assert "CUDA error: uncorrectable ECC error encountered" in failure.evidence
    sent = json.loads(json.dumps(Evidence(T0, "node2", 1, "line", F.GPU_FAULT, raw).to_json()))
    assert all(c.isprintable() for c in sent["detail"]) and len(sent["detail"]) <= 500
    ex = exit_(2.0, 1, -6)
    assert Evidence.from_json(json.loads(json.dumps(ex.to_json()))) == ex  # the return code travels


# ------------------------------------------------------------------ survivable lines: confirmed by the exit

def test_a_handled_oom_then_another_ranks_crash_restarts_not_stops() -> None:
    # Rank 0 caught an OOM and ran on; rank 1 segfaulted later, so the agent stopped rank 0 too.
    for gap in (2.0, 300.0):
        ev = [line(5.0, 0, HANDLED_OOM), exit_(5.0 + gap, 1, -11), exit_(5.2 + gap, 0, -15)]
        failure = root_cause(ev)
        assert failure is not None and (failure.cls, failure.rank) == (F.RANK_CRASH, 1), gap
        assert decision(ev, []).action == Action.RESTART


def test_an_oom_that_ends_its_rank_stops_the_run() -> None:
    oom = "[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB."
    ev = [line(5.0, 0, oom), exit_(5.6, 0, 1), exit_(5.9, 1, -15)]
    failure = root_cause(ev)
    assert failure is not None and (failure.cls, failure.rank) == (F.GPU_OOM, 0)
    assert decision(ev, []).action == Action.STOP


def test_an_oom_line_long_before_the_exit_is_not_its_cause() -> None:
    ev = [line(5.0, 0, HANDLED_OOM), exit_(5.0 + CONFIRM_WINDOW_S + 1, 0, 1)]
    failure = root_cause(ev)
    assert failure is not None and failure.cls == F.USER_ERROR  # the later exception, restartable


def test_an_oom_line_of_a_rank_that_then_hung_counts() -> None:
    hang = Evidence(T0 + 100.0, "node1", 0, "heartbeat", F.HANG, "no step after step 9 for 61.0 s")
    failure = root_cause([hang, line(100.5, 0, HANDLED_OOM), exit_(170.0, 0, -15)])
    assert failure is not None and failure.cls == F.GPU_OOM


def test_only_handled_lines_are_no_failure() -> None:
    # logging.exception's traceback: no "[rank<N>]: " prefix, the exception was caught
    assert root_cause([line(5.0, 0, HANDLED_OOM), line(6.0, 0, "Traceback (most recent call last):")]) is None


def test_an_uncaught_exception_counts_even_if_its_rank_was_stopped_in_its_teardown() -> None:
    # torch's excepthook printed it (the prefix), so the process was ending; its tear-down was slow
    # and the agent killed it with its peer when the generation ended.
    tb = line(10.5, 1, "[rank1]: Traceback (most recent call last):")
    err = line(10.5, 1, "[rank1]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.")
    failure = root_cause([tb, err, exit_(18.5, 1, -15), exit_(18.5, 0, -15)])
    assert failure is not None and (failure.rank, failure.cls) == (1, F.GPU_OOM)
    # the same lines from a caught exception (logging.exception: no prefix) count for nothing
    caught = [line(10.5, 1, "Traceback (most recent call last):"), line(10.5, 1, HANDLED_OOM)]
    failure = root_cause([*caught, exit_(18.5, 1, -15), exit_(18.4, 0, -11)])
    assert failure is not None and (failure.rank, failure.cls) == (0, F.RANK_CRASH)


def test_a_handled_oom_line_does_not_end_the_generation() -> None:
    mon = RankMonitor("node1", 0, heartbeat_timeout_s=60.0, startup_timeout_s=300.0)
    mon.on_line(0, HANDLED_OOM + "\n")
    assert mon.triggered is None and [e.cls for e in mon.evidence] == [F.GPU_OOM]
    mon.on_line(1, XID79 + "\n")  # a hardware line does: the node leaves at once
    assert mon.triggered is not None and mon.triggered.cls == F.GPU_FAULT


# ------------------------------------------------------------------ the trainer's config-error marker

@pytest.mark.parametrize("text", [
    CONFIG_ERROR_MARKER + "Detected: train.micro_batch=0. Requirement: a positive batch. Fix: set it.",
    "[rank3]: " + CONFIG_ERROR_MARKER + "Detected: x",
    "12: " + CONFIG_ERROR_MARKER + "Detected: x",
])
def test_the_marker_is_a_config_error(text: str) -> None:
    assert classify_line(text) == F.CONFIG_ERROR


def test_a_quoted_marker_is_not() -> None:
    assert classify_line("INFO the last run said '" + CONFIG_ERROR_MARKER + "Detected: x'") is None


def test_the_trainer_refusing_its_config_stops_the_run_at_once(tmp_path: Path) -> None:
    # A real trainer process with a config it refuses (an unknown key whose name holds an escape
    # and a newline), under the agent's real spawner and monitor.
    cfg = tmp_path / "config.yaml"
    cfg.write_text('train:\n  "bo\\e\\ngus": 1\n', encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURMKIT_")}
    env.update({"SLURMKIT_CONFIG": str(cfg), "RANK": "0", "WORLD_SIZE": "1", "SLURMKIT_DEVICE": "cpu",
                "PYTHONUNBUFFERED": "1"})
    mon = RankMonitor("node1", 0, heartbeat_timeout_s=60.0, startup_timeout_s=300.0)
    p = spawn_rank([sys.executable, "-m", "slurmkit.train"], env, rank=0, local_rank=0,
                   log_path=str(tmp_path / "rank0.log"), sink=mon.on_line)
    code = p.proc.wait()
    p.reader.join()  # every line is in the monitor before the exit, as the agent's waiter sees it
    mon.on_exit(0, code)
    assert code == EXIT_CONFIG_ERROR
    log = (tmp_path / "rank0.log").read_text(encoding="utf-8")
    marked = [ln for ln in log.splitlines() if CONFIG_ERROR_MARKER in ln]
    assert len(marked) == 1 and "gus" in marked[0], log  # one line, the whole message on it
    assert all(c.isprintable() for c in marked[0])
    failure = root_cause(mon.evidence)
    assert failure is not None and failure.cls == F.CONFIG_ERROR
    d, _ = decide(failure, History(), None, LIMITS, [], [])
    assert d.action == Action.STOP  # not restarted three times first
