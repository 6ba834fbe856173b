"""The reference trainer's ranks forked from one process per node that imported it ahead.

A warm standby (slurmkit.launch.standby) pays Python's and torch's start-up once per rank and
generation, ahead of time: 3-5 s of CPU each, eight times per node and restart on a GPU node,
all reading the same files from the shared file system at once. The fork server pays it once
per node and allocation. The agent starts it while the agents meet (ForkServer.start;
ForkServer.fork_early, a server forked from the agent itself that keeps its torch import, is
not used by the agent: a CI rehearsal saw a one-node agent abort at its exit with it). It
imports the trainer (the late imports a rank pays at its first step too), and then forks every
rank of every generation on this node: a fork takes milliseconds and shares the imported pages.

The process tree stays what the agent watches. The server forks an intermediate process that
forks the rank and exits at once. The agent marks itself a child subreaper
(``prctl(PR_SET_CHILD_SUBREAPER)``), so the rank is reparented to the agent and is its child,
as a rank started cold is: the agent reads its exit status, signals its session and kills
it. The server holds no rank. The rank ties itself to the agent (slurmkit.launch.tether) once
it is the agent's child, and the server is tied to the agent from its start: nothing started
here outlives the agent.

A fork copies only the calling thread and the process's memory. The server forks only while
no Python thread runs besides its main one and CUDA's driver library is not loaded (a CUDA
context does not survive a fork; importing torch does not initialise CUDA). Otherwise it says
why in its first message, and the agent starts per-rank standbys instead. Only a rank's
identity may differ from the environment the server started with, plus the GPUs it sees
(read by CUDA only when the rank initialises it, after the fork). The CPU and memory binding
of the rank's plan is applied in the rank after the fork (slurmkit.topology.apply), as the pin
wrapper does before its exec.

Protocol, one JSON datagram each way on a ``SOCK_SEQPACKET`` socket pair:

    server -> agent, once:  {"v": 1, "ready": true, "why_not": ""}
    agent -> server:        {"v": 1, "set": {...}, "unset": [...], "args": [...],
                             "plan": RankPlan JSON or null, "verify": "warn"}
                            with one descriptor: the write end of the rank's output pipe
    server -> agent:        {"pid": N} or {"error": "..."}

The server runs nothing but the reference trainer, and only for its agent: the socket is the
agent's alone, and a request that does not parse is answered with an error, not obeyed.
"""

from __future__ import annotations

import ctypes
import faulthandler
import importlib
import io
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from slurmkit.launch import standby
from slurmkit.launch.tether import EXIT_ORPHANED, arm

log = logging.getLogger(__name__)

MODULE = "slurmkit.launch.forkserver"
PROTOCOL = 1
MAX_DATAGRAM = 64 * 1024  # a request is the identity delta (~1 KB) and a plan (~1 KB)
SERVER_NAME = "skforkserver"  # /proc/PID/comm while it serves (process finders read it)
PR_SET_CHILD_SUBREAPER = 36
REPARENT_WAIT_S = 10.0  # the intermediate exits at once; this bounds a wait that never ends
LOST = 255  # the exit code given to a rank whose status this process cannot read
# Beyond a rank's identity: the GPUs and network devices it uses (slurmkit.topology.env sets
# them per rank). CUDA reads the GPUs when the rank initialises it, NCCL and UCX theirs when
# the rank's first communicator is made: after the fork. The server never initialises CUDA
# (why_not_fork) nor makes a communicator.
DEVICE_NAMES = frozenset({"CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES",
                          "CUDA_DEVICE_ORDER", "UCX_NET_DEVICES"})
DEVICE_PREFIXES = ("NCCL_",)
# A server forked from the agent (ForkServer.fork_early) has the agent's environment, not a
# rank's: a rank's may also differ in torch's NCCL and flight-recorder settings (read when its
# first NCCL communicator is made, after the fork), in OMP_NUM_THREADS, which OpenMP read when
# torch loaded in the agent (the rank applies it: torch.set_num_threads), and in the two
# interpreter options a rank is started with, read at start-up: PYTHONSAFEPATH (the forked
# server drops the start-up directory from sys.path, as -P would have) and PYTHONUNBUFFERED
# (the rank's standard streams are made unbuffered when the agent's were not).
EARLY_NAMES = frozenset({"OMP_NUM_THREADS", "PYTHONSAFEPATH", "PYTHONUNBUFFERED"})
EARLY_PREFIXES = ("TORCH_NCCL_", "TORCH_FR_")


