"""What ``tools/local-cluster kill-node`` takes from an emulated node, chosen without taking
any process's word for it.

kill-node runs as root. It once picked "the node's processes" by ``SLURMD_NODENAME`` in their
environment and removed a directory named by the ``SLURMKIT_CONFIG`` in it: any user could
start a process with forged variables and have root read and ``rmtree`` a path of their
choosing. Now:

* a node's processes are its slurmstepds and everything below them. A slurmstepd is a root
  process whose argv[0] is ``slurmstepd`` holding the unix socket it binds as
  ``<spool>/<node>_<job>.<step>`` in the node's spool directory, which the tool's own
  slurm.conf names and only root may write in. (slurmd double-forks its slurmstepds, so their
  parent is init, not the slurmd the tool started; the socket is how Slurm itself finds them.)
  Below them means the kernel's parent chain, and under proctrack/cgroup also the freezer
  cgroup ``/slurm_<node>/`` (job processes that daemonized away from the chain are there;
  only root, or a user inside their own job's cgroup, can move a process into it);
* a process's environment and its config file decide nothing as root: the NVMe directory of
  a run is worked out and removed in a child process that has taken the process's own uid,
  gid and groups first, so it can remove no more than that user could themselves, and only
  ``<nvme root>/<node>`` (the node name from the tool's records) when it is a real directory
  of that user.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import stat
from collections.abc import Callable, Iterable, Mapping

from testkit.cluster_state import StateError

ENVIRON_MAX_BYTES = 256 * 1024
CONFIG_MAX_BYTES = 1 << 20
REPORT_MAX_BYTES = 64 * 1024
FREEZER_ROOT = "/sys/fs/cgroup/freezer"
_STEP_SOCKET = re.compile(r"\d+(\.\d+)+")  # <job>.<step>[.<het component>]
#: An emulated node's name as `up` gives them (node1...), and nothing that is a path.
NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")


@dataclasses.dataclass(frozen=True)
class NodeProcess:
    """A process running on the node, as the kernel describes it (never as it says itself)."""

    pid: int
    ppid: int
    start_ticks: int  # /proc/<pid>/stat field 22: tells it from a later process with its pid
    uids: tuple[int, ...]  # real, effective, saved, filesystem
    gids: tuple[int, ...]
    groups: tuple[int, ...]


def read_process(pid: int, proc_root: str = "/proc") -> NodeProcess | None:
    """The kernel's facts about ``pid``; None when it is gone or a zombie."""
    try:
        with open(f"{proc_root}/{pid}/stat", "rb") as f:
            # comm (field 2) may hold spaces and ')': the fields after it follow the last ')'.
            fields = f.read().decode("ascii", "replace").rsplit(")", 1)[1].split()
        with open(f"{proc_root}/{pid}/status", "rb") as f:
            status = dict(ln.split(":", 1) for ln in f.read().decode("ascii", "replace").splitlines()
                          if ":" in ln)
        if fields[0] in ("Z", "X"):
            return None
        return NodeProcess(pid, int(fields[1]), int(fields[19]),
                           tuple(int(v) for v in status["Uid"].split()),
                           tuple(int(v) for v in status["Gid"].split()),
                           tuple(int(v) for v in status.get("Groups", "").split()))
    except (OSError, IndexError, KeyError, ValueError):
        return None


def check_spool_dir(path: str, euid: int | None = None) -> None:
    """The node's spool directory decides which sockets count: a real directory of the user
    running the tool that no one else can write in (else anyone could bind a look-alike)."""
    euid = os.geteuid() if euid is None else euid
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise StateError(f"the spool directory {path} cannot be read ({exc.strerror})",
                         "the node's spool directory that `up` created",
                         "run `tools/local-cluster up` again") from exc
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != euid or st.st_mode & 0o022:
        raise StateError(f"{path} is not a directory of uid {euid} that only it can write "
                         f"(owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o})",
                         "slurmd's spool directory is root's, writable by root alone (kill-node "
                         "finds a node's slurmstepds by the sockets they bind there)",
                         f"check who changed {path}, then run `tools/local-cluster down` and `up`")


def stepd_socket_inodes(spool_dir: str, node: str, net_unix: str = "/proc/net/unix") -> set[int]:
    """Inodes of the unix sockets bound as ``<spool_dir>/<node>_<job>.<step>``."""
    spool_dir = os.path.normpath(spool_dir)
    found: set[int] = set()
    try:
        with open(net_unix, "rb") as f:
            lines = f.read().decode("utf-8", "replace").splitlines()[1:]
    except OSError:
        return found
    for line in lines:
        parts = line.split(None, 7)  # Num RefCount Protocol Flags Type St Inode Path
        if len(parts) < 8 or not parts[6].isdigit():
            continue
        head, name = os.path.split(parts[7])
        if head == spool_dir and name.startswith(f"{node}_") \
                and _STEP_SOCKET.fullmatch(name[len(node) + 1:]):
            found.add(int(parts[6]))
    return found


