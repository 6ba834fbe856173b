"""A lost agent on a healthy node, relaunched inside the allocation.

When a node agent dies while its node stays healthy (SIGKILLed, slurmd alive: Slurm still
calls the node MIXED/ALLOCATED), node 0 starts a new agent there instead of giving the slot to
a spare or requeueing the whole job: one more srun step of the job on that node, started by
node 0's agent as the batch script starts every agent (sbatch_templates/launch_agents.sh.j2:
the same srun arguments, SLURMKIT_NODE_RANK, an --output beside the node's first log).

Before the step starts, node 0 posts a sealed rejoin message (slurmkit.supervise.channel:
``Rejoin``: the attempt, the relaunch number, the generation to join, its slot and the slots
and spares as they are now) and resets the node's beat counter. The new agent reads and checks
the message before it beats (``read_rejoin``), then runs as a follower from that generation
on, in its old slot. Node 0 decides a restart only once the new agent has beaten; if the srun
fails or no beat comes within ``supervisor.startup_timeout_s`` (the deadline liveness gives an
agent's first beat), the step is stopped and node 0 decides as before: a spare, else a requeue
keeping the node. At most ``supervisor.agent_relaunches`` relaunches per node and allocation.

The srun processes are node 0's agent's children: ``Relauncher.stop_all`` (in the agent's
``finally``) ends them, and the job's end ends their steps in any case.
"""

from __future__ import annotations

import glob
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from slurmkit.contract import GROUP_LOG_ENV
from slurmkit.errors import SlurmkitError
from slurmkit.runfiles import LOGS_DIR, SUBMITIT_DIR
from slurmkit.supervise.channel import Channel, ChannelError, Rejoin

log = logging.getLogger(__name__)

#: Set in a relaunched agent's environment: its relaunch number (1, 2, ...). A first agent has none.
REJOIN_ENV = "SLURMKIT_REJOIN"
AGENT_MODULE = "slurmkit.launch"
#: Environment of node 0's own step that must not reach a step started from it: Slurm sets these
#: per step and task (srun would read some as options: the step's one task, its node list, its
#: binding), and the GPUs of node 0's step are not the new step's.
_STEP_ONLY = ("SLURM_STEP_", "SLURM_CPU_BIND", "SLURM_SRUN_COMM_")
_STEP_VARS = frozenset({
    "SLURM_STEPID", "SLURM_NTASKS", "SLURM_NPROCS", "SLURM_TASKS_PER_NODE", "SLURM_NODEID", "SLURM_PROCID",
    "SLURM_LOCALID", "SLURM_GTIDS", "SLURM_TASK_PID", "SLURM_DISTRIBUTION", "SLURM_LAUNCH_NODE_IPADDR",
    "SLURM_UMASK", "SLURM_TOPOLOGY_ADDR", "SLURM_TOPOLOGY_ADDR_PATTERN", "SLURM_CPUS_ON_NODE", "SLURMD_NODENAME",
    "SLURMKIT_GROUP_LOG_DIR",  # a step of several nodes (slurmkit.contract.GROUP_LOG_ENV)
    "CUDA_VISIBLE_DEVICES", "GPU_DEVICE_ORDINAL", "ROCR_VISIBLE_DEVICES",
})


class Launched(Protocol):
    """One relaunched agent's step, as node 0 holds it."""

    command: list[str]
    log: str  # where its output goes

    def poll(self) -> int | None: ...  # the launcher's exit code, None while it runs
    def stop(self, wait_s: float) -> None: ...  # let it end by itself for wait_s, then end it


#: Start the agent of (node name, node rank) as its relaunch number ``relaunch``.
Spawn = Callable[[str, int, int], Launched]
#: Start the agents of several (node name, node rank, relaunch) in one srun step of those nodes.
SpawnMany = Callable[[Sequence[tuple[str, int, int]]], Launched]


@dataclass(frozen=True)
class Started:
    node: str
    node_rank: int
    relaunch: int
    first_beat_s: float  # from the srun's start to the new agent's first beat
    step: Launched


@dataclass(frozen=True)
class Result:
    ok: bool
    why: str  # why it failed ("" when ok)
    started: tuple[Started, ...] = ()