class ForkServerError(Exception):
    """The fork server cannot start this rank; the agent starts it another way."""


def may_differ(name: str) -> bool:
    return standby.identity_name(name) or name in DEVICE_NAMES or name.startswith(DEVICE_PREFIXES)


def may_differ_early(name: str) -> bool:
    return may_differ(name) or name in EARLY_NAMES or name.startswith(EARLY_PREFIXES)


def mismatch(started: Mapping[str, str], wanted: Mapping[str, str], *, early: bool = False) -> list[str]:
    """Names that may not differ but do: a rank that needs ``wanted`` cannot be forked from a
    server started with ``started`` (``early``: forked from the agent with its environment)."""
    return standby.mismatch(started, wanted, may_differ_early if early else may_differ)


# ---------------------------------------------------------------------- the agent's side
def set_subreaper(on: bool = True) -> bool:
    """Make this process the reaper of its orphaned descendants (Linux 3.4+), or no longer
    (``on=False``: those orphaned later go to init again); False if it cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


class ForkedProc:
    """A rank the server forked, reparented to this process: the part of ``subprocess.Popen``
    the agent uses for a rank (pid, returncode, poll, wait, stdout)."""

    def __init__(self, pid: int, stdout: Any) -> None:
        self.pid = pid
        self.stdout = stdout
        self.stdin = None
        self.returncode: int | None = None
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        with self._lock:
            if self.returncode is None:
                try:
                    got, status = os.waitpid(self.pid, os.WNOHANG)
                except ChildProcessError:  # never (or no longer) this process's child
                    log.warning("forked rank %d is not a child of this process: its exit status is lost", self.pid)
                    self.returncode = LOST
                else:
                    if got == self.pid:
                        self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode

    def send_signal(self, signum: int) -> None:
        """As Popen's: only while its exit status is unread (its pid is not reused before)."""
        if self.poll() is None:
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            code = self.poll()
            if code is not None:
                return code
            if deadline is None:
                try:  # block until it has exited, leaving the reaping to poll() (one lock)
                    os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOWAIT)
                except ChildProcessError:
                    pass  # reaped meanwhile by poll() in another thread, or not a child: poll says
            elif time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout or 0.0)
            else:
                time.sleep(0.01)


