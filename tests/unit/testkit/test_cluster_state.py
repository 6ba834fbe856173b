"""tools/local-cluster trusts nothing another user could have planted in its state directory.

It runs as root on a predictable path (/tmp/slurmkit-cluster) and signals the process groups
its pids.json names (issue 12). Each test builds the situation on real files and real
processes: a planted pids.json, a symlinked or group-writable state directory, a recorded pid
that now belongs to another process, garbage JSON. Victims are real `sleep` processes, and a
test checks they are still alive after `down`.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[3]
TOOL = REPO / "tools" / "local-cluster"
NOBODY = 65534

@pytest.fixture
def root() -> None:
    """chown to another uid needs root: the suite runs as root (CI does); elsewhere it fails
    and says so rather than skip."""
    if os.geteuid() != 0:
        pytest.fail("chown to another uid needs root: run the suite as root (CI does)")


as_root = pytest.mark.usefixtures("root")


def load_tool() -> ModuleType:
    loader = importlib.machinery.SourceFileLoader("local_cluster_tool", str(TOOL))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def lc() -> ModuleType:
    return load_tool()


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Real processes, each leading its own process group as the tool's daemons do."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
            p.wait()


def start(procs: list[subprocess.Popen[bytes]], args: list[str],
          argv0: str | None = None) -> subprocess.Popen[bytes]:
    """Start ``args`` and wait until the process shows ``argv0`` (default ``args[0]``)."""
    p = subprocess.Popen(args, start_new_session=True)
    procs.append(p)
    _wait_for_argv0(p.pid, (argv0 or args[0]).encode())
    return p


def state_dir(tmp_path: Path, name: str = "state", mode: int = 0o700) -> Path:
    d = tmp_path / name
    d.mkdir()
    d.chmod(mode)
    return d


def write_pids(d: Path, doc: object, mode: int = 0o600) -> Path:
    path = d / "pids.json"
    path.write_text(json.dumps(doc))
    path.chmod(mode)
    return path


def down(lc: ModuleType, d: Path) -> None:
    lc.cmd_down(argparse.Namespace(state_dir=str(d)))


def alive_after(p: subprocess.Popen[bytes], wait_s: float = 0.3) -> bool:
    time.sleep(wait_s)
    return p.poll() is None


# ---------------------------------------------------------------- the state directory
@as_root
def test_planted_pids_json_of_another_user_is_refused(lc: ModuleType, tmp_path: Path,
                                                      procs: list[subprocess.Popen[bytes]]) -> None:
    victim = start(procs, ["sleep", "60"])
    d = state_dir(tmp_path)
    pids = write_pids(d, {"munged": victim.pid}, mode=0o644)
    os.chown(pids, NOBODY, NOBODY)
    with pytest.raises(lc.cs.StateError, match=f"belongs to uid {NOBODY}.*Requirement:.*Fix:"):
        down(lc, d)
    assert alive_after(victim)


def test_symlinked_state_dir_is_refused(lc: ModuleType, tmp_path: Path,
                                        procs: list[subprocess.Popen[bytes]]) -> None:
    victim = start(procs, ["sleep", "60"])
    real = state_dir(tmp_path, "elsewhere")
    write_pids(real, {"munged": victim.pid})
    link = tmp_path / "state"
    link.symlink_to(real)
    with pytest.raises(lc.cs.StateError, match="is a symbolic link"):
        down(lc, link)
    assert alive_after(victim)
    with pytest.raises(lc.cs.StateError, match="is a symbolic link"):
        lc.open_state(str(link), create=True)


def test_group_writable_state_dir_is_refused(lc: ModuleType, tmp_path: Path,
                                             procs: list[subprocess.Popen[bytes]]) -> None:
    victim = start(procs, ["sleep", "60"])
    d = state_dir(tmp_path, mode=0o770)
    write_pids(d, {"munged": victim.pid})
    with pytest.raises(lc.cs.StateError, match="writable by its group or by others"):
        down(lc, d)
    assert alive_after(victim)
    assert (d.stat().st_mode & 0o777) == 0o770  # refused, not silently "fixed"


@as_root
def test_parent_chain_up_to_a_root_owned_directory(lc: ModuleType, tmp_path: Path) -> None:
    other = tmp_path / "other"  # a parent that another user owns could swap the state dir
    other.mkdir()
    os.chown(other, NOBODY, NOBODY)
    with pytest.raises(lc.cs.StateError, match=f"{other} belongs to uid {NOBODY}"):
        lc.open_state(str(other / "state"), create=True)
    assert not (other / "state").exists()
    shared = tmp_path / "shared"  # root's, but anyone may rename entries away: no sticky bit
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(lc.cs.StateError, match="without the sticky bit"):
        lc.open_state(str(shared / "state"), create=True)
    shared.chmod(0o1777)  # like /tmp
    lc.open_state(str(shared / "state"), create=True)
    assert (shared / "state").stat().st_mode & 0o7777 == 0o700


def test_state_dir_created_0700_and_an_existing_one_tightened(lc: ModuleType, tmp_path: Path) -> None:
    old_umask = os.umask(0o022)
    try:
        lc.open_state(str(tmp_path / "a" / "b"), create=True)
    finally:
        os.umask(old_umask)
    assert (tmp_path / "a").stat().st_mode & 0o7777 == 0o700
    assert (tmp_path / "a" / "b").stat().st_mode & 0o7777 == 0o700
    existing = state_dir(tmp_path, "existing", mode=0o755)
    lc.open_state(str(existing))  # status/down: not created, but made private
    assert existing.stat().st_mode & 0o7777 == 0o700
    assert not lc.cs.check_state_dir(str(tmp_path / "missing"))


def test_cli_exits_2_with_detected_requirement_fix(tmp_path: Path) -> None:
    d = state_dir(tmp_path, mode=0o777)
    res = subprocess.run([sys.executable, str(TOOL), "--state-dir", str(d), "status"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2, res.stderr
    assert "Detected:" in res.stderr and "Requirement:" in res.stderr and "Fix:" in res.stderr
    assert "Traceback" not in res.stderr


# ---------------------------------------------------------------- pids.json itself
def test_symlinked_pids_json_is_refused(lc: ModuleType, tmp_path: Path,
                                        procs: list[subprocess.Popen[bytes]]) -> None:
    victim = start(procs, ["sleep", "60"])
    d = state_dir(tmp_path)
    target = write_pids(state_dir(tmp_path, "planted"), {"munged": victim.pid})
    (d / "pids.json").symlink_to(target)
    with pytest.raises(lc.cs.StateError, match="pids.json is a symbolic link"):
        down(lc, d)
    assert alive_after(victim)


@pytest.mark.parametrize("payload,problem", [
    (b"{garbage", "not well-formed JSON"),
    (b"\xff\xfe{}", "not well-formed JSON"),
    (b"[5484]", "JSON list, not an object"),
    (b'{"munged": "5484"}', "the pid '5484'"),
    (b'{"munged": true}', "the pid True"),
    (b'{"munged": 0}', "the pid 0"),
    (b'{"munged": -1}', "the pid -1"),
    (b'{"munged": 1}', "the pid 1"),
    (b'{"munged": 5.5}', "the pid 5.5"),
    (b'{"munged": {"pid": 5484}}', "the keys"),
    (b'{"munged": {"pid": 5484, "program": "../munged", "start_ticks": 1}}', "the program"),
    (b'{"munged": {"pid": 5484, "program": "munged", "start_ticks": "1"}}', "the start time"),
    (b'{"munged\\n": 5484}', "has the name"),
    (b'{"munged": ' + b" " * 70_000 + b"5484}", "more than the 65536"),
])
def test_garbage_pids_json_is_refused(lc: ModuleType, tmp_path: Path, payload: bytes,
                                      problem: str) -> None:
    d = state_dir(tmp_path)
    (d / "pids.json").write_bytes(payload)
    (d / "pids.json").chmod(0o600)
    with pytest.raises(lc.cs.StateError, match="Detected: .*pids.json") as err:
        lc.open_state(str(d)).records()
    assert problem in str(err.value)


def test_group_writable_pids_json_is_refused(lc: ModuleType, tmp_path: Path) -> None:
    d = state_dir(tmp_path)
    write_pids(d, {"munged": 5484}, mode=0o664)
    with pytest.raises(lc.cs.StateError, match="writable by its group or others"):
        lc.open_state(str(d)).records()


# ---------------------------------------------------------------- the pid is still ours
def test_a_pid_is_ours_only_with_the_recorded_program_and_start(lc: ModuleType,
                                                                procs: list[subprocess.Popen[bytes]]) -> None:
    first = start(procs, ["sleep", "60"])
    rec = lc.cs.record("worker", first.pid)
    assert rec is not None and rec.program == "sleep"
    assert lc.cs.verify(rec) == ("ours", "running")
    time.sleep(0.05)  # a later start tick (10 ms a tick)
    later = start(procs, ["sleep", "60"])
    other = start(procs, ["tail", "-f", "/dev/null"])
    same_program = lc.cs.PidRecord("worker", later.pid, "sleep", rec.start_ticks, time.time())
    verdict, why = lc.cs.verify(same_program)
    assert verdict == "foreign" and "not at the recorded" in why
    other_program = lc.cs.PidRecord("worker", other.pid, "sleep", rec.start_ticks, time.time())
    verdict, why = lc.cs.verify(other_program)
    assert verdict == "foreign" and "now runs tail, not sleep" in why
    first.kill()
    first.wait()
    assert lc.cs.verify(rec)[0] == "gone"


def test_down_signals_only_the_processes_it_started(lc: ModuleType, tmp_path: Path,
                                                   procs: list[subprocess.Popen[bytes]]) -> None:
    ours = start(procs, ["sleep", "60"])
    rec = lc.cs.record("weed", ours.pid)
    assert rec is not None
    time.sleep(0.05)
    reused = start(procs, ["sleep", "60"])  # as if ours had died and its pid gone to another sleep
    d = state_dir(tmp_path)
    write_pids(d, {"weed": {"pid": ours.pid, "program": "sleep", "start_ticks": rec.start_ticks},
                   "slurmd-node1": {"pid": reused.pid, "program": "sleep", "start_ticks": rec.start_ticks}})
    down(lc, d)
    assert ours.wait(timeout=10) is not None
    assert alive_after(reused)
    assert not (d / "pids.json").exists()


# ---------------------------------------------------------------- pids.json of an older tool
def test_old_pids_json_skips_a_pid_now_running_another_program(lc: ModuleType, tmp_path: Path,
                                                              procs: list[subprocess.Popen[bytes]],
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    victim = start(procs, ["sleep", "60"])
    d = state_dir(tmp_path)
    write_pids(d, {"munged": victim.pid, "slurmd-node2": victim.pid})
    down(lc, d)
    assert alive_after(victim)
    err = capsys.readouterr().err
    assert "not signalling munged" in err and "now runs sleep, not munged" in err
    assert "stop it by hand" in err


def test_old_pids_json_skips_a_process_started_after_it_was_written(
        lc: ModuleType, tmp_path: Path, procs: list[subprocess.Popen[bytes]]) -> None:
    victim = start(procs, ["bash", "-c", "exec -a slurmd sleep 60"], argv0="slurmd")
    d = state_dir(tmp_path)
    pids = write_pids(d, {"slurmd-node1": victim.pid})
    hour_ago = time.time() - 3600
    os.utime(pids, (hour_ago, hour_ago))  # a pid reused since the file was written
    down(lc, d)
    assert alive_after(victim)


def test_old_pids_json_still_stops_the_cluster_it_recorded(lc: ModuleType, tmp_path: Path,
                                                          procs: list[subprocess.Popen[bytes]]) -> None:
    """Compatibility: a cluster started by the older tool is stopped by the new one."""
    daemon = start(procs, ["bash", "-c", "exec -a slurmd sleep 60"], argv0="slurmd")
    d = state_dir(tmp_path)
    write_pids(d, {"slurmd-node1": daemon.pid}, mode=0o644)  # as the older tool wrote it
    assert lc.cs.verify(lc.open_state(str(d)).records()["slurmd-node1"])[0] == "ours"
    down(lc, d)
    assert daemon.wait(timeout=10) is not None


def _wait_for_argv0(pid: int, argv0: bytes) -> None:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if f.read().split(b"\0")[0] == argv0:
                return
        time.sleep(0.01)
    raise AssertionError(f"pid {pid} never showed argv[0] {argv0!r}")


def test_spawn_records_program_and_start_time_that_down_checks(lc: ModuleType, tmp_path: Path) -> None:
    st = lc.open_state(str(tmp_path / "state"), create=True)
    os.makedirs(st.logs)
    pid = lc.spawn(st, "slurmd-node1", ["sleep", "60"])
    try:
        with open(st.pids_file) as f:
            doc = json.load(f)
        assert (os.stat(st.pids_file).st_mode & 0o777) == 0o600
        entry = doc["slurmd-node1"]
        assert entry["pid"] == pid and entry["program"] == "sleep"
        with open(f"/proc/{pid}/stat") as f:
            assert entry["start_ticks"] == int(f.read().rsplit(")", 1)[1].split()[19])
        down(lc, Path(st.root))
        assert os.waitpid(pid, 0)[0] == pid  # stopped by down (reaped here: our child)
    finally:
        try:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


def _fake_proc(root: Path, pid: int, state: str, cmdline: bytes) -> None:
    d = root / str(pid)
    d.mkdir(parents=True, exist_ok=True)
    fields = [state, "1", str(pid), str(pid)] + ["0"] * 15 + ["424242"] + ["0"] * 10
    (d / "stat").write_text(f"{pid} (slurmd) " + " ".join(fields) + "\n")
    (d / "cmdline").write_bytes(cmdline)


def test_record_waits_out_the_empty_cmdline_of_a_process_that_just_execd(tmp_path: Path) -> None:
    """Right after exec the kernel shows an empty cmdline for a moment (seen with slurmd: `up`
    said it had exited while it ran on, holding its port); the record is read again."""
    from testkit import cluster_state as cs

    _fake_proc(tmp_path, 4242, "S", b"")
    slept: list[float] = []

    def sleep(s: float) -> None:  # the argument area appears while the tool waits
        slept.append(s)
        _fake_proc(tmp_path, 4242, "S", b"slurmd\0-D\0-N\0node1\0")

    rec = cs.record("slurmd-node1", 4242, str(tmp_path), sleep=sleep)
    assert rec is not None and rec.program == "slurmd" and rec.start_ticks == 424242 and slept
    _fake_proc(tmp_path, 4243, "Z", b"")  # a zombie: gone at once, no wait
    assert cs.record("x", 4243, str(tmp_path), sleep=lambda s: pytest.fail("waited")) is None
    _fake_proc(tmp_path, 4244, "S", b"")  # never fills: given up at the deadline
    t = iter(range(100))
    assert cs.record("x", 4244, str(tmp_path), wait_s=3, sleep=lambda s: None,
                     clock=lambda: float(next(t))) is None
