"""The agents launched in srun steps of several nodes (launch.nodes_per_step): the size chosen
from the job, the batch script's steps (the rendered shell run with a recording srun), and each
agent finding its node rank and its log in a step of several nodes."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from slurmkit.config.compose import compose
from slurmkit.errors import ConfigError, SlurmkitError
from slurmkit.launch.context import GROUP_LOG_ENV, group_log, node_context
from slurmkit.render.jobspec import AUTO_STEPS, build_jobspec, nodes_per_step
from slurmkit.render.sbatch import launch_agents, render_standalone


@pytest.mark.parametrize("nodes,configured,expected", [
    (1, 0, 1), (4, 0, 1), (AUTO_STEPS, 0, 1), (AUTO_STEPS + 1, 0, 2), (2049, 0, 128), (2048, 0, 128), (64, 0, 4),
    (4, 3, 3), (2048, 1, 1),
])
def test_nodes_per_step(nodes: int, configured: int, expected: int) -> None:
    assert nodes_per_step(nodes, configured) == expected
    steps = 1 + -(-(nodes - 1) // expected)
    if configured == 0:
        assert steps <= AUTO_STEPS


def test_a_negative_nodes_per_step_is_refused() -> None:
    with pytest.raises(ConfigError) as exc:
        compose(["+exp=tiny", "cluster=local_slurm", "launch.nodes_per_step=-1"])
    assert "launch.nodes_per_step=-1" in str(exc.value) and "Fix:" in str(exc.value)


def test_the_spec_carries_the_resolved_size() -> None:
    cfg = compose(["+exp=tiny", "cluster=local_slurm", "job.nodes=3", "launch.nodes_per_step=2"])
    assert build_jobspec(cfg, "/shared/runs/x", []).nodes_per_step == 2
    cfg = compose(["+exp=tiny", "cluster=local_slurm", "job.nodes=3"])
    assert build_jobspec(cfg, "/shared/runs/x", []).nodes_per_step == 1


def run_launch(tmp_path: Path, nodes: list[str], group: int, train: int = 0) -> list[list[str]]:
    """Run the rendered launch lines with an srun that records its environment's node rank and
    log directory and its arguments (one line per srun)."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    record = tmp_path / "sruns"
    (bindir / "srun").write_text(
        "#!/bin/bash\n"
        f"echo \"${{SLURMKIT_NODE_RANK:--}}|${{SLURMKIT_GROUP_LOG_DIR:--}}|$*\" >> {record}\n")
    (bindir / "scontrol").write_text("#!/bin/bash\nprintf '%s\\n' " + " ".join(nodes) + "\n")
    for f in bindir.iterdir():
        f.chmod(0o755)
    script = tmp_path / "launch.sh"
    script.write_text(launch_agents(str(tmp_path / "logs"), ["--kill-on-bad-exit=0"], "agent RUN", group, train) + "\n")
    env = dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}", SLURM_JOB_NODELIST="x")
    res = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return [line.split("|") for line in sorted(record.read_text().splitlines())]


def test_node_0_has_a_step_of_its_own_and_the_others_share_steps(tmp_path: Path) -> None:
    nodes = [f"n{i}" for i in range(7)]
    logs = str(tmp_path / "logs")
    sruns = run_launch(tmp_path, nodes, 3)
    assert len(sruns) == 3  # 1 + ceil(6 / 3) step creates, not 7
    by_list = {next(a for a in args.split() if a.startswith("--nodelist=")): (rank, log, args)
               for rank, log, args in sruns}
    rank, log, args = by_list["--nodelist=n0"]
    assert (rank, log) == ("0", "-") and "--nodes=1 --ntasks=1" in args
    assert f"--output={logs}/%j_node0_log.out" in args
    for members, first in (("n1,n2,n3", 1), ("n4,n5,n6", 4)):
        rank, log, args = by_list[f"--nodelist={members}"]
        assert (rank, log) == ("-", logs)  # each agent finds its own rank and log
        assert "--nodes=3 --ntasks=3 --ntasks-per-node=1" in args and args.endswith("agent RUN")
        assert f"--output={logs}/%j_step{first}_%t_log.out" in args


def test_a_short_last_step_and_one_node_per_step(tmp_path: Path) -> None:
    nodes = [f"n{i}" for i in range(6)]
    (tmp_path / "a").mkdir()
    lists = sorted(a for _, _, args in run_launch(tmp_path / "a", nodes, 4) for a in args.split()
                   if a.startswith("--nodelist="))
    assert lists == ["--nodelist=n0", "--nodelist=n1,n2,n3,n4", "--nodelist=n5"]
    (tmp_path / "b").mkdir()
    sruns = run_launch(tmp_path / "b", nodes, 1)
    assert sorted(r for r, _, _ in sruns) == ["0", "1", "2", "3", "4", "5"]  # one step per node, as before