class ForkServer:
    """The agent's handle on its node's fork server."""

    def __init__(self, proc: subprocess.Popen[bytes] | ForkedProc, sock: socket.socket, env: Mapping[str, str],
                 *, early: bool = False) -> None:
        self.proc = proc
        self.sock = sock
        self.env = dict(env)  # the environment it was started with
        self.early = early  # forked from the agent (fork_early): the agent's environment
        self._why_not: str | None = None
        self._ready = False

    @classmethod
    def fork_early(cls, *, cwd: str, parent: int) -> ForkServer:
        """A server forked from this process (the agent, while its main thread is its only one:
        before it connects to the other agents), in ``cwd``, tied to ``parent``. It keeps what
        the agent imported (torch: the ~3 s of CPU a started server pays again, per node and
        allocation) and imports the trainer while the agents meet. Its environment is the
        agent's; a rank's may differ from it as :func:`may_differ_early` allows. OSError if it
        cannot be forked."""
        if threading.active_count() > 1:
            raise OSError(f"{threading.active_count() - 1} Python threads run besides the main one")
        if not set_subreaper():
            raise OSError("prctl(PR_SET_CHILD_SUBREAPER) failed: forked ranks would not be this agent's children")
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            pid = os.fork()
        except OSError:
            ours.close()
            theirs.close()
            raise
        if pid == 0:  # the server: nothing of the agent's runs here, not even its exit handlers
            code = 1
            try:
                standby._set_name(SERVER_NAME)  # first: a process finder never takes it for an agent
                if not getattr(sys.flags, "safe_path", False) and sys.path:
                    del sys.path[0]  # the agent's start-up directory: what -P leaves out
                ours.close()
                os.setsid()
                os.chdir(cwd)
                _as_if_started(theirs.fileno())
                code = serve([str(parent), str(theirs.fileno())])
            except BaseException:  # noqa: BLE001 - said on the agent's log, the server is gone
                traceback.print_exc()
            finally:
                from slurmkit.procexit import leave

                leave(code)
        theirs.close()
        return cls(ForkedProc(pid, None), ours, os.environ, early=True)

    @classmethod
    def start(cls, env: Mapping[str, str], *, cwd: str | None, parent: int, subreaper: bool = True,
              late_imports: Sequence[str] = standby.LATE_IMPORTS) -> ForkServer:
        """Start the server with ``env`` (local rank 0's environment for the first generation),
        tied to ``parent`` (this process), after making this process a subreaper (unless
        ``subreaper=False``: the caller makes itself one around each fork). It imports
        ``late_imports`` ahead too (the agent leaves out s3fs for a run without an object
        tier: 0.3-0.5 s of CPU per node and allocation). OSError if it cannot be started."""
        if subreaper and not set_subreaper():
            raise OSError("prctl(PR_SET_CHILD_SUBREAPER) failed: forked ranks would not be this agent's children")
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            safe = ["-P"] if sys.version_info >= (3, 11) else []
            proc = subprocess.Popen([sys.executable, *safe, "-m", MODULE, str(parent), str(theirs.fileno()),
                                     ",".join(late_imports)],
                                    env=dict(env), stdin=subprocess.DEVNULL, pass_fds=(theirs.fileno(),),
                                    start_new_session=True, cwd=cwd)
        except OSError:
            ours.close()
            raise
        finally:
            theirs.close()
        return cls(proc, ours, env)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _receive(self, timeout_s: float) -> dict[str, Any]:
        self.sock.settimeout(timeout_s)
        try:
            data = self.sock.recv(MAX_DATAGRAM)
        except (TimeoutError, BlockingIOError):
            raise ForkServerError(f"no answer from the fork server (pid {self.pid}) in {timeout_s:.0f} s") from None
        except OSError as exc:
            raise ForkServerError(f"the fork server (pid {self.pid}) is unreachable: {exc}") from None
        if not data:
            raise ForkServerError(f"the fork server (pid {self.pid}) is gone (exit {self.proc.poll()})")
        try:
            got = json.loads(data)
        except ValueError:
            got = None
        if not isinstance(got, dict):
            raise ForkServerError(f"the fork server (pid {self.pid}) sent {data[:80]!r}, not a JSON object")
        return got

    def refused(self) -> str | None:
        """Why the server cannot fork, once it is known (it said so, or it is gone); None while
        it imports or once it is ready. Never waits."""
        if self._why_not is None and self.proc.poll() is not None:
            self._why_not = f"the fork server exited with {self.proc.returncode}"
        return self._why_not

    def why_not(self, timeout_s: float) -> str | None:
        """None once the server has imported the trainer and can fork; else why not. Waits up
        to ``timeout_s`` for its first message (it imports for a few seconds)."""
        if self._ready or self.refused() is not None:
            return self._why_not
        try:
            got = self._receive(timeout_s)
        except ForkServerError as exc:
            if "no answer" in str(exc):
                return str(exc)  # still importing: not refused, asked again later
            self._why_not = str(exc)
            return self._why_not
        if got.get("v") != PROTOCOL or got.get("ready") is not True:
            self._why_not = f"the fork server's first message is {got!r}"
        else:
            self._why_not = str(got.get("why_not") or "") or None
            self._ready = self._why_not is None
        return self._why_not

    def fork(self, env: Mapping[str, str], args: Sequence[str], *, plan_json: str | None, verify: str,
             timeout_s: float, output: int | None = None, also_differ: Collection[str] = ()) -> ForkedProc:
        """Fork the rank that needs ``env`` and runs the trainer with ``args``; its standard
        output and error go to a new pipe whose read end is the ForkedProc's ``stdout``, or to
        the descriptor ``output`` (the caller's: it stays open) with no ``stdout``. Names in
        ``also_differ`` (the caller knows no rank reads them before the fork) may differ too."""
        names = [n for n in mismatch(self.env, env, early=self.early) if n not in also_differ]
        if names:
            raise ForkServerError(f"its environment differs in {', '.join(names[:5])}")
        message = {"v": PROTOCOL, "set": {k: v for k, v in env.items() if self.env.get(k) != v},
                   "unset": sorted(k for k in self.env if k not in env), "args": list(args),
                   "plan": plan_json, "verify": verify}
        data = json.dumps(message, separators=(",", ":")).encode()
        if len(data) > MAX_DATAGRAM:
            raise ForkServerError("the environment to hand over is too large")
        read_end, write_end = os.pipe() if output is None else (-1, output)

        def close_read_end() -> None:
            if read_end >= 0:
                os.close(read_end)

        try:
            try:
                socket.send_fds(self.sock, [data], [write_end])
            except OSError as exc:
                raise ForkServerError(f"the fork server (pid {self.pid}) is unreachable: {exc}") from None
        except BaseException:
            close_read_end()
            raise
        finally:
            if output is None:
                os.close(write_end)
        try:
            got = self._receive(timeout_s)
        except BaseException as exc:
            close_read_end()
            # an answer that comes later would be read as the next request's: no next request
            self._why_not = f"the fork request was not answered: {exc}"
            raise
        pid = got.get("pid")
        if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 1:
            close_read_end()
            raise ForkServerError(f"the fork server did not fork: {got.get('error') or got!r}")
        return ForkedProc(pid, None if read_end < 0 else os.fdopen(read_end, "rb"))

    def stop(self) -> None:
        """End the server (its own session) and reap it; the ranks it forked are not its own."""
        self.sock.close()
        standby.end_session(self.proc, "fork server")


