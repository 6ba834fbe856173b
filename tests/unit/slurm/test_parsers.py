"""Parsers against captured Slurm 22.05 output (tests/data/slurm, see its README)."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import pytest

from slurmkit.errors import ConfigError
from slurmkit.slurm.errors import SlurmParseError
from slurmkit.slurm.parsers import (
    parse_duration_s,
    parse_key_values,
    parse_sacct,
    parse_scontrol_config,
    parse_scontrol_job,
    parse_scontrol_jobs,
    parse_scontrol_nodes,
    parse_scontrol_partitions,
    parse_squeue,
)

DATA = Path(__file__).resolve().parents[2] / "data" / "slurm"


def capture(name: str) -> str:
    return (DATA / name).read_text()


# --- scontrol show job --------------------------------------------------------------------------

JOB_CASES = [
    # file, job_id, name, state, reason, restarts, node_list, exc, batch_host, num_nodes, requeue
    ("job_running.txt", "4", "capture-sleep", "RUNNING", None, 0, "node2", None, "node2", 1, True),
    ("job_completed.txt", "2", "capture-ok", "COMPLETED", None, 0, "node[1-2]", None, "node1", 2,
     False),
    ("job_requeued_o.txt", "4", "capture-sleep", "PENDING", "BeginTime", 1, None, None, None, 1,
     True),
    ("job_held_o.txt", "5", "capture-held", "PENDING", "JobHeldUser", 0, None, "node4", None, 2,
     False),
    ("job_failed_o.txt", "6", "capture fail|pipe", "FAILED", "NonZeroExitCode", 0, "node2", None,
     "node2", 1, False),
]


@pytest.mark.parametrize(
    "name,job_id,job_name,state,reason,restarts,node_list,exc,batch_host,num_nodes,requeue",
    JOB_CASES)
def test_scontrol_job_fields(name: str, job_id: str, job_name: str, state: str,
                             reason: str | None, restarts: int, node_list: str | None,
                             exc: str | None, batch_host: str | None, num_nodes: int,
                             requeue: bool) -> None:
    job = parse_scontrol_job(capture(name))
    assert (job.job_id, job.name, job.state, job.reason) == (job_id, job_name, state, reason)
    assert job.restart_cnt == restarts
    assert job.node_list == node_list
    assert job.exc_node_list == exc
    assert job.batch_host == batch_host
    assert job.num_nodes == num_nodes
    assert job.requeue is requeue
    assert job.user == "root"
    assert job.work_dir == "/tmp/capt"


def test_scontrol_job_times_and_exit_code() -> None:
    requeued = parse_scontrol_job(capture("job_requeued_o.txt"))
    # After a requeue Slurm delays eligibility ~121 s: the reason release_now exists.
    assert requeued.eligible_time == datetime(2026, 11, 30, 1, 17, 3)
    assert requeued.submit_time == datetime(2026, 11, 30, 1, 15, 2)
    assert requeued.time_limit_s == 300
    held = parse_scontrol_job(capture("job_held_o.txt"))
    assert held.eligible_time is None and held.start_time is None
    assert held.time_limit_s is None  # UNLIMITED
    assert held.held and not requeued.held
    assert held.excluded_nodes == ["node4"]
    failed = parse_scontrol_job(capture("job_failed_o.txt"))
    assert (failed.exit_code, failed.exit_signal) == (3, 0)
    assert failed.command == "/tmp/capt/fail.sh"
    assert failed.raw["AllocNode:Sid"] == "localhost:4202"


def test_scontrol_job_one_line_and_multi_line_agree() -> None:
    multi = parse_scontrol_jobs(capture("jobs_all.txt"))
    assert len(multi) == 6
    by_id = {j.job_id: j for j in multi}
    one_line = parse_scontrol_job(capture("job_failed_o.txt"))
    assert by_id["6"].name == one_line.name == "capture fail|pipe"
    assert by_id["6"].raw == one_line.raw
    assert by_id["2"].nodes == ["node1", "node2"]


def test_scontrol_job_value_with_spaces_and_equals() -> None:
    kv = parse_key_values(
        "JobId=7 JobName=my job Reason=ReqNodeNotAvail,_UnavailableNodes:node2 "
        "TRES=cpu=2,node=1 Command=/home/a b/run.sh WorkDir=/home/a b")
    assert kv["JobName"] == "my job"
    assert kv["TRES"] == "cpu=2,node=1"
    assert kv["Command"] == "/home/a b/run.sh"
    assert kv["WorkDir"] == "/home/a b"


@pytest.mark.parametrize("text", ["", "No jobs in the system\n"])
def test_scontrol_jobs_empty(text: str) -> None:
    assert parse_scontrol_jobs(text) == []


@pytest.mark.parametrize("text", ["garbage without keys", "NodeName=node1 State=IDLE"])
def test_scontrol_job_rejects_other_output(text: str) -> None:
    with pytest.raises(SlurmParseError):
        parse_scontrol_job(text)


# --- scontrol show node -------------------------------------------------------------------------

NODE_CASES = [
    # name, state, flags, reason, usable
    ("gpu001", "MIXED", (), None, True),
    ("gpu002", "ALLOCATED", (), None, True),
    ("gpu003", "IDLE", ("DRAIN",), "Xid 79: GPU has fallen off the bus [root@2026-11-30T01:20:00]",
     False),
    ("gpu004", "DOWN", ("NOT_RESPONDING",), "Not responding [slurm@2026-11-30T01:21:13]", False),
    ("gpu010", "DOWN", ("NOT_RESPONDING", "DRAIN"), "Kill task failed [root@2026-11-30T01:22:40]",
     False),
    ("gpu011", "ALLOCATED", ("COMPLETING",), None, True),
]


@pytest.mark.parametrize("name,state,flags,reason,usable", NODE_CASES)
def test_scontrol_node_states(name: str, state: str, flags: tuple[str, ...], reason: str | None,
                              usable: bool) -> None:
    nodes = {n.name: n for n in parse_scontrol_nodes(capture("nodes_faults_composed_o.txt"))}
    node = nodes[name]
    assert (node.state, node.flags, node.reason, node.usable) == (state, flags, reason, usable)
    assert node.gpus == 4


@pytest.mark.parametrize("name", ["nodes_idle.txt", "nodes_idle_o.txt"])
def test_scontrol_nodes_captured(name: str) -> None:
    nodes = parse_scontrol_nodes(capture(name))
    assert [n.name for n in nodes] == ["node1", "node2", "node3", "node4"]
    for n in nodes:
        assert (n.state, n.flags, n.gres, n.gpus) == ("IDLE", (), "gpu:4", 4)
        assert (n.cpu_tot, n.real_memory_mb, n.partitions) == (2, 4000, ("debug",))
        assert n.raw["OS"].startswith("Linux ")  # a value with spaces and '#'
        assert n.raw["CfgTRES"] == "cpu=2,mem=4000M,billing=2,gres/gpu=4"


@pytest.mark.parametrize("gres,gpus", [
    ("gpu:4", 4), ("gpu:a100:8(S:0-1)", 8), ("(null)", 0), ("gpu:h100:4,nic:2", 4)])
def test_node_gpu_count(gres: str, gpus: int) -> None:
    (node,) = parse_scontrol_nodes(f"NodeName=n1 State=IDLE Gres={gres}")
    assert node.gpus == gpus


# --- partitions, config, squeue -----------------------------------------------------------------

@pytest.mark.parametrize("name", ["partitions.txt", "partitions_o.txt"])
def test_scontrol_partitions(name: str) -> None:
    (p,) = parse_scontrol_partitions(capture(name))
    assert (p.name, p.nodes, p.state, p.total_cpus, p.total_nodes) == (
        "debug", "node[1-4]", "UP", 8, 4)
    assert p.max_time_s is None and p.default
    assert p.node_names == ["node1", "node2", "node3", "node4"]


def test_partition_max_time() -> None:
    (p,) = parse_scontrol_partitions(
        "PartitionName=gpu Default=NO MaxTime=2-00:00:00 Nodes=gpu[001-064] State=DRAIN "
        "TotalCPUs=8192 TotalNodes=64")
    assert (p.max_time_s, p.state, p.default, len(p.node_names)) == (172800, "DRAIN", False, 64)


def test_scontrol_config() -> None:
    conf = parse_scontrol_config(capture("config.txt"))
    assert conf["KillWait"] == "10 sec"
    assert conf["SlurmdTimeout"] == "10 sec"
    assert conf["MinJobAge"] == "600 sec"
    assert conf["ClusterName"] == "slurmkit"
    assert parse_duration_s(conf["KillWait"]) == 10
    assert "Configuration" not in conf and not any(k.startswith("Slurmctld(") for k in conf)


@pytest.mark.parametrize("value,seconds", [
    ("30 sec", 30), ("5 min", 300), ("0 sec", 0), ("UNLIMITED", None), ("(null)", None)])
def test_parse_duration_s(value: str, seconds: int | None) -> None:
    assert parse_duration_s(value) == seconds


def test_squeue_rows() -> None:
    held, running = parse_squeue(capture("squeue.txt"))
    assert (held.job_id, held.state, held.reason, held.node_list, held.num_nodes) == (
        "5", "PENDING", "JobHeldUser", None, 2)
    assert (running.job_id, running.state, running.node_list, running.time_used_s) == (
        "4", "RUNNING", "node2", 3)


def test_squeue_name_with_pipe_and_long_time() -> None:
    (row,) = parse_squeue("77|a|b|RUNNING|1-02:03:04|16|gpu[001-016]\n")
    assert (row.name, row.time_used_s, row.num_nodes) == ("a|b", 93784, 16)


# --- sacct --------------------------------------------------------------------------------------

SACCT_CASES = [
    # file, job_id, base, step, het, state, by_uid, exit_code, exit_signal, elapsed_s, node_list
    ("sacct_mixed.txt", "2", "2", None, None, "COMPLETED", None, 0, 0, 0, "node[1-2]"),
    ("sacct_mixed.txt", "2.batch", "2", "batch", None, "COMPLETED", None, 0, 0, 0, "node1"),
    ("sacct_mixed.txt", "3", "3", None, None, "FAILED", None, 0, 6, 0, "node1"),
    ("sacct_mixed.txt", "5", "5", None, None, "CANCELLED", 0, 0, 0, 0, None),
    ("sacct_mixed.txt", "6", "6", None, None, "FAILED", None, 3, 0, 0, "node2"),
    ("sacct_mixed.txt", "4.0", "4", "0", None, "CANCELLED", None, 0, 10, 2, "node1"),
    ("sacct_faults_composed.txt", "101", "101", None, None, "NODE_FAIL", None, 0, 0, 643,
     "gpu[001-004,010]"),
    ("sacct_faults_composed.txt", "101.extern", "101", "extern", None, "COMPLETED", None, 0, 0,
     643, "gpu[001-004,010]"),
    ("sacct_faults_composed.txt", "102", "102", None, None, "OUT_OF_MEMORY", None, 0, 125, 30,
     "gpu002"),
    ("sacct_faults_composed.txt", "103", "103", None, None, "TIMEOUT", None, 0, 0, 93612,
     "gpu[001-002]"),
    ("sacct_faults_composed.txt", "104+0.batch", "104", "batch", 0, "COMPLETED", None, 0, 0, 60,
     "gpu003"),
    ("sacct_faults_composed.txt", "104+1", "104", None, 1, "COMPLETED", None, 0, 0, 60,
     "gpu[010-011]"),
    ("sacct_faults_composed.txt", "105_3", "105_3", None, None, "PENDING", None, 0, 0, 0, None),
    ("sacct_faults_composed.txt", "106.batch", "106", "batch", None, "FAILED", None, 134, 0, 662,
     "gpu001"),
    ("sacct_faults_composed.txt", "106.0", "106", "0", None, "CANCELLED", 0, 0, 6, 660,
     "gpu[001-002]"),
]


@pytest.mark.parametrize(
    "name,job_id,base,step,het,state,by_uid,exit_code,exit_signal,elapsed_s,node_list",
    SACCT_CASES)
def test_sacct_rows(name: str, job_id: str, base: str, step: str | None, het: int | None,
                    state: str, by_uid: int | None, exit_code: int, exit_signal: int,
                    elapsed_s: int, node_list: str | None) -> None:
    rows = {r.job_id: r for r in parse_sacct(capture(name))}
    r = rows[job_id]
    assert (r.base_job_id, r.step, r.het_offset, r.state, r.by_uid) == (
        base, step, het, state, by_uid)
    assert (r.exit_code, r.exit_signal, r.elapsed_s, r.node_list) == (
        exit_code, exit_signal, elapsed_s, node_list)
    assert r.is_step is (step is not None)


def test_sacct_pipe_in_name_times_and_reason() -> None:
    rows = {r.job_id: r for r in parse_sacct(capture("sacct_mixed.txt"))}
    assert rows["6"].name == "capture fail|pipe"
    assert rows["5"].reason == "JobHeldUser"
    assert rows["5"].start is None and rows["5"].end == datetime(2026, 11, 30, 1, 15, 9)
    assert rows["2"].nodes == ["node1", "node2"]
    assert rows["2"].restarts is None  # not a sacct field in 22.05


def test_sacct_duplicates_show_each_run() -> None:
    rows = [r for r in parse_sacct(capture("sacct_requeued_duplicates.txt")) if not r.is_step]
    assert [r.state for r in rows] == ["REQUEUED", "CANCELLED"]
    assert [r.node_list for r in rows] == ["node2", "node1"]


def test_sacct_custom_fields_and_errors() -> None:
    (row,) = parse_sacct("9|COMPLETED|3\n", fields=["JobID", "State", "Restarts"])
    assert (row.job_id, row.state, row.restarts, row.name) == ("9", "COMPLETED", 3, "")
    with pytest.raises(SlurmParseError):
        parse_sacct("9|COMPLETED\n", fields=["JobID", "State", "ExitCode"])
    with pytest.raises(SlurmParseError):
        parse_sacct("batch|COMPLETED\n", fields=["JobID", "State"])
    with pytest.raises(SlurmParseError):
        parse_sacct("9|COMPLETED|1:x\n", fields=["JobID", "State", "ExitCode"])


def test_bad_time_in_output_is_a_parse_error_not_config_error() -> None:
    with pytest.raises(SlurmParseError) as info:
        parse_sacct("9|x|COMPLETED|0:0|None|None|banana|None|None\n")
    assert not isinstance(info.value, ConfigError)