class Relauncher:
    """Node 0: relaunch lost agents, each node at most ``limit`` times in this allocation."""

    def __init__(self, spawn: Spawn, *, limit: int, first_beat_s: float, poll_s: float = 0.1,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                 spawn_many: SpawnMany | None = None) -> None:
        self.spawn, self.limit, self.first_beat_s, self.poll_s = spawn, limit, first_beat_s, poll_s
        # Several agents lost at once (the agents of a shared srun step: launch.nodes_per_step)
        # come back in one step of their nodes, not one step each: one step-create RPC.
        self.spawn_many = spawn_many
        self.clock, self.sleep = clock, sleep
        self._used: dict[str, int] = {}
        self._running: list[Launched] = []

    def used(self, node: str) -> int:
        return self._used.get(node, 0)

    def left(self, node: str) -> int:
        return max(self.limit - self.used(node), 0)

    def relaunch(self, channel: Channel, attempt: str, generation: int, slots: Sequence[int],
                 spares: Sequence[int], lost: Sequence[tuple[str, int]]) -> Result:
        """Start a new agent for each lost (name, node rank), which joins ``generation`` in its
        slot, and wait for every one's first beat. Each counts against its node's cap, failed
        or not. On failure every step started here is stopped."""
        steps: list[tuple[str, int, int, Launched]] = []
        beat_s: dict[int, float] = {}  # node rank -> seconds from the first srun to its first beat
        t0 = self.clock()
        try:
            posted = []
            for name, nr in lost:
                n = self._used[name] = self.used(name) + 1
                channel.reset_beat(nr)
                channel.post_rejoin(nr, Rejoin(attempt, n, generation, list(slots).index(nr), tuple(slots),
                                               tuple(spares)))
                posted.append((name, nr, n))
            if self.spawn_many is not None and len(posted) > 1:
                shared = self.spawn_many(posted)
                steps += [(name, nr, n, shared) for name, nr, n in posted]
            else:
                steps += [(name, nr, n, self.spawn(name, nr, n)) for name, nr, n in posted]
            why = self._wait_beats(channel, steps, t0, beat_s)
        except (OSError, RuntimeError, SlurmkitError) as exc:  # srun missing, the store failing
            why = f"could not relaunch: {type(exc).__name__}: {exc}"
        if why:
            for step in _distinct(s[3] for s in steps):
                step.stop(0.0)
            return Result(False, why)
        self._running += _distinct(s[3] for s in steps)
        return Result(True, "", tuple(Started(name, nr, n, beat_s[nr], step) for name, nr, n, step in steps))

    def _wait_beats(self, channel: Channel, steps: list[tuple[str, int, int, Launched]], t0: float,
                    beat_s: dict[int, float]) -> str:
        """"" once every new agent has beaten (its counter, reset to 0, moved); else why not:
        its srun ended first, or ``first_beat_s`` passed."""
        deadline = t0 + self.first_beat_s
        while True:
            waiting = [s for s in steps if s[1] not in beat_s]
            for nr, v in channel.beats([s[1] for s in waiting]).items():
                if v > 0:
                    beat_s[nr] = self.clock() - t0
            waiting = [s for s in waiting if s[1] not in beat_s]
            if not waiting:
                return ""
            for name, _, _, step in waiting:
                code = step.poll()
                if code is not None:
                    return f"the srun of {name}'s new agent exited with code {code} before its first beat"
            if self.clock() >= deadline:
                return (f"no first beat from the new agent on {','.join(s[0] for s in waiting)} within "
                        f"{self.first_beat_s:.0f} s (supervisor.startup_timeout_s)")
            self.sleep(self.poll_s)

    def stop_all(self, wait_s: float) -> None:
        """Node 0's agent is leaving: every relaunched agent's step ends with it (each may end
        by itself within ``wait_s``: it has seen the end of the run too)."""
        deadline = self.clock() + wait_s
        for step in self._running:
            step.stop(max(deadline - self.clock(), 0.0))
        self._running = []


def _distinct(steps: Iterable[Launched]) -> list[Launched]:
    """Each step once (the agents of one shared step hold the same one)."""
    out: list[Launched] = []
    for step in steps:
        if all(step is not seen for seen in out):
            out.append(step)
    return out


# ------------------------------------------------------------------ the new agent's side
def read_rejoin(channel: Channel, node_rank: int, attempt: str, env: Mapping[str, str],
                node_name: str = "") -> Rejoin | None:
    """A relaunched agent's rejoin message (None for a first agent: no REJOIN_ENV). It must be
    there and be the one of this relaunch: a message of an earlier relaunch, or none, is an
    error (the new agent must not beat: node 0 then falls back as for a failed relaunch).

    REJOIN_ENV is the relaunch number, or for agents relaunched in one shared step
    ``name=number,name=number,...``, of which this agent takes its node's."""
    text = env.get(REJOIN_ENV)
    if not text:
        return None
    if "=" in text:
        mine = [v for k, _, v in (item.partition("=") for item in text.split(",")) if k == node_name]
        if len(mine) != 1:
            raise SlurmkitError(f"Detected: {REJOIN_ENV}={text[:200]!r} does not name this node ({node_name!r}) "
                                "once. Requirement: the relaunch numbers node 0's agent starts a shared step "
                                f"with. Fix: do not set {REJOIN_ENV} by hand.")
        text = mine[0]
    if not text.isdigit() or int(text) < 1:
        raise SlurmkitError(f"Detected: {REJOIN_ENV}={text!r}. Requirement: the relaunch number node 0's agent "
                            f"starts a relaunched agent with (1, 2, ...). Fix: do not set {REJOIN_ENV} by hand.")
    r = channel.rejoin(node_rank, attempt)
    if r is None or r.relaunch != int(text):
        found = "none" if r is None else f"relaunch {r.relaunch}'s"
        raise ChannelError(f"relaunch {text} of node rank {node_rank}'s agent found {found} rejoin message",
                           "node 0 posts the rejoin message before it starts the relaunched agent",
                           "nothing to do: node 0 falls back to a spare or a requeue keeping the node")
    return r


