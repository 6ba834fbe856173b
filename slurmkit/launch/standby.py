"""Warm standby ranks: the reference trainer's next rank process, started and imported ahead.

Most of a restart inside the allocation is each new rank starting Python and importing torch,
omegaconf and the trainer (3-5 s of CPU per rank, more when a node's ranks import at once on a
shared file system). A standby is that process started early: it imports the trainer and
blocks on its stdin. When the agent starts the next generation it hands the standby the rank's
environment (what differs from the one it was started with) and the standby runs the trainer
as ``python -m slurmkit.train`` would, in the same process: the import is already paid.

The agent side (:func:`spawn`, :func:`adopt`) and the standby side (:func:`serve`, run as
``python -m slurmkit.launch.standby``) talk through one JSON line on the standby's stdin:

    {"v": 1, "set": {NAME: VALUE, ...}, "unset": [NAME, ...], "args": [...]}

Only names a rank's identity is made of may differ between the environment a standby was
started with and the one it is given (:func:`mismatch`): anything read while Python and torch
start (PYTHONPATH, LD_PRELOAD, OMP_NUM_THREADS, CUDA_VISIBLE_DEVICES, ...) must be the same,
or the agent starts the rank cold instead. The standby ends by itself when its stdin closes
(the agent left, even by SIGKILL): nothing it starts outlives the agent.

A standby never runs anything but this trainer: a user program (``job.command``) is started
cold as before. ``/proc/PID/environ`` keeps the environment a process was started with, so an
adopted standby names itself in ``/proc/PID/comm`` instead: ``skrank<RANK>`` (``skstandby``
while it waits); process finders read it (testkit.chaos.procs).
"""

from __future__ import annotations

import ctypes
import importlib
import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from slurmkit.failures.programs import REFERENCE_TRAINER, reference_trainer_args

log = logging.getLogger(__name__)

