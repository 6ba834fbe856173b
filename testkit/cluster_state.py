"""Trust checks for tools/local-cluster's state directory and the pids it records.

The local cluster runs as root on a predictable path (default /tmp/slurmkit-cluster), reads
back a pids.json and signals the process groups it names. Another user who could create that
directory first, or write a file in it, could have root signal any process. So:

* the state directory is created 0700 and must be a real directory owned by the user running
  the tool and writable by no one else, as must each parent up to the first root-owned
  directory (which, when others may write to it, like /tmp, must have the sticky bit);
* a state file read back must be a regular file (no link, no FIFO) of that owner, writable by
  no one else, of bounded size, and pids.json must be the JSON the tool writes;
* a recorded pid is signalled only while /proc shows the same program started at the same
  clock tick (field 22 of /proc/<pid>/stat), leading its own process group.

Every refusal is a :class:`StateError` (Detected/Requirement/Fix); the tool exits 2 on it.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import stat
import time
from collections.abc import Callable
from typing import Literal

log = logging.getLogger(__name__)


class StateError(Exception):
    """The state directory or a file in it cannot be trusted: the tool stops with exit 2.

    The state directory sits on a predictable path (often under /tmp) and the tool runs as
    root, signals the pids it finds there and hands its files to daemons: anything another
    user could have planted or changed is refused, never used.
    """

    def __init__(self, detected: str, requirement: str, fix: str) -> None:
        super().__init__(f"Detected: {detected}. Requirement: {requirement}. Fix: {fix}.")


STATE_DIR_MODE = 0o700
PIDS_MAX_BYTES = 64 * 1024
PIDS_MAX_ENTRIES = 256
PID_MAX = 1 << 22  # the kernel's ceiling for /proc/sys/kernel/pid_max
# An old pids.json (a bare pid per name) is trusted for a process that started before the file
# was last written; the slack covers /proc/stat's btime being whole seconds.
OLD_RECORD_SLACK_S = 2.0
# What each recorded name runs (argv[0]'s base name); the prefix before the first '-' is the key.
PROGRAMS = {"weed": "weed", "slurmd": "slurmd", "slurmctld": "slurmctld", "slurmdbd": "slurmdbd",
            "mariadbd": "mariadbd", "munged": "munged"}
STOP_ORDER = ["weed", "slurmd", "slurmctld", "slurmdbd", "mariadbd", "munged"]
_NAME_OK = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")


def _describe(st: os.stat_result) -> str:
    return f"owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}"


def _check_own_dir(path: str, st: os.stat_result, euid: int) -> None:
    """A directory of the chain below the first root-owned one: ours alone."""
    if stat.S_ISLNK(st.st_mode):
        raise StateError(f"{path} is a symbolic link (to {os.readlink(path)!r})",
                         "the local cluster's state directory and its parents are real directories",
                         f"remove the link if you did not make it, or pass --state-dir "
                         f"{os.path.realpath(path)} (the resolved path)")
    if not stat.S_ISDIR(st.st_mode):
        raise StateError(f"{path} is not a directory", "a directory there",
                         "remove it or pick another --state-dir")
    if st.st_uid != euid:
        raise StateError(f"{path} belongs to uid {st.st_uid}, not to uid {euid} running the tool",
                         "the state directory and its parents up to a root-owned directory belong "
                         "to the user running tools/local-cluster (someone else could plant a "
                         "pids.json there and have it signal their choice of process)",
                         f"remove {path} if it is not yours, or pass --state-dir (or "
                         "SLURMKIT_CLUSTER_DIR) to a directory you own")
    if st.st_mode & 0o022:
        raise StateError(f"{path} is writable by its group or by others ({_describe(st)})",
                         "no one but its owner can write in the state directory or its parents",
                         f"check nothing in it was planted, then chmod go-w {path}, or remove it "
                         "and run `tools/local-cluster up` again")


def _check_anchor(path: str, st: os.stat_result) -> None:
    """The first root-owned directory above the state directory (e.g. /tmp)."""
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise StateError(f"{path}, above the state directory, is not a plain directory",
                         "the state directory's parents are real directories",
                         f"pass --state-dir with the resolved path ({os.path.realpath(path)})")
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise StateError(f"{path} is writable by others without the sticky bit ({_describe(st)})",
                         "a shared parent such as /tmp has the sticky bit, so no other user can "
                         "rename the state directory away and put their own in its place",
                         f"chmod +t {path}, or pass --state-dir under a directory only you can write")


def check_state_dir(root: str, euid: int | None = None) -> bool:
    """Refuse an untrusted state directory; False when it does not exist (nothing is created).

    Checked: the directory itself (not a link, a directory, owned by ``euid``, not writable by
    group or others) and each parent up to the first root-owned one, which must not be a link
    and, when others can write to it, must have the sticky bit.
    """
    euid = os.geteuid() if euid is None else euid
    root = os.path.abspath(root)
    try:
        st = os.lstat(root)
    except FileNotFoundError:
        return False
    _check_own_dir(root, st, euid)
    _check_parents(root, euid)
    return True


def _check_parents(path: str, euid: int) -> None:
    parent = os.path.dirname(path)
    while True:
        st = os.lstat(parent)
        if st.st_uid == 0 and not stat.S_ISLNK(st.st_mode):
            _check_anchor(parent, st)
            return
        _check_own_dir(parent, st, euid)
        if parent == os.path.dirname(parent):
            return
        parent = os.path.dirname(parent)


def ensure_state_dir(root: str, euid: int | None = None, mode: int = STATE_DIR_MODE) -> None:
    """Create the state directory 0700 (missing parents too) or tighten an existing one to 0700
    (``mode``: 0755 for the cluster's public configuration directory, owned and checked alike).

    ``os.mkdir`` never follows or reuses what someone else put there first: a directory that
    appears between the check and the mkdir is checked again and refused when not ours.
    """
    euid = os.geteuid() if euid is None else euid
    root = os.path.abspath(root)
    missing: list[str] = []
    probe = root
    while not os.path.lexists(probe):
        missing.append(probe)
        probe = os.path.dirname(probe)
    if probe == root:
        check_state_dir(root, euid)
    else:
        st = os.lstat(probe)
        if st.st_uid == 0 and not stat.S_ISLNK(st.st_mode):
            _check_anchor(probe, st)
        else:
            _check_own_dir(probe, st, euid)
            _check_parents(probe, euid)
    for path in reversed(missing):
        try:
            os.mkdir(path, mode)
        except FileExistsError:
            pass
        _check_own_dir(path, os.lstat(path), euid)
        set_mode(path, mode)
    check_state_dir(root, euid)
    set_mode(root, mode)


def set_mode(path: str, mode: int) -> None:
    """chmod through a descriptor opened without following links (chmod would follow one)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        old = stat.S_IMODE(os.fstat(fd).st_mode)
        if old != mode:
            os.fchmod(fd, mode)
            log.info("%s: mode %04o -> %04o (the state directory is its owner's alone)", path, old, mode)
    finally:
        os.close(fd)


def read_state_file(path: str, max_bytes: int, euid: int | None = None) -> tuple[bytes, float] | None:
    """The bytes and mtime of a state file the tool wrote; None when there is none.

    Refused: a link, anything but a regular file (a FIFO would hang the read), another owner,
    group/other write permission, more than ``max_bytes``.
    """
    euid = os.geteuid() if euid is None else euid
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise StateError(f"{path} is a symbolic link", "the tool's state files are regular files "
                             "it wrote itself", f"remove {path} (and check who made it)") from exc
        raise StateError(f"{path} cannot be opened ({exc.strerror})", "a readable state file",
                         f"check {path}, or remove it") from exc
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        problem = None
        if not stat.S_ISREG(st.st_mode):
            problem = "is not a regular file"
        elif st.st_uid != euid:
            problem = f"belongs to uid {st.st_uid}, not to uid {euid} running the tool"
        elif st.st_mode & 0o022:
            problem = f"is writable by its group or others ({_describe(st)})"
        elif st.st_size > max_bytes:
            problem = f"holds {st.st_size} bytes, more than the {max_bytes} the tool ever writes"
        data = b"" if problem else f.read(max_bytes + 1)
        if not problem and len(data) > max_bytes:
            problem = f"holds more than the {max_bytes} bytes the tool ever writes"
    if problem:
        raise StateError(f"{path} {problem}",
                         "state files are regular files owned by the user running the tool and "
                         "writable by no one else (the tool signals the pids they name)",
                         f"do not trust it: look at it, stop any daemons of the cluster by hand "
                         f"(`ps -eo pid,pgid,lstart,args | grep -e slurm -e munged -e mariadbd "
                         f"-e weed`), then remove {path}")
    return data, st.st_mtime


@dataclasses.dataclass(frozen=True)
class PidRecord:
    """One process the tool started, as pids.json records it.

    ``program`` is the base name of its argv[0] and ``start_ticks`` its start time (field 22 of
    /proc/<pid>/stat, clock ticks after boot), read as soon as it was started: together they
    tell the process from a later one that reuses its pid. A record written by an older tool
    has only the pid (``start_ticks`` None); its program follows from its name and
    ``written_at`` (the file's mtime) bounds when it started.
    """

    name: str
    pid: int
    program: str | None
    start_ticks: int | None
    written_at: float

    def to_json(self) -> int | dict[str, object]:
        if self.start_ticks is None:  # kept as the older tool wrote it: nothing to add
            return self.pid
        return {"pid": self.pid, "program": self.program, "start_ticks": self.start_ticks}


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_pids(data: bytes, path: str, written_at: float) -> dict[str, PidRecord]:
    """pids.json's records; StateError on anything the tool would not have written."""
    def refuse(what: str) -> StateError:
        return StateError(f"{path} {what}",
                          "pids.json as tools/local-cluster writes it: a JSON object of at most "
                          f"{PIDS_MAX_ENTRIES} names, each a pid (2..{PID_MAX}) or "
                          '{"pid": int, "program": str, "start_ticks": int}',
                          "do not trust it: stop any daemons of the cluster by hand (`ps -eo "
                          "pid,pgid,lstart,args | grep -e slurm -e munged -e mariadbd -e weed`), "
                          f"then remove {path}")
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise refuse(f"is not well-formed JSON ({exc})") from exc
    if not isinstance(doc, dict):
        raise refuse(f"holds a JSON {type(doc).__name__}, not an object")
    if len(doc) > PIDS_MAX_ENTRIES:
        raise refuse(f"names {len(doc)} processes")
    out: dict[str, PidRecord] = {}
    for name, value in doc.items():
        if not name or len(name) > 64 or not set(name) <= _NAME_OK:
            raise refuse(f"has the name {name[:80]!r}")
        program: str | None = PROGRAMS.get(name.split("-")[0])
        ticks: int | None = None
        if isinstance(value, dict):
            if set(value) != {"pid", "program", "start_ticks"}:
                raise refuse(f"records {name} with the keys {sorted(value)}")
            pid, program, ticks = value["pid"], value["program"], value["start_ticks"]
            if not isinstance(program, str) or not program or "/" in program or len(program) > 255:
                raise refuse(f"records {name} with the program {program!r}")
            if not _is_int(ticks) or ticks < 0:
                raise refuse(f"records {name} with the start time {ticks!r}")
        else:
            pid = value
        if not _is_int(pid) or not 2 <= pid <= PID_MAX:
            raise refuse(f"records {name} with the pid {pid!r}")
        out[name] = PidRecord(name, pid, program, ticks, written_at)
    return out


@dataclasses.dataclass(frozen=True)
class ProcIdentity:
    program: str  # base name of argv[0]
    start_ticks: int  # /proc/<pid>/stat field 22
    pgrp: int


def proc_identity(pid: int, proc_root: str = "/proc") -> ProcIdentity | None:
    """Who runs as ``pid`` now; None when no process (or only a zombie) has it."""
    def stat_fields() -> list[str]:
        with open(f"{proc_root}/{pid}/stat", "rb") as f:
            # comm (field 2) may hold spaces and ')': the fields after it follow the last ')'.
            return f.read().decode("ascii", "replace").rsplit(")", 1)[1].split()

    try:
        before = stat_fields()
        with open(f"{proc_root}/{pid}/cmdline", "rb") as f:
            argv0 = f.read(4096).split(b"\0", 1)[0]
        after = stat_fields()
    except (OSError, IndexError):
        return None
    # fields[0] is field 3 (state), fields[2] field 5 (pgrp), fields[19] field 22 (starttime).
    if min(len(before), len(after)) < 20 or after[0] in ("Z", "X") or before[19] != after[19] \
            or not argv0:
        return None  # gone, a zombie, or the pid changed hands while cmdline was read
    return ProcIdentity(os.path.basename(argv0).decode(errors="replace"), int(after[19]), int(after[2]))


def _started_at(start_ticks: int, proc_root: str) -> float | None:
    """A start time in clock ticks after boot as seconds since the epoch."""
    try:
        with open(f"{proc_root}/stat") as f:
            btime = next(int(ln.split()[1]) for ln in f if ln.startswith("btime "))
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    return btime + start_ticks / os.sysconf("SC_CLK_TCK")


Verdict = Literal["ours", "gone", "foreign", "unverifiable"]


def verify(rec: PidRecord, proc_root: str = "/proc") -> tuple[Verdict, str]:
    """Whether ``rec.pid`` is still the process the tool recorded; only "ours" may be signalled."""
    ident = proc_identity(rec.pid, proc_root)
    if ident is None:
        return "gone", "not running"
    if rec.program is None:
        return "unverifiable", (f"pid {rec.pid} runs {ident.program}; pids.json holds no program "
                                f"for the name {rec.name!r}")
    if ident.program != rec.program:
        return "foreign", f"pid {rec.pid} now runs {ident.program}, not {rec.program}"
    if rec.start_ticks is not None and ident.start_ticks != rec.start_ticks:
        return "foreign", (f"pid {rec.pid} started at tick {ident.start_ticks}, not at the recorded "
                           f"{rec.start_ticks}: another {rec.program} has the pid now")
    if rec.start_ticks is None:
        started = _started_at(ident.start_ticks, proc_root)
        if started is None or started > rec.written_at + OLD_RECORD_SLACK_S:
            return "foreign", (f"pid {rec.pid} started after pids.json was written "
                               "(old format, no start time recorded): not the recorded process")
    if ident.pgrp != rec.pid:
        return "foreign", f"pid {rec.pid} is not the leader of its process group (group {ident.pgrp})"
    return "ours", "running"


def skip_message(rec: PidRecord, why: str) -> str:
    """What to tell the user about a record that is not signalled, and how to clean up."""
    return (f"not signalling {rec.name} (pid {rec.pid}): {why}. If a daemon of this cluster still "
            f"runs, find it with `ps -eo pid,pgid,lstart,args | grep {rec.program or rec.name}` "
            "and stop it by hand (kill -TERM -- -<its pgid>)")


def _running(pid: int, proc_root: str) -> bool:
    """A process (not a zombie) holds ``pid`` now."""
    try:
        with open(f"{proc_root}/{pid}/stat", "rb") as f:
            return f.read().decode("ascii", "replace").rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def record(name: str, pid: int, proc_root: str = "/proc", *, wait_s: float = 5.0,
           sleep: Callable[[float], None] = time.sleep,
           clock: Callable[[], float] = time.monotonic) -> PidRecord | None:
    """The record of a process just started (its program and start time read from /proc);
    None when it is gone. A process that has just exec'd shows an empty cmdline for a moment
    (the kernel sets the new argument area after the exec is visible; seen with slurmd, whose
    record then failed while it ran on, holding its port): it is read again until ``wait_s``."""
    deadline = clock() + wait_s
    while True:
        ident = proc_identity(pid, proc_root)
        if ident is not None:
            return PidRecord(name, pid, ident.program, ident.start_ticks, time.time())
        if not _running(pid, proc_root) or clock() >= deadline:
            return None
        sleep(0.01)


def dump_pids(records: dict[str, PidRecord]) -> str:
    """pids.json's text; records of an older tool keep their bare-pid form."""
    return json.dumps({name: rec.to_json() for name, rec in records.items()}, indent=1) + "\n"
