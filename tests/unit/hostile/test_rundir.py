"""Hostile input to root's tooling and to the run directory's trust (issue 34, items 9 and 14).

Real processes and real files, no cluster. Item 9: ``tools/local-cluster kill-node`` runs as
root; a process of an unprivileged user (setpriv to nobody) that carries forged variables
(``SLURMD_NODENAME``, ``SLURMKIT_NODE``, ``SLURMKIT_CONFIG``) and calls itself slurmstepd is
not taken for a process of the node, and no directory outside what the node's own ranks
could remove themselves goes (testkit/node_loss.py). Item 14: with umask 002
submitit's pickle was 0664 in a 0775 folder and the run directory check accepted it; now
submit makes them 0600 and 0700 and every agent refuses an exposed pickle
(slurmkit/rundir.py). The tests run as root in CI; those that change uid skip otherwise.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from slurmkit.rundir import PICKLE_MODE, SUBMITIT_DIR_MODE, RunDirError, check_run_dir
from testkit import node_loss

NOBODY = 65534
NODE = "hostile9"
AS_ROOT = os.geteuid() == 0 and shutil.which("setpriv") is not None
needs_root = pytest.mark.skipif(not AS_ROOT, reason="changes uid: needs root and setpriv")
DROP = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]

# A stand-in for slurmstepd: root, argv[0] "slurmstepd: [7.0]", its socket bound in the node's
# spool directory as slurmstepd binds it, and two ranks of the job run as nobody below it.
STEPD = """
import os, socket, subprocess, sys, time
spool, node, cfg_own, cfg_victim, forked_run = sys.argv[1:6]
s = socket.socket(socket.AF_UNIX)
s.bind(os.path.join(spool, node + "_7.0"))
s.listen()
ranks = [subprocess.Popen([*%r, "sleep", "600"], env={"SLURMKIT_NODE": node, "SLURMKIT_CONFIG": c,
         "PATH": os.environ["PATH"]}) for c in (cfg_own, cfg_victim)]
# a rank forked from a server the agent forked: the agent's environment (Slurm's node name only)
ranks.append(subprocess.Popen([*%r, "sleep", "600"], env={"SLURMD_NODENAME": node, "SLURMKIT_RUN_DIR": forked_run,
             "SLURMKIT_CONFIG": os.path.join(forked_run, "config.yaml"), "PATH": os.environ["PATH"]}))