MODULE = "slurmkit.launch.standby"
TRAINER = REFERENCE_TRAINER
PROTOCOL = 1
MAX_MESSAGE_BYTES = 32 * 1024  # the delta of a rank's identity is ~1 KB; never block on the pipe
WAITING_NAME = "skstandby"
ADOPTED_PREFIX = "skrank"
# The names that make up a rank's place in one generation (slurmkit.contract.RankIdentity and
# the agent's per-generation SLURMKIT_* files): neither Python nor torch reads them at start-up.
IDENTITY = frozenset({"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                      "MASTER_ADDR", "MASTER_PORT"})
IDENTITY_PREFIXES = ("SLURMKIT_", "SLURM_")
# What a rank imports only once it runs (measured with py-spy on a restarted rank: torch._dynamo
# alone, pulled in by the optimizer's and DDP's compile checks, was 1.3-2.4 s of its restart;
# s3fs ~0.3 s when the object tier is used). Imported here too, each one if it imports at all.
LATE_IMPORTS = ("torch._dynamo", "torch.distributed.checkpoint", "torch.distributed.algorithms.ddp_comm_hooks",
                "s3fs")


def identity_name(name: str) -> bool:
    return name in IDENTITY or name.startswith(IDENTITY_PREFIXES)


def trainer_args(argv: Sequence[str]) -> list[str] | None:
    """The trainer's own arguments when ``argv`` is ``<this python> -m slurmkit.train ...``
    (a standby runs nothing else: slurmkit.failures.programs.reference_trainer_args, in this
    interpreter); None for any other program."""
    return reference_trainer_args(argv) if list(argv[:1]) == [sys.executable] else None


def mismatch(started: Mapping[str, str], wanted: Mapping[str, str],
             may_differ: Callable[[str], bool] = identity_name) -> list[str]:
    """Names that may not differ (outside a rank's identity, by default) but do, sorted: a
    standby started with ``started`` cannot become a rank that needs ``wanted``."""
    names = set(started) | set(wanted)
    return sorted(n for n in names if not may_differ(n) and started.get(n) != wanted.get(n))


def message(started: Mapping[str, str], wanted: Mapping[str, str], args: Sequence[str]) -> bytes:
    out = {"v": PROTOCOL, "set": {k: v for k, v in wanted.items() if started.get(k) != v},
           "unset": sorted(k for k in started if k not in wanted), "args": list(args)}
    return (json.dumps(out, separators=(",", ":")) + "\n").encode()


@dataclass
class Standby:
    """One standby process of this agent (its local rank's slot)."""

    local_rank: int
    proc: subprocess.Popen[bytes]
    prefix: tuple[str, ...]  # what came before the standby module: the pin wrapper, or nothing
    env: dict[str, str]  # the environment it was started with

    @property
    def pid(self) -> int:
        return self.proc.pid

    def discard(self) -> None:
        """End it (its own session: any child goes too) and reap it."""
        end_session(self.proc, f"standby of local rank {self.local_rank}")
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()


class Ended(Protocol):
    """What end_session needs of a process: a started one, or one forked from the agent."""

    @property
    def pid(self) -> int: ...
    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...


def end_session(proc: Ended, what: str) -> None:
    """SIGKILL ``proc``'s session (a process started with ``start_new_session``: its children
    go too) and reap it; ``what`` names it if it does not end."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:  # unkillable (D state): the kernel reaps it later
        log.warning("%s (pid %d) did not end", what, proc.pid)


def spawn(prefix: Sequence[str], env: Mapping[str, str], *, local_rank: int, cwd: str | None,
          parent: int | None = None) -> Standby:
    """Start a standby for ``local_rank``: ``prefix`` (the rank's pin wrapper, or empty) in
    front of ``<this python> -m slurmkit.launch.standby [PARENT]``, with ``env``. With
    ``parent`` (this process's pid) it dies with this process (slurmkit.launch.tether)."""
    tail = [str(parent)] if parent is not None else []
    proc = subprocess.Popen([*prefix, sys.executable, "-m", MODULE, *tail], env=dict(env), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True, cwd=cwd)
    return Standby(local_rank, proc, tuple(prefix), dict(env))


def why_not(sb: Standby, prefix: Sequence[str], env: Mapping[str, str], args: Sequence[str]) -> str | None:
    """Why ``sb`` cannot become the rank started by ``prefix`` + trainer and ``env``; None if it can."""
    if sb.proc.poll() is not None:
        return f"it exited with {sb.proc.returncode}"
    if tuple(prefix) != sb.prefix:
        return "its pinning differs"
    names = mismatch(sb.env, env)
    if names:
        return f"its environment differs in {', '.join(names[:5])}"
    if len(message(sb.env, env, args)) > MAX_MESSAGE_BYTES:
        return "the environment to hand over is too large"
    return None


def hand_over(sb: Standby, env: Mapping[str, str], args: Sequence[str]) -> bool:
    """Give ``sb`` its rank (one line on its stdin, then EOF); False if it is gone."""
    assert sb.proc.stdin is not None  # noqa: S101 - spawn always pipes stdin
    try:
        sb.proc.stdin.write(message(sb.env, env, args))
        sb.proc.stdin.close()
    except (BrokenPipeError, ValueError, OSError):
        return False
    return True


# ---------------------------------------------------------------------- the standby process
def _set_name(name: str) -> None:
    """This process's name in /proc/PID/comm (prctl PR_SET_NAME, at most 15 bytes)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(15, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the name is only for finders
        pass


def read_message(stream) -> tuple[dict[str, str], list[str], list[str]] | None:
    """(set, unset, args) from the agent's line, None at EOF (the agent is gone). Raises
    ValueError on anything else: the pipe is the agent's alone, but a bad line is not obeyed."""
    line = stream.readline(MAX_MESSAGE_BYTES + 1)
    if not line:
        return None
    if len(line) > MAX_MESSAGE_BYTES or not line.endswith(b"\n"):
        raise ValueError(f"a hand-over line of over {MAX_MESSAGE_BYTES} bytes")
    return parse_message(json.loads(line))


def parse_message(got: object) -> tuple[dict[str, str], list[str], list[str]]:
    """(set, unset, args) of a decoded hand-over message (a standby's line, or a fork request
    of slurmkit.launch.forkserver); ValueError for anything else."""
    if not isinstance(got, dict) or got.get("v") != PROTOCOL:
        raise ValueError(f"hand-over protocol {got.get('v') if isinstance(got, dict) else got!r}, not {PROTOCOL}")
    put, unset, args = got.get("set"), got.get("unset"), got.get("args")
    if (not isinstance(put, dict) or not all(isinstance(k, str) and isinstance(v, str) and k
                                             and "=" not in k and "\0" not in k + v for k, v in put.items())
            or not isinstance(unset, list) or not all(isinstance(k, str) for k in unset)
            or not isinstance(args, list) or not all(isinstance(a, str) for a in args)):
        raise ValueError("a hand-over line that is not {set: {str: str}, unset: [str], args: [str]}")
    return put, unset, args


def serve(args: Sequence[str] = ()) -> int:
    """The standby's life: keep stop signals, import the trainer, wait for a rank, run it.
    ``args``: the agent's pid, to die with it (slurmkit.launch.tether), or nothing."""
    from slurmkit.launch.tether import arm
    from slurmkit.train.signals import StopRequest, register_stack_dump

    if args and args[0].isdigit():
        arm(int(args[0]))

    # As the trainer does before its imports: a time-limit warning or SIGTERM that comes now is
    # kept for the trainer's first step boundary instead of killing the process.
    stop = StopRequest().install()
    _set_name(WAITING_NAME)
    import slurmkit.train.__main__ as trainer  # the import a cold rank pays after its restart

    for name in LATE_IMPORTS:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - optional: the rank imports it itself if it needs it
            pass

    try:
        got = read_message(sys.stdin.buffer)
    except ValueError as exc:
        print(f"slurmkit standby: {exc}", file=sys.stderr, flush=True)
        return 1
    if got is None:
        return 0  # the agent went away (or discarded it): nothing to run
    put, unset, args = got
    for name in unset:
        os.environ.pop(name, None)
    os.environ.update(put)
    devnull = os.open(os.devnull, os.O_RDONLY)  # as a cold rank: stdin is /dev/null
    os.dup2(devnull, 0)
    os.close(devnull)
    sys.argv = [trainer.__file__ or TRAINER, *args]
    _set_name(f"{ADOPTED_PREFIX}{os.environ.get('RANK', '')}")
    stacks = register_stack_dump(os.environ)  # noqa: F841 - kept open for the process's life
    return trainer.main(early_stop=stop)


if __name__ == "__main__":
    from slurmkit.procexit import leave

    code = serve(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    leave(code)
