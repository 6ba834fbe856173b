"""A run's processes on the emulated nodes, found through /proc.

The local cluster's nodes are slurmd daemons on this one machine, so every process of a job is
visible here; each carries the job's environment (``SLURMKIT_RUN_DIR``, ``RANK``,
``SLURMD_NODENAME``, ``SLURMKIT_NODE_RANK``). A rank that began as a warm standby
(slurmkit.launch.standby), or forked by the fork server (slurmkit.launch.forkserver), still shows the
environment it was started with; it names its rank in
``/proc/PID/comm`` (``skrank<RANK>``), read here instead. Reading the truth from /proc rather than from the
ledger's ``ranks_started`` pids means the driver never signals a pid of an older generation
that the ledger has not caught up with. ``proc_root`` is a parameter so tests can hand in a
directory of their own.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from slurmkit.failures.programs import is_reference_trainer
from slurmkit.launch.rendezvous import STORE_COMM
from slurmkit.launch.forkserver import MODULE as FORK_MODULE
from slurmkit.launch.forkserver import SERVER_NAME
from slurmkit.launch.standby import ADOPTED_PREFIX as STANDBY_RANK_PREFIX
from slurmkit.launch.standby import MODULE as STANDBY_MODULE
from slurmkit.launch.standby import WAITING_NAME


@dataclass(frozen=True)
class Proc:
    pid: int
    cmdline: tuple[str, ...]
    env: dict[str, str]
    state: str  # /proc/PID/stat's state letter (R, S, T for stopped, Z, ...)
    start: int  # start time in clock ticks since boot: orders processes by age
    comm: str = ""  # /proc/PID/comm: a warm standby's rank once it has one

    @property
    def node(self) -> str:
        return self.env.get("SLURMD_NODENAME", "")


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


def _stat(raw: bytes) -> tuple[str, int]:
    rest = raw.rsplit(b") ", 1)[1].split()
    return rest[0].decode(), int(rest[19])  # fields 3 and 22 of proc(5)


def scan(run_dir: str, job_id: str | None = None, proc_root: str = "/proc") -> list[Proc]:
    """Every live process of the run (zombies left out): its environment names ``run_dir`` as
    its run, or ``job_id`` as its Slurm job (the batch shell exports SLURMKIT_RUN_DIR itself, so
    only the job id is in the environment it started with)."""
    want = os.path.realpath(run_dir)
    out = []
    for name in os.listdir(proc_root):
        if not name.isdigit():
            continue
        base = os.path.join(proc_root, name)
        environ = _read(os.path.join(base, "environ"))
        if not environ or (b"SLURMKIT_RUN_DIR=" not in environ and b"SLURM_JOB_ID=" not in environ):
            continue
        env = dict(kv.split("=", 1) for kv in environ.decode(errors="replace").split("\0") if "=" in kv)
        mine = os.path.realpath(env.get("SLURMKIT_RUN_DIR", "/nonexistent")) == want or (
            job_id is not None and env.get("SLURM_JOB_ID") == job_id)
        if not mine:
            continue
        stat, cmd = _read(os.path.join(base, "stat")), _read(os.path.join(base, "cmdline"))
        if stat is None or cmd is None:
            continue
        state, start = _stat(stat)
        if state == "Z":
            continue
        comm = (_read(os.path.join(base, "comm")) or b"").decode(errors="replace").strip()
        out.append(Proc(int(name), tuple(cmd.decode(errors="replace").split("\0")[:-1]), env, state, start, comm))
    return out


def _standby(p: Proc) -> bool:
    """A warm standby, the fork server or a rank it forked: its command line and environment are
    the ones it was started with (a server forked from the agent: the agent's); its role is in
    its process name (``skstandby``, ``skforkserver``, ``skrank<RANK>`` once it has a rank)."""
    return ("-m" in p.cmdline and (STANDBY_MODULE in p.cmdline or FORK_MODULE in p.cmdline)) or p.comm in (
        SERVER_NAME, WAITING_NAME) or p.comm.startswith(STANDBY_RANK_PREFIX)


def rank_of(p: Proc) -> int | None:
    """The training rank ``p`` runs, None if it runs none (a standby still waiting, an agent)."""
    if _standby(p):
        digits = p.comm[len(STANDBY_RANK_PREFIX):] if p.comm.startswith(STANDBY_RANK_PREFIX) else ""
        return int(digits) if digits.isdigit() else None
    if "RANK" in p.env and is_reference_trainer(p.cmdline):
        return int(p.env["RANK"])
    return None


def is_rank(p: Proc) -> bool:
    return rank_of(p) is not None


def is_agent(p: Proc) -> bool:
    """A node agent: submitit's entry point, not a rank, and not node 0's store server (a child
    forked from the agent, with its command line and its own process name), nor the fork server
    forked from it or a rank forked from that (their process names)."""
    return (any("submitit.core._submit" in a for a in p.cmdline) and "RANK" not in p.env
            and p.comm != STORE_COMM and not _standby(p))


def is_batch_shell(p: Proc) -> bool:
    return any(a.endswith("slurm_script") for a in p.cmdline)


def newest(procs: list[Proc]) -> Proc | None:
    return max(procs, key=lambda p: p.start, default=None)


def ranks(procs: list[Proc]) -> dict[int, Proc]:
    """rank -> its newest live process."""
    out: dict[int, Proc] = {}
    for p in sorted(procs, key=lambda p: p.start):
        rank = rank_of(p)
        if rank is not None:
            out[rank] = p
    return out