# ------------------------------------------------------------------ the srun that starts it
def step_env(env: Mapping[str, str], node_rank: int, relaunch: int) -> dict[str, str]:
    """The environment of a relaunched agent's srun: node 0's, without what Slurm set for node
    0's own step and task, with the node rank and relaunch number of the new agent."""
    out = {k: v for k, v in env.items() if k not in _STEP_VARS and not k.startswith(_STEP_ONLY)}
    # What the batch script had: the job's node count and list (a step's would say one node).
    for job_var, var in (("SLURM_JOB_NUM_NODES", "SLURM_NNODES"), ("SLURM_JOB_NODELIST", "SLURM_NODELIST")):
        if job_var in env:
            out[var] = env[job_var]
    out["SLURMKIT_NODE_RANK"] = str(node_rank)
    out[REJOIN_ENV] = str(relaunch)
    return out


def log_dir(run_dir: str, node_rank: int) -> str:
    """Where the batch script put this node's agent log (submitit's folder or RUN_DIR/logs):
    the relaunched agent's goes beside it, so that ``slurmkit logs --agent`` finds the newest."""
    for d in (SUBMITIT_DIR, LOGS_DIR):
        if glob.glob(os.path.join(run_dir, d, f"*_node{node_rank}_log.out")):
            return os.path.join(run_dir, d)
    return os.path.join(run_dir, LOGS_DIR)


def srun_command(srun_prefix: Sequence[str], run_dir: str, node: str, output: str) -> list[str]:
    return [*srun_prefix, "--nodes=1", "--ntasks=1", f"--nodelist={node}", f"--output={output}",
            sys.executable, "-u", "-m", AGENT_MODULE, run_dir]


def shared_srun_command(srun_prefix: Sequence[str], run_dir: str, nodes: Sequence[str], output: str) -> list[str]:
    k = len(nodes)
    return [*srun_prefix, f"--nodes={k}", f"--ntasks={k}", "--ntasks-per-node=1", f"--nodelist={','.join(nodes)}",
            f"--output={output}", sys.executable, "-u", "-m", AGENT_MODULE, run_dir]


def shared_step_env(env: Mapping[str, str], agents: Sequence[tuple[str, int, int]], log_dir: str) -> dict[str, str]:
    """The environment of one srun step that relaunches several agents: as ``step_env``, but
    each agent finds its node rank in SLURMKIT_NODES and its relaunch number by its node's name,
    and writes its log where the batch script's agent of that node did (GROUP_LOG_ENV)."""
    out = step_env(env, agents[0][1], agents[0][2])
    del out["SLURMKIT_NODE_RANK"]
    out[REJOIN_ENV] = ",".join(f"{name}={n}" for name, _, n in agents)
    out[GROUP_LOG_ENV] = log_dir
    return out


class SrunStep:
    """A relaunched agent's srun, a child of node 0's agent."""

    def __init__(self, command: list[str], env: Mapping[str, str], output: str) -> None:
        self.command, self.log = command, output
        self.proc = subprocess.Popen(command, env=dict(env), stdin=subprocess.DEVNULL)

    def poll(self) -> int | None:
        return self.proc.poll()

    def stop(self, wait_s: float) -> None:
        try:
            self.proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            pass
        self.proc.terminate()  # srun passes SIGTERM on to the agent, which stops its ranks
        try:
            self.proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def srun_spawn(srun_prefix: Callable[[], Sequence[str]], run_dir: str, env: Mapping[str, str],
               restart_count: int) -> Spawn:
    """How node 0's agent starts a node's agent again: ``srun_prefix`` gives the batch script's
    srun (``srun --unbuffered`` and slurmkit.render.sbatch.srun_args of the run's job spec),
    worked out at the first relaunch only."""
    def spawn(node: str, node_rank: int, relaunch: int) -> Launched:
        output = os.path.join(log_dir(run_dir, node_rank),
                              f"%j_a{restart_count}r{relaunch}_node{node_rank}_log.out")
        command = srun_command(srun_prefix(), run_dir, node, output)
        log.warning("relaunching the agent of %s (node rank %d): %s", node, node_rank, " ".join(command))
        return SrunStep(command, step_env(env, node_rank, relaunch), output)

    return spawn


def srun_spawn_many(srun_prefix: Callable[[], Sequence[str]], run_dir: str, env: Mapping[str, str],
                    restart_count: int) -> SpawnMany:
    """How node 0's agent starts several agents again in one srun step of their nodes."""
    def spawn(agents: Sequence[tuple[str, int, int]]) -> Launched:
        first = min(nr for _, nr, _ in agents)
        where = log_dir(run_dir, first)
        output = os.path.join(where, f"%j_a{restart_count}r{max(n for _, _, n in agents)}_step{first}_%t_log.out")
        command = shared_srun_command(srun_prefix(), run_dir, [name for name, _, _ in agents], output)
        log.warning("relaunching the agents of %d nodes in one step: %s", len(agents), " ".join(command))
        return SrunStep(command, shared_step_env(env, agents, where), output)

    return spawn