def _socket_inodes(pid: int, proc_root: str) -> set[int]:
    out: set[int] = set()
    try:
        fds = os.listdir(f"{proc_root}/{pid}/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            target = os.readlink(f"{proc_root}/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:[") and target.endswith("]") and target[8:-1].isdigit():
            out.add(int(target[8:-1]))
    return out


def _argv0(pid: int, proc_root: str) -> bytes:
    try:
        with open(f"{proc_root}/{pid}/cmdline", "rb") as f:
            return f.read(4096).split(b"\0", 1)[0]
    except OSError:
        return b""


def _in_node_cgroup(pid: int, node: str, proc_root: str) -> bool:
    """In the freezer cgroup slurmd makes for ``node`` (proctrack/cgroup, multiple slurmd)."""
    try:
        with open(f"{proc_root}/{pid}/cgroup", "rb") as f:
            lines = f.read(65536).decode("utf-8", "replace").splitlines()
    except OSError:
        return False
    for line in lines:
        _num, _sep, rest = line.partition(":")
        controllers, _sep, path = rest.partition(":")
        if "freezer" in controllers.split(",") and path.startswith(f"/slurm_{node}/"):
            return True
    return False


def node_processes(node: str, spool_dir: str, roots: Iterable[int] = (), *,
                   proc_root: str = "/proc", net_unix: str = "/proc/net/unix",
                   cgroups: bool = True) -> list[NodeProcess]:
    """Every process on ``node``: its slurmstepds (root, argv[0] slurmstepd, holding a socket
    bound in ``spool_dir``), the processes in its freezer cgroup when ``cgroups``, and all
    their descendants by the kernel's parent chain, and those of ``roots`` (its slurmd, whose
    pid the tool recorded). Nothing a process could set for itself (its environment, its
    name alone) puts it in."""
    procs: dict[int, NodeProcess] = {}
    for entry in os.listdir(proc_root):
        if entry.isdigit():
            got = read_process(int(entry), proc_root)
            if got is not None:
                procs[got.pid] = got
    inodes = stepd_socket_inodes(spool_dir, node, net_unix)
    chosen = {pid for pid in roots if pid in procs}
    for p in procs.values():
        if p.uids == (0, 0, 0, 0) and os.path.basename(_argv0(p.pid, proc_root)).startswith(b"slurmstepd") \
                and inodes & _socket_inodes(p.pid, proc_root):
            chosen.add(p.pid)
        elif cgroups and _in_node_cgroup(p.pid, node, proc_root):
            chosen.add(p.pid)
    children: dict[int, list[int]] = {}
    for p in procs.values():
        children.setdefault(p.ppid, []).append(p.pid)
    todo = list(chosen)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in chosen:
                chosen.add(child)
                todo.append(child)
    return [procs[pid] for pid in sorted(chosen)]


def kill(procs: Iterable[NodeProcess], proc_root: str = "/proc") -> list[int]:
    """SIGKILL each process still running under the start time it was chosen with."""
    killed = []
    for p in procs:
        now = read_process(p.pid, proc_root)
        if now is None or now.start_ticks != p.start_ticks:
            continue  # gone, or its pid belongs to another process now
        try:
            os.kill(p.pid, signal.SIGKILL)
            killed.append(p.pid)
        except ProcessLookupError:
            pass
    return killed


def read_environ(pid: int, proc_root: str = "/proc") -> dict[str, str]:
    """A process's environment (bounded); {} when it cannot be read."""
    try:
        with open(f"{proc_root}/{pid}/environ", "rb") as f:
            items = f.read(ENVIRON_MAX_BYTES).split(b"\0")
    except OSError:
        return {}
    out = {}
    for item in items:
        key, sep, value = item.partition(b"=")
        if sep:
            out[key.decode(errors="replace")] = value.decode(errors="replace")
    return out


Credentials = tuple[int, int, tuple[int, ...]]  # uid, gid, groups


@dataclasses.dataclass
class NvmeRequest:
    """The runs whose NVMe directory on the node goes with it, per user they run as."""

    creds: Credentials
    runs: list[tuple[str, dict[str, str]]]  # (SLURMKIT_CONFIG, the process's environment)


def nvme_requests(procs: Iterable[NodeProcess], node: str, proc_root: str = "/proc",
                  say: Callable[[str], None] = print) -> list[NvmeRequest]:
    """Read before the processes die: which ranks on ``node`` name a config, and as whom they
    run. A process whose uids or gids differ (a setuid program) is skipped: whose word its
    environment is cannot be told."""
    by_creds: dict[Credentials, dict[str, dict[str, str]]] = {}
    for p in procs:
        env = read_environ(p.pid, proc_root)
        config = env.get("SLURMKIT_CONFIG", "")
        # A rank forked from a server the agent forked shows the agent's environment: it names
        # the node only as Slurm's step does.
        named = env.get("SLURMKIT_NODE") or env.get("SLURMD_NODENAME")
        if named != node or not config:
            continue
        if len(set(p.uids)) != 1 or len(set(p.gids)) != 1:
            say(f"pid {p.pid} runs with uids {p.uids} and gids {p.gids}: its NVMe directory is not removed")
            continue
        by_creds.setdefault((p.uids[0], p.gids[0], p.groups), {}).setdefault(config, env)
    return [NvmeRequest(creds, list(runs.items())) for creds, runs in by_creds.items()]


def _nvme_dir(config: str, env: Mapping[str, str], node: str, uid: int) -> str | None:
    """``<store.nvme_uri>/<node>`` of the run ``config`` describes, None for a run without an
    NVMe tier; raises ValueError saying why not. Runs as the run's user (:func:`_remove_as`)."""
    import yaml

    from slurmkit.store.tier import expand_env

    fd = os.open(config, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO must not hang us
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > CONFIG_MAX_BYTES:
            raise ValueError(f"{config} is not a regular file of at most {CONFIG_MAX_BYTES} bytes")
        doc = yaml.safe_load(f.read(CONFIG_MAX_BYTES))
    store = doc.get("store") if isinstance(doc, dict) else None
    uri = store.get("nvme_uri") if isinstance(store, dict) else None
    if uri in (None, ""):
        return None
    if not isinstance(uri, str):
        raise ValueError(f"{config}: store.nvme_uri is a {type(uri).__name__}, not a string")
    root = expand_env(uri, env)
    root = root[len("file://"):] if root.startswith("file://") else root
    if "://" in root or not os.path.isabs(root):
        raise ValueError(f"the NVMe tier {root!r} is not a local absolute path")
    path = os.path.join(os.path.normpath(root), node)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid:
        raise ValueError(f"{path} is not a directory of uid {uid} (a link, or another user's)")
    return path


def _remove_as(req: NvmeRequest, node: str, out_fd: int) -> None:
    """In the forked child: become the run's user, then remove each run's NVMe directory."""
    uid, gid, groups = req.creds
    report: list[dict[str, str]] = []
    try:
        if (os.geteuid(), os.getegid()) != (uid, gid):  # root dropping to the run's user
            os.setgroups(list(groups))
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
        for config, env in req.runs:
            try:
                path = _nvme_dir(config, env, node, uid)
                if path is not None:
                    shutil.rmtree(path)
                    report.append({"removed": path})
            except FileNotFoundError:
                pass  # no save reached this node's NVMe yet
            except Exception as exc:  # anything the user's files hold: reported, never root's problem
                report.append({"skipped": f"{config}: {exc}"})
    finally:
        os.write(out_fd, json.dumps(report).encode()[:REPORT_MAX_BYTES])


def remove_nvme_dirs(requests: Iterable[NvmeRequest], node: str,
                     say: Callable[[str], None] = print) -> list[str]:
    """Remove each run's ``<nvme root>/<node>`` with the rights of the user the run's ranks ran
    as (a forked child per user); the directories removed."""
    import yaml  # noqa: F401  (imported here, as root: the user may not read this interpreter)

    from slurmkit.store import tier  # noqa: F401

    if not NODE_NAME.fullmatch(node):
        raise ValueError(f"{node!r} is not a node name")
    removed: list[str] = []
    for req in requests:
        rfd, wfd = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never returns into the caller's code
            code = 1
            try:
                os.close(rfd)
                _remove_as(req, node, wfd)
                code = 0
            finally:
                os._exit(code)
        os.close(wfd)
        with os.fdopen(rfd, "rb") as f:
            data = f.read(REPORT_MAX_BYTES + 1)
        os.waitpid(pid, 0)
        try:
            report = json.loads(data) if data else []
        except ValueError:
            report = []
        for item in report if isinstance(report, list) else []:
            if isinstance(item, dict) and isinstance(item.get("removed"), str):
                removed.append(item["removed"])
            elif isinstance(item, dict):
                say(f"NVMe directory of a run on {node} (uid {req.creds[0]}) not removed: {item.get('skipped')}")
    return sorted(set(removed))
