"""FakeSlurm itself: what it accepts, the texts it prints, and its fault controls.

The fake's output goes through the real parsers, so these tests also check that the fake
speaks the same formats as the captures in tests/data/slurm.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from slurmkit.slurm import (
    SlurmCommandError,
    SlurmCommandTimeout,
    parse_sacct,
    parse_scontrol_jobs,
    parse_scontrol_nodes,
    parse_scontrol_partitions,
    parse_squeue,
)
from testkit.fakeslurm import FakeSlurm


def sbatch(fake: FakeSlurm, script: str, *args: str, tmp: Path) -> str:
    path = tmp / "job.sh"
    path.write_text(script)
    return fake.run(["sbatch", "--parsable", *args, str(path)]).stdout.strip()


def test_directives_and_cli_override(tmp_path: Path) -> None:
    fake = FakeSlurm({"debug": "node[1-4]", "gpu": "gpu[01-08]"}, max_time_s={"gpu": 3600})
    script = ("#!/bin/bash\n#SBATCH -J from-script\n#SBATCH --nodes=2 # a comment\n"
              "#SBATCH --partition gpu\n\n#SBATCH --requeue\nsrun x\n#SBATCH --nodes=8\n")
    job_id = sbatch(fake, script, "-N3", "--time=30", tmp=tmp_path)
    job = fake.jobs[job_id]
    # -N3 on the command line wins; "#SBATCH --nodes=8" after the first command is ignored.
    assert (job.name, job.num_nodes, job.partition, job.requeue) == ("from-script", 3, "gpu", True)
    assert job.time_limit_s == 1800


@pytest.mark.parametrize("args,message", [
    (["--partition=nope"], "sbatch: error: Batch job submission failed: Invalid partition name specified"),
    (["-N", "9"], "sbatch: error: Batch job submission failed: Requested node configuration is not available"),
    (["-p", "gpu", "-t", "2:00:00"], "Requested time limit is invalid"),
    (["--time=banana"], "Invalid numeric value"),
])
def test_sbatch_rejections(tmp_path: Path, args: list[str], message: str) -> None:
    fake = FakeSlurm({"debug": "node[1-4]", "gpu": "gpu[01-08]"}, max_time_s={"gpu": 3600})
    with pytest.raises(SlurmCommandError) as info:
        sbatch(fake, "#!/bin/bash\nsrun x\n", *args, tmp=tmp_path)
    assert message in info.value.stderr and info.value.returncode == 1
    assert fake.jobs == {}


def test_sbatch_from_stdin_and_missing_file() -> None:
    fake = FakeSlurm(cluster_name="c1")
    out = fake.run(["sbatch", "--parsable", "--hold"], input="#!/bin/bash\n#SBATCH -J s\nx\n")
    assert out.stdout == "1;c1\n" and fake.jobs["1"].held
    with pytest.raises(SlurmCommandError, match="Unable to open file"):
        fake.run(["sbatch", "/does/not/exist.sh"])


def test_show_job_forms_parse_alike(tmp_path: Path) -> None:
    fake = FakeSlurm()
    assert fake.run(["scontrol", "show", "job"]).stdout == "No jobs in the system\n"
    for _ in range(2):
        sbatch(fake, "#!/bin/bash\n#SBATCH -J 'two words'\nx\n", tmp=tmp_path)
    fake.start("1")
    one_line = parse_scontrol_jobs(fake.run(["scontrol", "show", "job", "-o"]).stdout)
    multi = parse_scontrol_jobs(fake.run(["scontrol", "show", "job"]).stdout)
    assert one_line == multi and [j.name for j in multi] == ["two words", "two words"]
    assert multi[0].state == "RUNNING" and multi[0].batch_host == "node1"
    assert multi[1].num_nodes == 1 and multi[1].node_list is None


def test_node_failure_requeues_requeueable_jobs(tmp_path: Path) -> None:
    fake = FakeSlurm(clock=lambda: 1_700_000_000.0)
    keep = sbatch(fake, "#!/bin/bash\n#SBATCH --requeue\n#SBATCH -N 2\nx\n", tmp=tmp_path)
    lose = sbatch(fake, "#!/bin/bash\n#SBATCH -N 2\nx\n", tmp=tmp_path)
    fake.start(keep, ["node1", "node2"])
    fake.start(lose, ["node3", "node4"])
    fake.fail_node("node2")
    fake.fail_node("node4")
    assert (fake.jobs[keep].state, fake.jobs[keep].restarts) == ("PENDING", 1)
    assert fake.jobs[keep].eligible_time == 1_700_000_000.0 + 121
    assert fake.jobs[lose].state == "NODE_FAIL"
    rows = parse_sacct(fake.run(["sacct", "--duplicates", "--parsable2", "--noheader", "-o",
                                 "JobID,JobName,State,ExitCode,NodeList", "-j", keep]).stdout,
                       ["JobID", "JobName", "State", "ExitCode", "NodeList"])
    assert [(r.job_id, r.state) for r in rows] == [
        (keep, "NODE_FAIL"), (f"{keep}.batch", "CANCELLED"), (f"{keep}.0", "CANCELLED"),
        (keep, "PENDING")]
    nodes = {n.name: n for n in parse_scontrol_nodes(
        fake.run(["scontrol", "show", "node", "-o"]).stdout)}
    assert nodes["node2"].state == "DOWN" and "NOT_RESPONDING" in nodes["node2"].flags
    assert nodes["node1"].state == "IDLE" and nodes["node1"].usable


def test_node_drain_and_resume() -> None:
    fake = FakeSlurm()
    fake.run(["scontrol", "update", "nodename=node[2-3]", "state=drain", "reason=xid79"])
    nodes = {n.name: n for n in parse_scontrol_nodes(fake.run(["scontrol", "show", "node"]).stdout)}
    assert nodes["node2"].flags == ("DRAIN",) and nodes["node2"].reason.startswith("xid79")  # type: ignore[union-attr]
    fake.run(["scontrol", "update", "NodeName=node2", "State=RESUME"])
    (node2,) = parse_scontrol_nodes(fake.run(["scontrol", "show", "node", "node2"]).stdout)
    assert node2.usable and node2.reason is None
    with pytest.raises(SlurmCommandError, match="Invalid node name specified"):
        fake.run(["scontrol", "update", "nodename=node9", "state=down"])


def test_update_refusals_use_real_texts(tmp_path: Path) -> None:
    fake = FakeSlurm()
    job_id = sbatch(fake, "#!/bin/bash\nx\n", tmp=tmp_path)
    fake.start(job_id)
    with pytest.raises(SlurmCommandError, match="Job is no longer pending execution for job 1"):
        fake.run(["scontrol", "update", f"jobid={job_id}", "ExcNodeList=node2"])
    fake.finish(job_id)
    with pytest.raises(SlurmCommandError, match="Job has already finished for job 1"):
        fake.run(["scontrol", "update", f"jobid={job_id}", "StartTime=now"])
    with pytest.raises(SlurmCommandError, match="Invalid job id specified"):
        fake.run(["scontrol", "update", "jobid=77", "StartTime=now"])


def test_sacct_rejects_unknown_field_like_22_05() -> None:
    with pytest.raises(SlurmCommandError) as info:
        FakeSlurm().run(["sacct", "-o", "JobID,Restarts", "--parsable2"])
    assert info.value.stderr == 'sacct: error: Invalid field requested: "Restarts"'


def test_squeue_formats(tmp_path: Path) -> None:
    fake = FakeSlurm()
    sbatch(fake, "#!/bin/bash\n#SBATCH -J a\nx\n", tmp=tmp_path)
    sbatch(fake, "#!/bin/bash\n#SBATCH -J b\nx\n", "--hold", tmp=tmp_path)
    fake.start("1")
    rows = parse_squeue(fake.run(["squeue", "--noheader", "-o", "%i|%j|%T|%M|%D|%R"]).stdout)
    assert [(r.job_id, r.state, r.node_list, r.reason) for r in rows] == [
        ("1", "RUNNING", "node1", None), ("2", "PENDING", None, "JobHeldUser")]
    assert fake.run(["squeue", "-h", "-o", "%.10i %P %u", "-j", "2"]).stdout == "2 debug root\n"
    fake.finish("1")
    assert fake.run(["squeue", "-h", "-j", "1"]).stdout == ""  # finished: not in the queue


def test_partitions_parse(tmp_path: Path) -> None:
    fake = FakeSlurm({"cpu": "c[1-2]", "gpu": "g[01-04]"}, max_time_s={"gpu": 7200})
    parts = parse_scontrol_partitions(fake.run(["scontrol", "show", "partition"]).stdout)
    assert [(p.name, p.default, p.max_time_s, p.total_nodes) for p in parts] == [
        ("cpu", True, None, 2), ("gpu", False, 7200, 4)]


def test_fault_injection_and_records(tmp_path: Path) -> None:
    fake = FakeSlurm()
    fake.fail_next(1, command="sacct")
    fake.fail_next(1, None, command="squeue")
    fake.run(["scontrol", "ping"], env={"A": "1"})  # not matched by either injection
    with pytest.raises(SlurmCommandTimeout):
        fake.run(["squeue"])
    with pytest.raises(SlurmCommandError, match="Socket timed out"):
        fake.run(["sacct"])
    fake.run(["sacct"])
    assert fake.calls == [["scontrol", "ping"], ["squeue"], ["sacct"], ["sacct"]]
    assert fake.envs[0] == {"A": "1"} and fake.envs[1] is None


def test_controller_down() -> None:
    fake = FakeSlurm()
    fake.controller_up = False
    with pytest.raises(SlurmCommandError, match="Unable to contact slurm controller"):
        fake.run(["squeue"])
    with pytest.raises(SlurmCommandError) as info:
        fake.run(["scontrol", "ping"])
    assert "is DOWN" in info.value.stderr


def test_forget_keeps_accounting(tmp_path: Path) -> None:
    fake = FakeSlurm()
    job_id = sbatch(fake, "#!/bin/bash\nx\n", tmp=tmp_path)
    fake.start(job_id)
    fake.finish(job_id, "FAILED", exit_code=2)
    fake.forget(job_id)
    with pytest.raises(SlurmCommandError, match="Invalid job id specified"):
        fake.run(["scontrol", "show", "job", job_id])
    (row,) = parse_sacct(fake.run(["sacct", "-X", "-o", "JobID,State,ExitCode", "-j",
                                   job_id]).stdout, ["JobID", "State", "ExitCode"])
    assert (row.state, row.exit_code) == ("FAILED", 2)