print(" ".join(str(r.pid) for r in ranks), flush=True)
time.sleep(600)
""" % (DROP, DROP)


def wait_until(what: str, check: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout_s} s")
        time.sleep(0.02)


def argv0(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0", 1)[0]
    except OSError:
        return b""


def node_dir(root: Path, owner: int) -> Path:
    """``<root>/<NODE>`` with a file in it, owned by ``owner``; what a node loss may take."""
    d = root / NODE
    d.mkdir(parents=True)
    (d / "shard.bin").write_bytes(b"x")
    for p in (root, d, d / "shard.bin"):
        os.chown(p, owner, owner)
    return d


def config(path: Path, nvme_root: Path) -> str:
    path.write_text(f"store:\n  nvme_uri: {nvme_root}\n")
    path.chmod(0o644)
    return str(path)


@pytest.fixture
def world() -> Iterator[Path]:
    """A directory nobody can read (pytest's tmp_path is root's 0700)."""
    base = Path(tempfile.mkdtemp(prefix="slurmkit-hostile-", dir="/tmp"))
    base.chmod(0o755)
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def start(procs: list[subprocess.Popen[Any]], *args: Any, **kwargs: Any) -> subprocess.Popen[Any]:
    p = subprocess.Popen(*args, **kwargs)
    procs.append(p)
    return p


def stop(procs: list[subprocess.Popen[Any]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=30)


def case_item9_kill_node_trusts_no_process_environment(base: Path) -> None:
    """A forged process is not selected; nothing its config names is removed; the node's own
    ranks are, and only their user's directory goes, also for a rank whose environment is its
    agent's (forked from a server the agent forked: no SLURMKIT_NODE, Slurm's node name)."""
    spool = base / "spool"
    spool.mkdir(mode=0o755)
    spool.chmod(0o755)
    own = node_dir(base / "own", NOBODY)  # the job's NVMe on the node: goes with the node
    victim = node_dir(base / "victim", 0)  # root's: a rank's config names it; it must stay
    roots_own = node_dir(base / "rootspool", 0)  # what the forged process points at
    forked_own = node_dir(base / "forked", NOBODY)  # a forked rank's run (its config.yaml) names it
    forked_run = base / "forked-run"
    forked_run.mkdir()
    config(forked_run / "config.yaml", base / "forked")
    procs: list[subprocess.Popen[Any]] = []
    try:
        stepd = start(procs, ["slurmstepd: [7.0]", "-c", STEPD, str(spool), NODE,
                              config(base / "own.yaml", base / "own"),
                              config(base / "victim.yaml", base / "victim"), str(forked_run)],
                      executable=sys.executable, stdout=subprocess.PIPE)
        ranks = [int(p) for p in stepd.stdout.readline().split()]  # type: ignore[union-attr]
        forged_env = {"SLURMD_NODENAME": NODE, "SLURMKIT_NODE": NODE, "PATH": os.environ["PATH"],
                      "SLURMKIT_CONFIG": config(base / "forged.yaml", base / "rootspool")}
        forged = start(procs, [*DROP, "bash", "-c", 'exec -a "slurmstepd: [7.0]" sleep 600'],
                       env=forged_env)
        wait_until("the ranks' and the forged process's exec",
                   lambda: all(argv0(p) in (b"sleep", b"slurmstepd: [7.0]") for p in [*ranks, forged.pid])
                   and argv0(forged.pid) == b"slurmstepd: [7.0]")
        chosen = node_loss.node_processes(NODE, str(spool))
        pids = {p.pid for p in chosen}
        assert forged.pid not in pids, "a process of nobody with forged variables was taken for the node's"
        assert {stepd.pid, *ranks} <= pids, (pids, stepd.pid, ranks)
        # Had the forged process been chosen, its word would still move nothing of root's.
        (forged_proc,) = [p for p in [node_loss.read_process(forged.pid)] if p is not None]
        assert node_loss.remove_nvme_dirs(node_loss.nvme_requests([forged_proc], NODE), NODE) == []
        requests = node_loss.nvme_requests(chosen, NODE)
        assert node_loss.kill(chosen) and forged.poll() is None
        assert sorted(node_loss.remove_nvme_dirs(requests, NODE)) == sorted([str(own), str(forked_own)])
        assert not own.exists() and not forked_own.exists()
        assert (victim / "shard.bin").exists() and (roots_own / "shard.bin").exists()
        wait_until("the stand-in slurmstepd's death", lambda: stepd.poll() is not None)
    finally:
        stop(procs)


def case_item14_exposed_submitit_pickle(base: Path) -> None:
    """A pickle that the group could replace (0664 in a folder the group reaches) is refused
    by the check every agent runs; the agent exits 93 (do not requeue)."""
    from slurmkit.contract import EXIT_NO_REQUEUE
    from slurmkit.launch.agent import agent_main

    run_dir = frozen_run(base)
    os.chmod(run_dir, 0o750)  # accepted on its own: the group may read a run
    pickle = exposed_pickle(run_dir, 0o775, 0o664)
    with pytest.raises(RunDirError, match="Detected:.*Requirement:.*Fix:") as exc:
        check_run_dir(run_dir)
    assert "submitit" in str(exc.value) and "0775" in str(exc.value)
    os.chmod(os.path.dirname(pickle), 0o750)  # the folder no longer writable: the pickle still is
    with pytest.raises(RunDirError, match=r"submitit's pickle.*\(mode 0664\)"):
        check_run_dir(run_dir)
    assert agent_main(run_dir, env={}) == EXIT_NO_REQUEUE


def frozen_run(base: Path) -> str:
    from slurmkit.config import compose
    from slurmkit.cli.submit import freeze
    from slurmkit.submit_checks import make_run_dir

    run_dir = str(base / "root" / "tiny" / "run")
    make_run_dir(run_dir, str(base / "root"))
    freeze(compose(["+exp=tiny", "cluster=local_slurm"]), run_dir)
    return run_dir


def exposed_pickle(run_dir: str, folder_mode: int, mode: int) -> str:
    folder = os.path.join(run_dir, "submitit")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "123_submitted.pkl")
    with open(path, "wb") as f:
        f.write(b"\x80\x04N.")
    os.chmod(path, mode)
    os.chmod(folder, folder_mode)
    return path


@pytest.mark.parametrize("case", [
    pytest.param(case_item9_kill_node_trusts_no_process_environment, marks=needs_root,
                 id="item9-kill-node-forged-environment"),
    pytest.param(case_item14_exposed_submitit_pickle, id="item14-group-writable-submitit-pickle"),
])
def test_hostile_case(case: Callable[[Path], None], world: Path) -> None:
    case(world)


@pytest.mark.parametrize("folder_mode, mode, damage, found", [
    (0o700, 0o664, None, None),  # private folder: an allocation before submit's chmod passes
    (0o750, 0o600, None, None),
    (0o755, 0o644, None, None),
    (0o770, 0o600, None, "writable by group or others (mode 0770)"),
    (0o755, 0o666, None, "mode 0666) in a folder they can reach (mode 0755)"),
    (0o700, 0o600, "chown", "owned by uid 65534"),
    (0o700, 0o600, "symlink", "is a symbolic link"),
    (0o700, 0o600, "folder-symlink", "submitit is a symbolic link"),
])
def test_submitit_folder_and_pickles_checked(tmp_path: Path, folder_mode: int, mode: int,
                                             damage: str | None, found: str | None) -> None:
    run_dir = frozen_run(tmp_path)
    pickle = exposed_pickle(run_dir, folder_mode, mode)
    if damage == "chown":
        os.chown(pickle, NOBODY, NOBODY)
    elif damage == "symlink":
        os.rename(pickle, str(tmp_path / "elsewhere.pkl"))
        os.symlink(str(tmp_path / "elsewhere.pkl"), pickle)
    elif damage == "folder-symlink":
        folder = os.path.dirname(pickle)
        os.rename(folder, str(tmp_path / "folder"))
        os.symlink(str(tmp_path / "folder"), folder)
    if found is None:
        check_run_dir(run_dir)
        return
    with pytest.raises(RunDirError, match="Detected:.*Fix:") as exc:
        check_run_dir(run_dir)
    assert found in str(exc.value)


def test_submit_under_umask_002_leaves_a_private_folder_and_pickle(tmp_path: Path) -> None:
    """A real submit (local executor, the job's rank a plain `true`) under umask 002."""
    from rich.console import Console

    from slurmkit.cli import submit

    runs = tmp_path / "runs"
    old = os.umask(0o002)
    try:
        with open(os.devnull, "w") as devnull:
            quiet = Console(file=devnull)
            submit.run(["+exp=tiny", "cluster.kind=local", "job.nodes=1", "job.ranks_per_node=1",
                        "job.command=[true]", "supervisor.max_restarts=0", "submit.wait=true",
                        f"submit.run_root={runs}"], os.environ, quiet, quiet)
    finally:
        os.umask(old)
    (run_dir,) = list((runs / "tiny").iterdir())
    folder = run_dir / "submitit"
    pickles = list(folder.glob("*_submitted.pkl"))
    assert pickles, list(folder.iterdir())
    assert oct(folder.stat().st_mode & 0o777) == oct(SUBMITIT_DIR_MODE)
    assert {oct(p.stat().st_mode & 0o777) for p in pickles} == {oct(PICKLE_MODE)}
    check_run_dir(str(run_dir))


@needs_root
def test_a_process_in_another_nodes_spool_or_a_look_alike_name_is_not_the_nodes(world: Path) -> None:
    """Only a socket bound in this node's spool directory, as ``<node>_<job>.<step>``, counts."""
    other = world / "other-spool"
    spool = world / "spool"
    for d in (other, spool):
        d.mkdir(mode=0o755)
        d.chmod(0o755)
    code = "import socket,sys,time; s=socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); s.listen(); " \
           "print(1, flush=True); time.sleep(600)"
    procs: list[subprocess.Popen[Any]] = []
    try:
        for name, path in (("slurmstepd: [7.0]", other / f"{NODE}_7.0"),  # another node's spool
                           ("slurmstepd: [7.0]", spool / f"{NODE}x_7.0"),  # another node's name
                           ("python3", spool / f"{NODE}_8.0")):  # root, but not a slurmstepd
            p = start(procs, [name, "-c", code, str(path)], executable=sys.executable,
                      stdout=subprocess.PIPE)
            assert p.stdout is not None and p.stdout.readline().strip() == b"1"
        assert node_loss.node_processes(NODE, str(spool), cgroups=False) == []
    finally:
        stop(procs)


def test_a_spool_directory_others_can_write_is_refused(tmp_path: Path) -> None:
    from testkit.cluster_state import StateError

    spool = tmp_path / "spool"
    spool.mkdir()
    spool.chmod(0o777)
    with pytest.raises(StateError, match="Detected:.*writable by root alone"):
        node_loss.check_spool_dir(str(spool))


def test_kill_spares_a_pid_that_changed_hands(tmp_path: Path) -> None:
    """A process chosen, gone and its pid's start time different: not signalled."""
    p = subprocess.Popen(["sleep", "600"])
    try:
        got = node_loss.read_process(p.pid)
        assert got is not None
        changed = node_loss.NodeProcess(got.pid, got.ppid, got.start_ticks + 1, got.uids, got.gids,
                                        got.groups)
        assert node_loss.kill([changed]) == [] and p.poll() is None
        assert node_loss.kill([got]) == [p.pid]
        assert p.wait(timeout=30) == -signal.SIGKILL
    finally:
        if p.poll() is None:
            p.kill()