# ---------------------------------------------------------------------- the server's side
def _unbuffered_streams() -> None:
    """Standard output and error written through at once, as ``python -u`` makes them."""
    for name, fd in (("stdout", 1), ("stderr", 2)):
        old = getattr(sys, name)
        setattr(sys, name, io.TextIOWrapper(open(fd, "wb", buffering=0, closefd=False), write_through=True,
                                            encoding=getattr(old, "encoding", None) or "utf-8",
                                            errors=getattr(old, "errors", None) or "backslashreplace"))


def _as_if_started(keep: int) -> None:
    """In a server forked from the agent: what a started one would have. Default signal
    dispositions (it installs its own), no stack dump on SIGUSR2, standard input from /dev/null,
    and no descriptor of the agent's but the standard three and ``keep``."""
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGALRM, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.set_wakeup_fd(-1)
    faulthandler.unregister(signal.SIGUSR2)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2 and fd != keep:
            try:
                os.close(fd)
            except OSError:
                pass  # the listing's own descriptor


def why_not_fork() -> str | None:
    """Why this process may not fork a rank now; None if it may."""
    others = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    if others:
        return f"Python threads run besides the main one ({', '.join(others[:3])})"
    try:
        with open("/proc/self/maps") as f:
            if "libcuda.so" in f.read():
                return "CUDA's driver is loaded in the fork server (a CUDA context does not survive a fork)"
    except OSError as exc:
        return f"cannot read /proc/self/maps: {exc}"
    return None


def _send(sock: socket.socket, obj: Mapping[str, Any]) -> None:
    sock.send(json.dumps(obj, separators=(",", ":")).encode())


def _read_all(fd: int) -> bytes:
    chunks: list[bytes] = []
    while True:
        chunk = os.read(fd, 64)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def _parse(data: bytes) -> tuple[dict[str, str], list[str], list[str], str | None, str]:
    got = json.loads(data)
    put, unset, args = standby.parse_message(got)
    plan, verify = got.get("plan"), got.get("verify")
    if plan is not None and not isinstance(plan, str):
        raise ValueError("a fork request whose plan is not a string")
    if verify not in ("off", "warn", "fail"):
        raise ValueError(f"a fork request whose verify is {verify!r}")
    return put, unset, args, plan, verify


def _become_rank(request: tuple[dict[str, str], list[str], list[str], str | None, str], out_fd: int,
                 sock: socket.socket, agent_pid: int, mid: int, stop: Any, trainer: Any) -> None:
    """The forked rank: its own session, output and stop flag, the agent's child and tied to it,
    its environment and binding, then the trainer. Never returns."""
    code = 1
    try:
        stop.signum = None  # a signal the server kept is not this rank's
        sock.close()
        os.setsid()
        os.dup2(out_fd, 1)
        os.dup2(out_fd, 2)
        os.close(out_fd)
        devnull = os.open(os.devnull, os.O_RDONLY)  # as a cold rank: stdin is /dev/null
        os.dup2(devnull, 0)
        os.close(devnull)
        deadline = time.monotonic() + REPARENT_WAIT_S
        while os.getppid() == mid and time.monotonic() < deadline:
            time.sleep(0.0005)
        if os.getppid() != agent_pid:
            print(f"slurmkit fork server: the forked rank's parent is {os.getppid()}, not its agent {agent_pid}: "
                  "not starting", file=sys.stderr, flush=True)
            code = EXIT_ORPHANED
            return
        arm(agent_pid)
        put, unset, args, plan_json, verify = request
        for name in unset:
            os.environ.pop(name, None)
        os.environ.update(put)
        if put.get("PYTHONUNBUFFERED") and not isinstance(getattr(sys.stdout, "buffer", None), io.FileIO):
            _unbuffered_streams()
        if "OMP_NUM_THREADS" in put and put["OMP_NUM_THREADS"].isdigit():
            import torch  # already imported by the server: OpenMP read the variable then

            torch.set_num_threads(max(1, int(put["OMP_NUM_THREADS"])))
        if plan_json is not None:
            from slurmkit.topology.apply import apply_plan, verify_current
            from slurmkit.topology.pin import report_problems
            from slurmkit.topology.rankplan import RankPlan

            plan = RankPlan.from_json(plan_json)
            apply_plan(plan)
            report_problems(verify_current(plan), verify)
        from slurmkit.train.signals import register_stack_dump

        sys.argv = [trainer.__file__ or standby.TRAINER, *args]
        standby._set_name(f"{standby.ADOPTED_PREFIX}{os.environ.get('RANK', '')}")
        stacks = register_stack_dump(os.environ)  # noqa: F841 - kept open for the process's life
        code = trainer.main(early_stop=stop)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - the rank's end, whatever it was, is its exit code
        traceback.print_exc()
        code = 1
    finally:
        from slurmkit.procexit import leave

        leave(code)