def test_no_step_holds_a_train_node_and_a_spare(tmp_path: Path) -> None:
    nodes = [f"n{i}" for i in range(8)]  # 5 train nodes, 3 spares
    lists = sorted(a for _, _, args in run_launch(tmp_path, nodes, 3, train=5) for a in args.split()
                   if a.startswith("--nodelist="))
    assert lists == ["--nodelist=n0", "--nodelist=n1,n2,n3", "--nodelist=n4", "--nodelist=n5,n6,n7"]


def test_the_standalone_script_renders_the_configured_size() -> None:
    cfg = compose(["+exp=tiny", "cluster=local_slurm", "job.nodes=3", "launch.nodes_per_step=2"])
    spec = build_jobspec(cfg, "/shared/runs/x", [])
    assert "SLURMKIT_GROUP=2\n" in render_standalone(spec, "/shared/runs/x/job.sbatch", python="python3")
    assert "SLURMKIT_GROUP=5\n" in render_standalone(dataclasses.replace(spec, nodes_per_step=5),
                                                     "/shared/runs/x/job.sbatch", python="python3")
    with pytest.raises(ValueError):
        launch_agents(None, [], "agent", 0)


GROUP_ENV = {"SLURM_JOB_ID": "41", "SLURM_NODEID": "1", "SLURM_NNODES": "3", "SLURM_JOB_NODELIST": "n[0-6]",
             "SLURMKIT_NODES": "n0,n1,n2,n3,n4,n5,n6", "SLURMD_NODENAME": "n5", GROUP_LOG_ENV: "/logs"}


def test_an_agent_in_a_shared_step_finds_its_node_rank_and_log() -> None:
    ctx = node_context(GROUP_ENV)  # the step's SLURM_NODEID (1) and SLURM_NNODES (3) are the step's
    assert (ctx.node_rank, ctx.num_nodes, ctx.node_name) == (5, 7, "n5")
    assert group_log(GROUP_ENV, 5) == "/logs/41_node5_log.out"
    # a step of one node (and a relaunched agent) names its rank and its --output: no redirect
    assert group_log({**GROUP_ENV, "SLURMKIT_NODE_RANK": "5"}, 5) is None
    assert group_log({k: v for k, v in GROUP_ENV.items() if k != GROUP_LOG_ENV}, 5) is None


@pytest.mark.parametrize("name", ["n9", "n0"])
def test_a_shared_step_on_a_node_not_in_the_list_or_node_0_is_refused(name: str) -> None:
    with pytest.raises(SlurmkitError) as exc:
        node_context({**GROUP_ENV, "SLURMD_NODENAME": name})
    text = str(exc.value)
    assert "Detected:" in text and "Fix:" in text and repr(name) in text


REDIRECT = """
import os, sys
from slurmkit.launch.context import redirect_output
redirect_output(sys.argv[1])
print("from python")
os.system("echo from a child")
print("to stderr", file=sys.stderr)
"""


