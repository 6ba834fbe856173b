"""Finding a run's processes: a directory laid out like /proc, and this machine's real /proc."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from testkit.chaos import procs


def fake_proc(root, pid: int, env: dict[str, str], argv: list[str], state: str = "S", start: int = 100,
              comm: str = "python") -> None:
    d = root / str(pid)
    d.mkdir()
    (d / "comm").write_text(comm + "\n")
    (d / "environ").write_bytes(b"".join(f"{k}={v}".encode() + b"\0" for k, v in env.items()))
    (d / "cmdline").write_bytes(b"".join(a.encode() + b"\0" for a in argv))
    rest = [state] + ["0"] * 18 + [str(start)] + ["0"] * 10
    (d / "stat").write_text(f"{pid} (python) " + " ".join(rest))


def test_scan_finds_the_runs_processes_newest_rank_wins_zombies_and_others_are_left_out(tmp_path) -> None:
    root = tmp_path / "proc"
    root.mkdir()
    run = str(tmp_path / "run")
    os.makedirs(run)
    train = ["python", "-m", "slurmkit.train"]
    fake_proc(root, 10, {"SLURMKIT_RUN_DIR": run, "RANK": "1", "SLURMD_NODENAME": "node1"}, train, start=100)
    fake_proc(root, 11, {"SLURMKIT_RUN_DIR": run, "RANK": "1", "SLURMD_NODENAME": "node3"}, train, start=200)
    fake_proc(root, 12, {"SLURMKIT_RUN_DIR": run, "RANK": "0", "SLURMD_NODENAME": "node1"}, train, "Z")
    fake_proc(root, 13, {"SLURMKIT_RUN_DIR": run, "SLURMKIT_NODE_RANK": "1", "SLURMD_NODENAME": "node3"},
              ["python", "-u", "-m", "submitit.core._submit", run + "/submitit"])
    fake_proc(root, 14, {"SLURM_JOB_ID": "42", "SLURMD_NODENAME": "node1"},
              ["/bin/bash", "/spool/node1/job00042/slurm_script"])
    fake_proc(root, 15, {"SLURMKIT_RUN_DIR": str(tmp_path / "other"), "RANK": "0"}, train)
    fake_proc(root, 16, {"SLURM_JOB_ID": "43"}, ["/bin/bash", "slurm_script"])
    (root / "self").mkdir()

    found = procs.scan(run, "42", proc_root=str(root))
    assert sorted(p.pid for p in found) == [10, 11, 13, 14]
    ranks = procs.ranks(found)
    assert list(ranks) == [1] and ranks[1].pid == 11 and ranks[1].node == "node3"
    assert [p.pid for p in found if procs.is_agent(p)] == [13]
    assert [p.pid for p in found if procs.is_batch_shell(p)] == [14]
    assert procs.scan(run, None, proc_root=str(root)) and 14 not in {p.pid for p in procs.scan(run, None, str(root))}


def test_a_warm_standby_counts_as_a_rank_once_it_names_one(tmp_path) -> None:
    root = tmp_path / "proc"
    root.mkdir()
    run = str(tmp_path / "run")
    os.makedirs(run)
    env = {"SLURMKIT_RUN_DIR": run, "RANK": "0", "SLURMD_NODENAME": "node1"}  # as it was started
    standby = ["python", "-m", "slurmkit.launch.standby"]
    fake_proc(root, 20, env, ["python", "-m", "slurmkit.train"], start=100)  # generation 0, cold
    fake_proc(root, 21, env, standby, start=200, comm="skrank3")  # generation 1: rank 3 now
    fake_proc(root, 22, env, standby, start=300, comm="skstandby")  # waits for generation 2
    # a node's fork server and a rank it forked: both show the server's command line and the
    # environment it started with; only the forked one names a rank
    server = ["python", "-P", "-m", "slurmkit.launch.forkserver", "4242", "5"]
    fake_proc(root, 23, env, server, start=150, comm="skforkserver")
    fake_proc(root, 24, env, server, start=400, comm="skrank5")
    # a server forked from the agent and a rank it forked: the agent's command line and
    # environment (no RANK); the agent itself is the one without such a name
    agent = ["python", "-u", "-m", "submitit.core._submit", "/run/submitit"]
    agent_env = {"SLURMKIT_RUN_DIR": run, "SLURMD_NODENAME": "node2"}
    fake_proc(root, 25, agent_env, agent, start=50)
    fake_proc(root, 26, agent_env, agent, start=60, comm="skforkserver")
    fake_proc(root, 27, agent_env, agent, start=500, comm="skrank6")

    found = procs.scan(run, None, proc_root=str(root))
    assert sorted(p.pid for p in found) == [20, 21, 22, 23, 24, 25, 26, 27]
    ranks = procs.ranks(found)
    assert {r: p.pid for r, p in ranks.items()} == {0: 20, 3: 21, 5: 24, 6: 27}
    assert [p.pid for p in found if procs.is_agent(p)] == [25]


def test_scan_sees_a_real_stopped_process_of_the_run(tmp_path) -> None:
    run = str(tmp_path)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                             env={**os.environ, "SLURMKIT_RUN_DIR": run})
    try:
        os.kill(child.pid, signal.SIGSTOP)  # what a hang fault leaves if nobody cleans up
        _, status = os.waitpid(child.pid, os.WUNTRACED)  # returns once the child is stopped
        assert os.WIFSTOPPED(status)
        seen = {p.pid: p for p in procs.scan(run)}
        assert seen[child.pid].state == "T"
    finally:
        child.kill()
        child.wait()
    assert child.pid not in {p.pid for p in procs.scan(run)}