def _fork_rank(request: tuple[dict[str, str], list[str], list[str], str | None, str], out_fd: int,
               sock: socket.socket, agent_pid: int, stop: Any, trainer: Any) -> int:
    """Fork the rank through an intermediate that exits at once; the rank's pid."""
    sys.stdout.flush()
    sys.stderr.flush()
    read_end, write_end = os.pipe()
    mid = os.fork()
    if mid == 0:  # the intermediate
        try:
            os.close(read_end)
            me = os.getpid()  # the rank's parent until this process exits
            rank = os.fork()
            if rank == 0:
                os.close(write_end)
                _become_rank(request, out_fd, sock, agent_pid, me, stop, trainer)
            os.write(write_end, str(rank).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    try:
        data = _read_all(read_end)
    finally:
        os.close(read_end)
        os.waitpid(mid, 0)
    if not data.isdigit():
        raise OSError("the intermediate process gave no pid (the second fork failed)")
    return int(data)


def serve(argv: Sequence[str]) -> int:
    """The server's life: ``AGENT_PID SOCKET_FD [LATE,IMPORTS]`` (default: standby.LATE_IMPORTS)."""
    if len(argv) not in (2, 3) or not all(a.isdigit() for a in argv[:2]):
        print("usage: python -m slurmkit.launch.forkserver AGENT_PID SOCKET_FD [MODULE,...]", file=sys.stderr)
        return 2
    agent_pid, fd = int(argv[0]), int(argv[1])
    late = [m for m in argv[2].split(",") if m] if len(argv) == 3 else list(standby.LATE_IMPORTS)
    arm(agent_pid)
    from slurmkit.train.signals import StopRequest

    # As a standby: a time-limit warning or SIGTERM sent to every process of the step is kept
    # (the agent decides what the allocation does), not the end of the server.
    stop = StopRequest().install()
    standby._set_name(SERVER_NAME)
    sock = socket.socket(fileno=fd)
    import slurmkit.train.__main__ as trainer

    for name in late:
        if name not in standby.LATE_IMPORTS:  # only the modules named there, whatever argv says
            continue
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - optional: the rank imports it itself if it needs it
            pass
    why = why_not_fork()
    _send(sock, {"v": PROTOCOL, "ready": True, "why_not": why or ""})
    if why:
        return 0
    while True:
        try:
            data, fds, _flags, _addr = socket.recv_fds(sock, MAX_DATAGRAM, 1)
        except OSError:
            return 0
        if not data:
            return 0  # the agent closed its end, or is gone
        if len(fds) != 1:
            for extra in fds:
                os.close(extra)
            _send(sock, {"error": f"a fork request with {len(fds)} descriptors, not 1"})
            continue
        try:
            request = _parse(data)
            why = why_not_fork()
            if why:
                raise OSError(why)
            pid = _fork_rank(request, fds[0], sock, agent_pid, stop, trainer)
        except (ValueError, OSError) as exc:
            _send(sock, {"error": str(exc)[:500]})
        else:
            _send(sock, {"pid": pid})
        finally:
            os.close(fds[0])


if __name__ == "__main__":
    from slurmkit.procexit import leave

    leave(serve(sys.argv[1:]))