def test_redirect_output_appends_for_the_process_and_its_children(tmp_path: Path) -> None:
    log = tmp_path / "41_node5_log.out"
    log.write_text("earlier\n")
    res = subprocess.run([sys.executable, "-c", REDIRECT, str(log)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stdout == "" and res.stderr == ""
    assert log.read_text().splitlines() == ["earlier", "from python", "from a child", "to stderr"]


def test_redirect_output_does_not_follow_a_planted_link(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("keep\n")
    link = tmp_path / "41_node5_log.out"
    link.symlink_to(target)
    res = subprocess.run([sys.executable, "-c", REDIRECT, str(link)], capture_output=True, text=True, timeout=60)
    assert res.returncode != 0 and "Too many levels of symbolic links" in res.stderr
    assert target.read_text() == "keep\n"


def test_a_step_that_ends_first_is_said_in_the_log_and_in_the_file_node_0_reads(tmp_path: Path) -> None:
    """The step of n1-n3 fails at once (as srun does when it cannot create the step); node 0's
    agent, still running, finds the line in $SLURMKIT_STEPS_ENDED (copied here before the script
    removes the file at its end)."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    seen = tmp_path / "seen"
    (bindir / "srun").write_text(
        "#!/bin/bash\n"
        "case \"$*\" in\n"
        "  *--nodelist=n0\\ *) for i in $(seq 300); do grep -q '^1 3 ' \"$SLURMKIT_STEPS_ENDED\" && break; "
        f"sleep 0.1; done; cp \"$SLURMKIT_STEPS_ENDED\" {seen}; exit 93 ;;\n"
        "  *--nodelist=n1,n2,n3\\ *) exit 3 ;;\n"
        "  *) for i in $(seq 300); do [ -e " + str(seen) + " ] && break; sleep 0.1; done ;;\n"
        "esac\n")
    (bindir / "scontrol").write_text("#!/bin/bash\nprintf '%s\\n' n0 n1 n2 n3 n4 n5 n6\n")
    for f in bindir.iterdir():
        f.chmod(0o755)
    script = tmp_path / "launch.sh"
    script.write_text(launch_agents(str(tmp_path / "logs"), [], "agent RUN", 3, 7) + "\n")
    env = dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}", SLURM_JOB_NODELIST="x", TMPDIR=str(tmp_path))
    res = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 93  # node 0's code is the job's, as before
    assert seen.read_text().splitlines()[0] == "1 3 3"
    assert "the agents' srun step of node ranks 1-3 ended with code 3" in res.stderr
    assert not [p for p in os.listdir(tmp_path) if p.startswith("slurmkit-steps.")]  # removed at the end


def test_node_0_reads_each_ended_step_once_and_only_non_zero_codes(tmp_path: Path) -> None:
    from slurmkit.supervise.stepsended import StepEnded, StepsEnded

    path = tmp_path / "steps"
    path.write_text("")
    r = StepsEnded(str(path), 7)
    assert r.new() == []
    path.write_text("1 3 3\n4 3 0\n")
    assert r.new() == [StepEnded(1, 3, 3)]
    assert r.new() == []  # read once
    with path.open("a") as f:
        f.write("4 3 137\n9 9 1\n1 x 2\n4 3")  # out of range, garbage, a line still being written
    assert r.new() == [StepEnded(4, 3, 137)]
    with path.open("a") as f:
        f.write(" 1\n")
    assert r.new() == [StepEnded(4, 3, 1)] and list(StepEnded(4, 3, 1).node_ranks) == [4, 5, 6]
    link = tmp_path / "link"
    link.symlink_to(path)
    assert StepsEnded(str(link), 7).new() == []  # not a plain file: ignored
    assert StepsEnded(None, 7).new() == [] and StepsEnded(str(tmp_path / "missing"), 7).new() == []


def test_a_container_job_names_its_container_per_attempt_in_the_script_and_in_relaunches(tmp_path: Path) -> None:
    # The batch script expands the name; node 0's relaunch (batch_srun_prefix) computes it:
    # both must give the same name, or a relaunched agent would import the image again.
    from slurmkit.render.sbatch import CONTAINER_NAME_SHELL, container_name

    bindir = tmp_path / "bin"
    bindir.mkdir()
    record = tmp_path / "sruns"
    (bindir / "srun").write_text(f"#!/bin/bash\necho \"$*\" >> {record}\n")
    (bindir / "scontrol").write_text("#!/bin/bash\nprintf '%s\\n' n0 n1 n2\n")
    for f in bindir.iterdir():
        f.chmod(0o755)
    script = tmp_path / "launch.sh"
    script.write_text(launch_agents(str(tmp_path / "logs"), ["--container-image=img"], "agent RUN", 2, 0,
                                    container=True) + "\n")
    for restart in ("", "2"):
        record.write_text("")
        env = dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}", SLURM_JOB_NODELIST="x", SLURM_JOB_ID="77",
                   SLURM_RESTART_COUNT=restart)
        res = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr
        want = f"--container-name={container_name(env)}"
        lines = record.read_text().splitlines()
        assert len(lines) == 2 and all(want in line.split() for line in lines), lines
        assert want == f"--container-name=slurmkit_77_{restart or 0}"
    assert "${SLURM_RESTART_COUNT:-0}" in CONTAINER_NAME_SHELL


def test_the_run_directory_is_mounted_unless_a_mount_brings_it() -> None:
    import dataclasses

    from slurmkit.config import compose
    from slurmkit.errors import ConfigError
    from slurmkit.render import build_jobspec
    from slurmkit.render.sbatch import container_mounts

    spec = build_jobspec(compose(["+exp=llama8b", "cluster=dgx_h100_container"]), "/lustre/runs/a/1", [])
    assert container_mounts(spec) == ["/lustre/fsw:/lustre/fsw", "/raid/scratch:/nvme", "/lustre/runs/a/1:/lustre/runs/a/1"]
    inside = dataclasses.replace(spec, run_dir="/lustre/fsw/me/runs/a/1")
    assert container_mounts(inside) == ["/lustre/fsw:/lustre/fsw", "/raid/scratch:/nvme"]
    sibling = dataclasses.replace(spec, run_dir="/lustre/fsw2/a")  # a prefix of the name is not the path
    assert container_mounts(sibling)[-1] == "/lustre/fsw2/a:/lustre/fsw2/a"
    with pytest.raises(ConfigError, match="pyxis splits"):
        container_mounts(dataclasses.replace(spec, run_dir="/lustre/a,b/1"))


def test_node_0_relaunches_into_the_same_named_container(tmp_path: Path) -> None:
    from slurmkit.config import compose
    from slurmkit.launch.agent import batch_srun_prefix
    from slurmkit.cli.submit import freeze

    cfg = compose(["+exp=llama8b", "cluster=dgx_h100_container", "job.nodes=2"])
    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir)
    freeze(cfg, run_dir)
    prefix = batch_srun_prefix(cfg, run_dir, {"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "2"})
    assert prefix[:2] == ["srun", "--unbuffered"] and prefix[-1] == "--container-name=slurmkit_77_2"
    assert f"{run_dir}:{run_dir}" in next(a for a in prefix if a.startswith("--container-mounts=")).split("=", 1)[1].split(",")
    plain = batch_srun_prefix(compose(["+exp=tiny", "job.nodes=2"]), run_dir, {"SLURM_JOB_ID": "77"})
    assert not any(a.startswith("--container") for a in plain)
