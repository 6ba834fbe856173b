"""The node agent: one per node, started by srun (or submitit's local executor).

It starts this node's ranks of one generation with a torchrun-compatible environment and their
pinning plan, tees each rank's output to its own log, watches them (lines, exits, heartbeats)
and stops them. Everything between generations (the state machine, node 0's decisions, the
agents' messages) is the supervisor's: slurmkit.supervise.loop over slurmkit.supervise.channel.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import TYPE_CHECKING

import torch.distributed as dist

from slurmkit import adapters, contract
from slurmkit.config import SlurmkitConfig, load_frozen
from slurmkit.health.clock import ClockTicker, injected_offset_s
from slurmkit.health.preflight import Peers, node_preflight
from slurmkit.health.result import Verdict
from slurmkit.launch.context import GROUP_LOG_ENV, NodeContext, group_log, node_context, redirect_output
from slurmkit.launch.fdlimit import raise_fd_limit, store_fds_needed
from slurmkit.launch import forkserver, stackdump, standby, tether
from slurmkit.launch.ranks import RankProcess, spawn_rank, stop_ranks, watch_rank
from slurmkit.launch.rendezvous import connect
from slurmkit.launch.steptimes import StepTimes
from slurmkit.layout import LayoutError, load_layout
from slurmkit.errors import SlurmkitError
from slurmkit.procexit import leave
from slurmkit.rundir import RunDirError, check_config_digest, check_run_dir
from slurmkit.runfiles import CONFIG_NAME, LOGS_DIR
from slurmkit.slurm.client import slurm_client
from slurmkit.supervise.channel import Channel, load_token
from slurmkit.supervise.ckpt_progress import CheckpointProgress, tier_readers
from slurmkit.failures.classes import FailureClass
from slurmkit.failures.classify import Evidence
from slurmkit.supervise.endwatch import EndWatch
from slurmkit.ledger.ledger import LEDGER_NAME, Ledger
from slurmkit.supervise.liveness import Beater
from slurmkit.supervise.loop import Supervisor, Where
from slurmkit.failures.programs import expects_heartbeats, is_reference_trainer
from slurmkit.launch.monitor import RankMonitor
from slurmkit.adapters.command import LIGHTNING
from slurmkit.launch.programwatch import ProgramWatch

if TYPE_CHECKING:
    from slurmkit.launch.adoption import Adopter
from slurmkit.supervise.relaunch import Relauncher, read_rejoin, srun_spawn, srun_spawn_many
from slurmkit.slurm.capabilities import read_run_dir_copy
from slurmkit.supervise.stepsended import STEPS_ENDED_ENV, StepsEnded
from slurmkit.supervise.slurmview import kill_wait_warning
from slurmkit.ledger.spool import SpoolReader
from slurmkit.supervise.stragglers import NodeWindow
from slurmkit.supervise.timeouts import beat_interval_s, failure_env
from slurmkit.train import flightrec
from slurmkit.train.heartbeat import LocalDirError, figures_of, node_local_dir, private_dir
from slurmkit.train.signals import STACK_FILE_ENV
from slurmkit.userapi import USER_TIER, write_marker

# ProcessGroupNCCL's flight-recorder FIFO is <value><rank>.pipe. torch >= 2.7 reads only the
# TORCH_FR_ name (seen with torch 2.11 on an H200: with the old name alone no FIFO was made and
# a hang left no dump); older releases read only the TORCH_NCCL_ one. Both are set.
NCCL_PIPE_ENV = "TORCH_FR_DEBUG_INFO_PIPE_FILE"
NCCL_PIPE_ENV_OLD = "TORCH_NCCL_DEBUG_INFO_PIPE_FILE"

log = logging.getLogger(__name__)
LEDGER_FLUSH_INTERVAL_S = 2.0  # an agent's ledger events are batched for at most this long
LEDGER_SAMPLES_PER_S = 10.0  # heartbeat samples of all nodes together (2,048 nodes: each every 205 s)
#: How long node 0's agent, leaving, lets the agents it relaunched end by themselves before it ends them.
RELAUNCHED_EXIT_WAIT_S = 10.0
KERNEL_LOG_WATCH_S = 5.0  # how often the kernel log is read while the ranks run (node-local, non-blocking)
ADOPT_FINISH_S = 120.0  # store.adopt: how long a node whose ranks completed waits for their last save to be adopted


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def _remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def rank_command(command: list[str]) -> list[str]:
    """`python` in job.command means this interpreter (the one the agent runs in)."""
    if command and command[0] in ("python", "python3"):
        return [sys.executable, *command[1:]]
    return list(command)


def safe_path_env(command: list[str]) -> dict[str, str]:
    """``PYTHONSAFEPATH=1`` (``python -P``, Python 3.11+) for ``python -m``/``-c`` commands: their
    working directory (the run directory, on a shared file system) is then not put first on
    ``sys.path``, so a ``torch.py`` or ``slurmkit/`` left there cannot shadow the real module.
    A script (``python train.py``) keeps its own directory on the path, where its sibling
    modules are. Nothing for other programs; a user's own setting stands."""
    argv = rank_command(command)
    python = bool(argv) and os.path.basename(argv[0]).startswith("python")
    return {"PYTHONSAFEPATH": "1"} if python and len(argv) > 1 and argv[1] in ("-m", "-c") else {}


class NodeAgent:
    """This node's ranks of one generation: start, watch, stop (the loop's ``Node``)."""

    def __init__(self, run_dir: str, cfg: SlurmkitConfig, ctx: NodeContext, env: Mapping[str, str],
                 ledger: Ledger, *, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep, peers: Peers | None = None) -> None:
        self.run_dir, self.cfg, self.ctx = run_dir, cfg, ctx
        self.env = dict(env)
        self.clock, self.sleep = clock, sleep
        self.ledger_path = os.path.join(run_dir, LEDGER_NAME)
        self.ledger = ledger
        # The layout frozen at submit: the ranks per node the batch script asked Slurm for.
        self.layout = load_layout(run_dir, cfg)
        self.ranks_per_node, self.train_nodes = self.layout.ranks_per_node, self.layout.train_nodes
        self.signal_kind: str | None = None  # "time_limit" | "preemption" once a warning came
        self.signal_at: float | None = None  # self.clock() when it came
        self.procs: list[RankProcess] = []
        self.monitor: RankMonitor | None = None
        # Warm standbys (slurmkit.launch.standby) by local rank: the next generation's ranks,
        # already imported; the clock time this generation's ranks started (when to prepare them).
        self.standbys: dict[int, standby.Standby] = {}
        # The fork server (slurmkit.launch.forkserver): one process per node that imported the
        # trainer and forks its ranks, every generation; standbys only where it cannot fork.
        self.forks: forkserver.ForkServer | None = None
        self._started_at: float | None = None
        self.step_times: StepTimes | None = None  # this generation's step-time samples (stragglers)
        self._last_sample = self.clock()
        self._kernel_log_at = self.clock()  # the pre-flight just read it
        # Heartbeats and rank 0's events stay on this node (/dev/shm): nothing on the shared
        # file system per step. The directory is this user's and this run's alone (0700).
        self.local_dir = private_dir(node_local_dir(run_dir, self.env))
        # torch creates its flight-recorder FIFO here but not the directory (GPU ranks).
        private_dir(os.path.join(self.local_dir, "nccl_pipe"))
        self._spools: set[str] = set()
        # Heartbeat samples in the ledger: node 0 at the configured interval, the others slower
        # as the job grows, so the shared ledger sees at most ~LEDGER_SAMPLES_PER_S appends/s.
        sample_s = cfg.supervisor.heartbeat_ledger_interval_s
        self.sample_interval_s = sample_s if ctx.node_rank == 0 else max(sample_s, ctx.num_nodes / LEDGER_SAMPLES_PER_S)
        # This node's pre-flight checks before each generation's ranks start (slurmkit.health).
        # ``peers``: how its clock and link checks reach the other agents (none: not checked).
        self.preflight = node_preflight(cfg, self.layout, run_dir, ctx.node_name, self.env, ledger, peers)
        # A third-party program's progress (rank 0's lines) and finished saves (its folder),
        # read where rank 0 runs (slurmkit.launch.programwatch); None for the reference trainer.
        self.program = ProgramWatch.for_job(cfg.job, run_dir)
        # store.adopt: the program's saves copied into the tiers and put back (launch/adoption.py);
        # made by agent_main, which has the agents' store.
        self.adopter: Adopter | None = None
        self._adopt_drained = False  # this generation's completed ranks' last save adopted (or given up)

    def _sink(self, monitor: RankMonitor) -> Callable[[int, str], None]:
        """Where a rank's output lines go: the monitor, and the program's adapter when it reads them."""
        program = self.program
        if program is None or not program.reads_lines:
            return monitor.on_line

        def sink(rank: int, line: str) -> None:
            monitor.on_line(rank, line)
            heard = program.on_line(rank, line)
            if heard is not None:  # its step lines time a program that never beats
                monitor.on_progress(rank, heard.step, saving=heard.saving)
        return sink

    def _plans(self) -> list[object] | None:
        if not self.cfg.topology.enabled:
            return None
        from slurmkit.topology import discover, plan_node

        return list(plan_node(discover(), self.ranks_per_node, self.cfg.topology, env=self.env))

    def rank_env(self, gen: int, local_rank: int, slot: int, port: int,
                 master_addr: str | None = None) -> dict[str, str]:
        who = contract.rank_identity(slot, local_rank, ranks_per_node=self.ranks_per_node,
                                     train_nodes=self.train_nodes,
                                     master_addr=master_addr or self.ctx.master_addr, master_port=port)
        rank = who.rank
        env = dict(self.env)
        env.update(safe_path_env(self.cfg.job.command))
        # The batch script exports these on Slurm; local mode has no script, so set them here.
        env.update(self.cfg.cluster.env)
        env.update(self.cfg.job.env)
        env.update(failure_env(self.cfg, self.run_dir, env))
        # torchrun's variables, and Slurm's task variables for the rank's place in the training
        # world instead of the agent's one-task step (contract.RankIdentity.slurm_env).
        env.update(who.full_env())
        env.update(contract.rank_cpus_env(self.env, self.ranks_per_node))
        env.update({
            "SLURMKIT_RUN_DIR": self.run_dir,
            "SLURMKIT_CONFIG": os.path.join(self.run_dir, CONFIG_NAME),
            "SLURMKIT_LEDGER": self.ledger_path,
            "SLURMKIT_GENERATION": str(gen), "SLURMKIT_NODE": self.ctx.node_name,
            "SLURMKIT_ATTEMPT": self.ctx.attempt,
            "SLURMKIT_HEARTBEAT_FILE": os.path.join(self.local_dir, "heartbeat", f"rank{rank}.json"),
            "SLURMKIT_EVENTS_FILE": os.path.join(self.local_dir, "events", f"{self.ctx.attempt}.rank{rank}.jsonl"),
            contract.PROGRAM: self.cfg.job.program,
            STACK_FILE_ENV: self._stack_file(rank),
            flightrec.PIPE_ENV: self._fr_stem(gen, rank) + ".pipe",
            flightrec.FILE_ENV: self._fr_stem(gen, rank) + ".json",
            "PYTHONUNBUFFERED": "1",
        })
        # ProcessGroupNCCL's flight-recorder FIFO (slurmkit.launch.stackdump), node-local; a
        # user's own setting stands.
        stem = env.get(NCCL_PIPE_ENV) or env.get(NCCL_PIPE_ENV_OLD) or os.path.join(self.local_dir, "nccl_pipe", "rank_")
        env.setdefault(NCCL_PIPE_ENV, stem)
        env.setdefault(NCCL_PIPE_ENV_OLD, stem)
        return env

    def _nccl_stems(self) -> tuple[str, list[str]]:
        """(FIFO stem, dump stems) of the flight recorder, as rank_env gives them to the ranks,
        or where the program sets the dump file itself over ours (torchtitan: its own folder;
        slurmkit.adapters.trace_stems): the agent waits on the dumps where they are written."""
        env = {**self.env, **self.cfg.cluster.env, **self.cfg.job.env}
        env.update(failure_env(self.cfg, self.run_dir, env))
        command = [str(a) for a in self.cfg.job.command]
        adapter = adapters.resolve(self.cfg.job.program, command, reference_trainer=is_reference_trainer(command))
        ours = env.get("TORCH_FR_DUMP_TEMP_FILE") or env.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "")
        return (env.get(NCCL_PIPE_ENV) or env.get(NCCL_PIPE_ENV_OLD) or os.path.join(self.local_dir, "nccl_pipe", "rank_"),
                adapters.trace_stems(adapter, command, self.run_dir) or ([ours] if ours else []))

    def _stack_file(self, rank: int) -> str:
        return os.path.join(self.local_dir, "stacks", f"rank{rank}.txt")

    def _fr_stem(self, gen: int, rank: int) -> str:
        """The reference trainer's own flight-recorder FIFO and trace (slurmkit.train.flightrec),
        node-local, one per rank and generation."""
        return os.path.join(self.local_dir, "flight_recorder", f"g{gen}.rank{rank}")

    def capture_stacks(self, gen: int) -> list[Evidence]:
        """Before a hung generation is killed: its live ranks' stacks (slurmkit.launch.stackdump)
        into this node's ledger event, and this node's verdicts (at most two) for node 0."""
        live = [p for p in self.procs if p.poll() is None]
        if not live or self.monitor is None:
            return []
        pipe, dump = self._nccl_stems()
        targets = [stackdump.RankTarget(p.rank, p.pid, self._stack_file(p.rank), f"{pipe}{p.rank}.pipe",
                                        self._fr_stem(gen, p.rank) + ".pipe", self._fr_stem(gen, p.rank) + ".json")
                   for p in live]
        triggered = stackdump.trigger_nccl_dumps(targets)
        asked = stackdump.trigger_trace_dumps(targets)  # before the stacks: a stopped rank is continued there
        stacks = stackdump.capture(targets, trainer=is_reference_trainer(self.cfg.job.command),
                                   pyspy=stackdump.find_pyspy(self.env), proc_state=self.monitor.state_of)
        traces = stackdump.read_traces(asked)
        if triggered and dump:
            written = stackdump.wait_nccl_dumps(triggered, dump)
            if written:
                log.warning("flight-recorder dumps of generation %d: %s", gen, ", ".join(written))
        return stackdump.report(stacks, node=self.ctx.node_name, generation=gen, append=self.ledger.append,
                                traces=traces)

    # ------------------------------------------------------------------ one generation
    def start(self, gen: int, slot: int, port: int, master_addr: str) -> None:
        sup = self.cfg.supervisor
        monitor = RankMonitor(self.ctx.node_name, gen, heartbeat_timeout_s=sup.heartbeat_timeout_s,
                              startup_timeout_s=sup.startup_timeout_s,
                              require_heartbeat=expects_heartbeats(sup.require_heartbeat, self.cfg.job.command))
        self.monitor = monitor
        if self.program is not None:
            self.program.begin_generation()
        self.step_times = StepTimes(self.ctx.node_name, gen, window_samples=self.cfg.health.straggler_window_samples)
        if self.signal_kind is not None:
            # The allocation is ending (the warning or a SIGTERM came before this generation):
            # ranks started now would get the signal while still starting up, before any
            # handler, and die of it; nor could they finish. None start: node 0 requeues (time
            # limit) or leaves (policy.decide with warned), resuming from the newest recovery point.
            cls = FailureClass.TIME_LIMIT if self.signal_kind == "time_limit" else FailureClass.PREEMPTION
            monitor.report(Evidence(time.time(), self.ctx.node_name, -1, "agent", cls,
                                    f"{self.signal_kind} signal came before generation {gen}: no ranks started"))
            self.procs = []
            return
        failed = self.preflight.run(gen, slot) if self.preflight is not None else None
        if failed is not None:  # a bad node: no ranks here; the supervisor replaces or excludes it
            monitor.report(failed)
            self.procs = []
            return
        if self.adopter is not None:  # before any rank reads the program's folder
            self._adopt_drained = False
            self.adopter.put_back(gen, slot)
        plans = self._plans()
        argv = rank_command(self.cfg.job.command)
        procs, warm = [], []
        for lr in range(self.ranks_per_node):
            prefix, env = self._launch(gen, lr, slot, port, master_addr, plans)
            rank = int(env["RANK"])
            # A beat left by an earlier run at this path (or by a dead agent) must not look
            # like this rank's progress to anyone reading the file before the rank writes it.
            _remove_quietly(env["SLURMKIT_HEARTBEAT_FILE"])
            path = os.path.join(self.run_dir, LOGS_DIR, f"rank{rank}.log")
            p = self._fork(prefix, env, argv, rank, lr, path, monitor, plans)
            if p is None:
                p = self._adopt(lr, prefix, env, argv, rank, path, monitor)
            warm.append(p is not None)
            if p is None:
                p = spawn_rank(self._tethered([*prefix, *argv]), env, rank=rank, local_rank=lr, log_path=path,
                               cwd=self.run_dir, sink=self._sink(monitor), on_exit=monitor.on_exit)
            monitor.add_rank(rank, p.pid, env["SLURMKIT_HEARTBEAT_FILE"])
            if env["SLURMKIT_EVENTS_FILE"] not in self._spools:  # this node writes them to the ledger
                self._spools.add(env["SLURMKIT_EVENTS_FILE"])
                self.ledger.attach(SpoolReader(env["SLURMKIT_EVENTS_FILE"]))
            procs.append(p)
        self.procs = procs
        self._last_sample = self._started_at = self.clock()
        self.ledger.append("ranks_started", generation=gen, node=self.ctx.node_name, slot=slot,
                           ranks=[p.rank for p in procs], pids=[p.pid for p in procs], warm=warm,
                           heartbeat_dir=self.local_dir)
        if self.signal_kind is not None:  # a warning arrived while the ranks were starting
            for p in self.procs:
                p.notify(signal.SIGUSR1 if self.signal_kind == "time_limit" else signal.SIGTERM)

    def _launch(self, gen: int, lr: int, slot: int, port: int, master_addr: str | None,
                plans: list[object] | None) -> tuple[list[str], dict[str, str]]:
        """(what goes in front of the program: the pin wrapper or nothing, the environment) of
        local rank ``lr`` in generation ``gen`` at ``slot``."""
        env = self.rank_env(gen, lr, slot, port, master_addr)
        before = dict(env)
        prefix: list[str] = []
        if plans is not None:
            from slurmkit.topology import pin_command, rank_env

            env.update(rank_env(plans[lr], plans, env, self.cfg.topology))  # type: ignore[arg-type]
            prefix = pin_command(plans[lr], [], verify=self.cfg.topology.verify,  # type: ignore[arg-type]
                                 method=self.cfg.topology.apply_method)
        env.update(contract.device_env(lr, self.layout, before, env, plans[lr] if plans else None))
        return prefix, env

    @staticmethod
    def _tethered(cmd: list[str]) -> list[str]:
        """``cmd`` behind slurmkit.launch.tether: the rank dies with this agent, even by SIGKILL.
        The kernel ties a child to the thread that forked it: only the main thread, which lives
        as long as the agent, starts ranks tied (any other: untied, as before, and said)."""
        if threading.current_thread() is not threading.main_thread():
            log.warning("ranks started outside the agent's main thread: not tied to the agent")
            return cmd
        return tether.command(os.getpid(), cmd)

    # ------------------------------------------------------------------ warm standbys
    def _standby_wanted(self) -> bool:
        return (self.cfg.supervisor.warm_standby and self.signal_kind is None
                and standby.trainer_args(rank_command(self.cfg.job.command)) is not None)

    def warm_up(self, gen: int = 0, slot: int | None = None, plans: list[object] | None = None) -> None:
        """At the agent's start: the fork server (``supervisor.fork_ranks``), which imports while
        the agents meet and forks every generation's ranks. Else, or once it said it cannot
        fork, a standby for every local rank that has none (slurmkit.launch.standby), with this
        node's environment for ``gen`` (its identity is handed over when it is used): at the
        start, and once a generation has trained ``supervisor.warm_standby_after_s``, for the
        next one."""
        if not self._standby_wanted():
            return
        if slot is None:
            slot = min(self.ctx.node_rank, self.train_nodes - 1)
        if plans is None:
            plans = self._plans()
        if self.forks is None and gen == 0 and self.cfg.supervisor.fork_ranks:
            _, env = self._launch(gen, 0, slot, 0, None, plans)
            if threading.current_thread() is threading.main_thread():  # tied to the agent's main thread
                try:
                    late = [m for m in standby.LATE_IMPORTS if m != "s3fs" or self.cfg.store.object_uri]
                    self.forks = forkserver.ForkServer.start(env, cwd=self.run_dir, parent=os.getpid(),
                                                             late_imports=late)
                    return
                except OSError as exc:
                    log.warning("no fork server: %s; warm standbys instead", exc)
        if self._forking():
            return
        for lr in range(self.ranks_per_node):
            if lr in self.standbys:
                continue
            prefix, env = self._launch(gen, lr, slot, 0, None, plans)
            parent = os.getpid() if threading.current_thread() is threading.main_thread() else None
            try:
                self.standbys[lr] = standby.spawn(prefix, env, local_rank=lr, cwd=self.run_dir, parent=parent)
            except OSError as exc:  # no standby is no failure: the rank starts cold
                log.warning("no warm standby for local rank %d: %s", lr, exc)
                return

    def _forking(self) -> bool:
        """Whether the fork server is there and has not said it cannot fork (no wait)."""
        return self.forks is not None and self.forks.refused() is None

    def _fork(self, prefix: list[str], env: dict[str, str], argv: list[str], rank: int, lr: int, path: str,
              monitor: RankMonitor, plans: list[object] | None) -> RankProcess | None:
        """Rank ``rank`` forked by the fork server; None where it cannot be (the server is not
        there, said it cannot fork, the rank runs another program or needs another environment
        or numactl): then a standby or a cold start."""
        args = standby.trainer_args(argv)
        if self.forks is None or args is None:
            return None
        topo = self.cfg.topology
        plan_json = plans[lr].to_json() if plans else None  # type: ignore[attr-defined]
        why = self.forks.why_not(min(self.cfg.supervisor.startup_timeout_s, 120.0))
        if why is None and prefix and topo.apply_method == "numactl":
            why = "topology.apply_method=numactl (the fork server binds memory with the syscall)"
        if why is None:
            try:
                proc = self.forks.fork(env, args, plan_json=plan_json, verify=topo.verify,
                                       timeout_s=min(self.cfg.supervisor.startup_timeout_s, 120.0))
            except forkserver.ForkServerError as exc:
                why = str(exc)
            else:
                return watch_rank(proc, rank=rank, local_rank=lr, log_path=path, sink=self._sink(monitor),  # type: ignore[arg-type]
                                  on_exit=monitor.on_exit)
        log.info("rank %d is not forked: %s", rank, why)
        if self.forks.refused() is not None:
            self._drop_forks()
        return None

    def _drop_forks(self) -> None:
        if self.forks is not None:
            self.forks.stop()
            self.forks = None

    def _adopt(self, lr: int, prefix: list[str], env: dict[str, str], argv: list[str], rank: int,
               path: str, monitor: RankMonitor) -> RankProcess | None:
        """Local rank ``lr``'s standby made this generation's rank ``rank``; None if there is
        none or it cannot be (then it is discarded and the rank starts cold)."""
        sb = self.standbys.pop(lr, None)
        args = standby.trainer_args(argv)
        if sb is None or args is None:
            return None
        reason = standby.why_not(sb, prefix, env, args)
        if reason is None and not standby.hand_over(sb, env, args):
            reason = "it was gone when handed its rank"
        if reason is not None:
            log.info("rank %d starts cold: its standby (pid %d) %s", rank, sb.pid, reason)
            sb.discard()
            return None
        return watch_rank(sb.proc, rank=rank, local_rank=lr, log_path=path, sink=self._sink(monitor),
                          on_exit=monitor.on_exit)

    def discard_standbys(self) -> None:
        """End the standbys and the fork server (the agent is leaving, or no next generation)."""
        for sb in self.standbys.values():
            sb.discard()
        self.standbys.clear()
        self._drop_forks()

    def _keep_standbys(self, gen: int, beats: Mapping[int, object]) -> None:
        if not self.cfg.supervisor.warm_standby:
            return
        if self.signal_kind is not None:  # no next generation in this allocation
            if self.standbys or self.forks is not None:
                self.discard_standbys()
            return
        if self._forking():
            return
        if (len(self.standbys) < self.ranks_per_node and self._started_at is not None
                and self.monitor is not None and self.monitor.triggered is None and self.procs
                and len(beats) >= len(self.procs)
                and self.clock() - self._started_at >= self.cfg.supervisor.warm_standby_after_s):
            self.warm_up(gen + 1, slot=self.procs[0].rank // self.ranks_per_node)

    def poll(self, gen: int) -> Evidence | None:
        """Look at the ranks once; the evidence that triggered a failure here, if any."""
        if self.monitor is None:
            return None
        beats = self.monitor.poll()
        if self.adopter is not None and not self._adopt_drained and self.procs \
                and all(p.poll() == 0 for p in self.procs):
            # The program completed here: its last save reaches the tiers before this node says
            # so (the agents leave together right after; a scratch folder may not outlive the job).
            self._adopt_drained = True
            self.adopter.finish(ADOPT_FINISH_S)
        self._keep_standbys(gen, beats)
        if self.step_times is not None:
            self.step_times.observe(beats)
        self._check_warning_budget(gen)
        self._watch_kernel_log(gen)
        holds_rank0 = any(p.rank == 0 for p in self.procs)
        if self.program is not None and holds_rank0:
            if not (self.program.adapter == LIGHTNING and 0 in beats):
                # (a Lightning rank 0 that beats runs slurmkit's callback: it reports its saves)
                self._record_program_checkpoints(gen)
            resumed = self.program.generation_start()
            if resumed is not None:  # its first step line: the program trains (from its newest save)
                self.ledger.append("train_started", step=resumed, generation=gen, node=self.ctx.node_name,
                                   by="adapter:" + self.program.adapter)
        learned = self.program.sample() if self.program is not None and holds_rank0 else {}
        if self.clock() - self._last_sample >= self.sample_interval_s and (beats or "step" in learned):
            self._last_sample = self.clock()
            steps = {str(r): b.get("step") for r, b in beats.items()}
            # rank 0's figures and total (slurmkit.userapi.report_metrics, set_total_steps) ride
            # in its node's sample: status and the report read them from the ledger. A program
            # that reports none may still print them (its adapter read them from its lines).
            figures, total = figures_of(beats[0]) if 0 in beats else ({}, None)
            if "0" not in steps and "step" in learned:
                steps["0"] = learned["step"]
            figures = figures or learned.get("metrics", {})
            total = total if total is not None else learned.get("total_steps")
            extra: dict[str, object] = {"metrics": figures} if figures else {}
            if total is not None:
                extra["total_steps"] = total
            self.ledger.append("heartbeat", generation=gen, node=self.ctx.node_name, steps=steps, **extra)
        return self.monitor.triggered

    def _record_program_checkpoints(self, gen: int) -> None:
        """The program's saves finished since the last look, recorded as its own
        ``userapi.report_checkpoint`` would: the progress marker and a ``ckpt_saved`` event."""
        assert self.program is not None
        for step, path in self.program.new_checkpoints():
            record = {"step": step, "path": path, "rank": 0, "generation": gen, "node": self.ctx.node_name,
                      "attempt": self.env.get(contract.ATTEMPT, ""), "pid": os.getpid(), "time": round(time.time(), 6),
                      "by": "adapter:" + self.program.adapter}
            try:
                write_marker(self.run_dir, record)
            except OSError as exc:
                log.warning("cannot record the program's checkpoint of step %d: %s", step, exc)
                continue
            self.ledger.append("ckpt_saved", step=step, tier=USER_TIER, rank=0, uri=path,
                               node=self.ctx.node_name, generation=gen)
            if self.adopter is not None:
                self.adopter.saved(step, path)

    def _watch_kernel_log(self, gen: int) -> None:
        """Every KERNEL_LOG_WATCH_S while the ranks run, the pre-flight's kernel-log check again
        (its cursor: only what is new; one non-blocking read of /dev/kmsg or the site's log): an
        Xid of health.bad_xids or an uncorrected memory error logged under a running rank ends
        the generation as a gpu_fault of this node, which leaves on the first one (a spare, or
        a requeue without it), the line in the evidence. A rank's own output is scanned for
        the same lines (slurmkit.failures.classify); the kernel log also holds the ones no rank
        printed (seen in production: the driver logs the Xid, the rank only hangs)."""
        if (self.preflight is None or self.monitor is None or self.monitor.triggered is not None
                or self.clock() - self._kernel_log_at < KERNEL_LOG_WATCH_S):
            return
        self._kernel_log_at = self.clock()
        result = self.preflight.kernel_log_now()
        if result is not None and result.verdict == Verdict.BAD_NODE:
            self.monitor.report(Evidence(time.time(), self.ctx.node_name, -1, "kernel_log", FailureClass.GPU_FAULT,
                                         f"generation {gen}: {result.message}"))

    def _check_warning_budget(self, gen: int) -> None:
        """Ranks still running ``warning_budget_s`` after the time-limit warning end the
        generation here (a program that ignores SIGUSR1, a save that cannot finish in time)."""
        if (self.signal_kind != "time_limit" or self.signal_at is None or self.monitor is None
                or self.monitor.triggered is not None):
            return
        late = self.clock() - self.signal_at
        budget = warning_budget_s(self.cfg.job.signal_lead_s)
        if late > budget and any(p.poll() is None for p in self.procs):
            self.monitor.report(Evidence(
                time.time(), self.ctx.node_name, -1, "agent", FailureClass.TIME_LIMIT,
                f"ranks of generation {gen} still running {late:.0f} s after the time-limit warning "
                f"(budget {budget:.0f} s of job.signal_lead_s={self.cfg.job.signal_lead_s}): stopped "
                "so that the job requeues before its time limit"))

    def exit_codes(self) -> list[int | None]:
        return [p.poll() for p in self.procs]

    def step_window(self) -> NodeWindow | None:
        """This node's next step-time window, once its ranks have beaten enough new steps."""
        return self.step_times.take() if self.step_times is not None else None

    def stop(self) -> list[Evidence]:
        # The generation is lost already: kill at once rather than let ranks that trap SIGTERM
        # try to checkpoint from inside a broken collective.
        stop_ranks(self.procs, grace_s=0.0, sleep=self.sleep, clock=self.clock)
        self._sample_last_step()  # the step the failure reached, for the report's steps lost
        self.ledger.flush()  # the ranks' last events are in the file before node 0 decides
        return list(self.monitor.evidence) if self.monitor is not None else []

    def kill_leftovers(self) -> None:
        """SIGKILL any rank still running (the agent is leaving: a rank left behind would hold
        its GPU and its peers' collectives). Ranks that have exited are left alone."""
        self.discard_standbys()
        live = [p for p in self.procs if p.poll() is None]
        if live:
            log.warning("agent leaving: killing %d rank(s) still running", len(live))
            stop_ranks(live, grace_s=0.0, sleep=self.sleep, clock=self.clock)

    def remove_local_files(self) -> None:
        """The heartbeats and event spools of this node's ranks (node memory, not disk)."""
        paths = list(self._spools) + [os.path.join(self.local_dir, "heartbeat", f"rank{p.rank}.json")
                                      for p in self.procs] + [self._stack_file(p.rank) for p in self.procs]
        for path in paths:
            _remove_quietly(path)

    def join_output(self) -> None:
        for p in self.procs:
            p.reader.join(timeout=5)
        self._sample_last_step()  # the step the program ended at

    def _sample_last_step(self) -> None:
        """A user program's newest step once its generation has ended, which the last periodic
        sample may not hold (the report's steps lost): what rank 0 beat last (slurmkit.userapi,
        Lightning's callback), else the step it printed last (read through its lines)."""
        if self.monitor is None or not any(p.rank == 0 for p in self.procs):
            return
        step = None if is_reference_trainer(self.cfg.job.command) else self.monitor.final_step(0)
        if step is None and self.program is not None:
            step = self.program.step
        if step is not None:
            self.ledger.append("heartbeat", generation=self.monitor.generation, node=self.ctx.node_name,
                               steps={"0": step})

    # ------------------------------------------------------------------ signals
    def install_signal_handlers(self) -> None:
        def handler(signum: int, _frame: object) -> None:
            kind = "time_limit" if signum == signal.SIGUSR1 else "preemption"
            if self.signal_kind is None:
                self.signal_kind, self.signal_at = kind, self.clock()
            for p in self.procs:
                p.notify(signum)

        signal.signal(signal.SIGUSR1, handler)
        signal.signal(signal.SIGTERM, handler)


def warning_budget_s(lead_s: float) -> float:
    """How long a node's ranks may take to leave after the time-limit warning before its agent
    ends the generation itself: three quarters of the lead, and at most 30 s short of it (what
    is left is for stopping the ranks, node 0's decision and the requeue). A rank that ignores
    the warning would otherwise run into the time limit, where Slurm ends the job TIMEOUT and
    never requeues it: the run would stop for good. Ended here, node 0 requeues the job (a
    time-limit requeue, not counted) and it resumes from its newest recovery point."""
    return max(0.75 * lead_s, lead_s - 30.0)


def start_alive_thread(ctx: NodeContext, channel: Channel, port: int, interval_s: float) -> Beater:
    """This agent's beats (slurmkit.supervise.liveness.Beater), on their own connection."""
    def connect() -> dist.TCPStore:
        return dist.TCPStore(ctx.master_addr, port, ctx.num_nodes, False, timeout=timedelta(seconds=30),
                             use_libuv=True)

    return Beater(lambda store, tick: channel.beat(ctx.node_rank, tick, store), connect,
                  interval_s=interval_s).start()


def make_adopter(cfg: SlurmkitConfig, ctx: NodeContext, node: NodeAgent, channel: Channel, port: int,
                 env: Mapping[str, str]) -> Adopter | None:
    """The adoption of the program's saves (``store.adopt``), on its own connection; None
    when off, or (said in the ledger) where the program's saves cannot be adopted."""
    if not cfg.store.adopt or node.program is None:
        if cfg.store.adopt and not is_reference_trainer(cfg.job.command):
            _adopt_warning(node, "store.adopt=true, but slurmkit does not know where this program saves "
                                 "(set job.program=torchtitan or job.checkpoint_glob)")
        return None
    from slurmkit.launch.adoption import Adopter, step_namer  # (fsspec and the store: only when on)

    program = node.program
    namer = step_namer(program.adapter, program.glob)
    if namer is None or len(program.folders) != 1 or not (cfg.store.lustre_uri or cfg.store.object_uri):
        _adopt_warning(node, "store.adopt=true needs DCP saves in one folder (job.program=torchtitan, or "
                             "job.checkpoint_glob ending in {step}/.metadata) and a shared or object tier "
                             "(store.lustre_uri, store.object_uri): this job's saves are not adopted")
        return None

    def connect() -> Channel:
        return channel.on(dist.TCPStore(ctx.master_addr, port, ctx.num_nodes, False,
                                        timeout=timedelta(seconds=30), use_libuv=True))

    return Adopter(cfg.store, {**env, "SLURMKIT_RUN_DIR": node.run_dir}, node=ctx.node_name,
                   node_rank=ctx.node_rank, nodes=ctx.num_nodes, ranks_per_node=node.ranks_per_node,
                   train_nodes=node.train_nodes,
                   adapter=program.adapter, folder=program.folders[0], step_name=namer, glob=program.glob,
                   connect=connect, append=node.ledger.append).start()


def _adopt_warning(node: NodeAgent, message: str) -> None:
    if node.ctx.node_rank == 0:
        log.warning("%s", message)
        node.ledger.append("config_warning", message=message)


def end_watch(ctx: NodeContext, channel: Channel, port: int) -> EndWatch:
    """This agent's wait for each generation's end (slurmkit.supervise.endwatch), on its own
    connection, made when the first generation is armed."""
    return EndWatch(lambda: channel.on(dist.TCPStore(ctx.master_addr, port, ctx.num_nodes, False,
                                                     timeout=timedelta(seconds=30), use_libuv=True)))


def peer_checks(ctx: NodeContext, channel: Channel, port: int, cfg: SlurmkitConfig, train_nodes: int,
                env: Mapping[str, str]) -> Peers:
    """How this agent's clock and link checks reach the others (each check connects on first use);
    node 0 also starts posting its clock ticks (slurmkit.health.clock) when the job has peers."""
    def connect() -> Channel:
        return channel.on(dist.TCPStore(ctx.master_addr, port, ctx.num_nodes, False,
                                        timeout=timedelta(seconds=30), use_libuv=True))

    if ctx.node_rank == 0 and ctx.num_nodes > 1 and cfg.health.enabled and cfg.health.max_clock_offset_s > 0:
        shift = injected_offset_s(env, ctx.node_name)  # a test hook (docs/health.md "Pre-flight")
        ClockTicker(connect, now=lambda: time.time() + shift).start()
    return Peers(connect, ctx.node_rank, ctx.num_nodes, train_nodes)


def own_address(master_addr: str, port: int) -> str:
    """This host's address on the route to node 0: how the other nodes reach it too (a
    connected UDP socket sends nothing; it only picks the interface)."""
    try:
        family = socket.getaddrinfo(master_addr, port, type=socket.SOCK_DGRAM)[0][0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((master_addr, port))
            return str(s.getsockname()[0])
    except OSError:
        return socket.gethostname()


def batch_srun_prefix(cfg: SlurmkitConfig, run_dir: str, env: Mapping[str, str]) -> list[str]:
    """The srun (and its arguments) with which the batch script starts every agent
    (slurmkit.render.sbatch.launch_agents), from the run's frozen config and layout: a relaunched
    agent's step is started the same way, in this attempt's named container when there is one."""
    from slurmkit.render.jobspec import build_jobspec
    from slurmkit.render.sbatch import container_name, srun_args
    from slurmkit.topology import srun_binding_args

    spec = build_jobspec(cfg, run_dir, list(srun_binding_args(cfg.topology)), layout=load_layout(run_dir, cfg))
    named = [f"--container-name={container_name(env)}"] if spec.container_image else []
    return ["srun", "--unbuffered", *srun_args(spec), *named]


def settle_heap() -> int:
    """Take what start-up built (torch and its imports, the config, the N nodes' tables) out of
    the cyclic collector's reach; returns how many objects it holds back.

    Every full collection walks every tracked object: with torch imported that is about 200,000
    objects and 90 ms of CPU (measured here), paid by whichever thread allocates at the wrong
    moment: in an agent, often the one stopping its ranks or reading node 0's decision, since
    the failure path allocates. Objects made after this are collected as before; the frozen
    start-up heap is never garbage (it lives as long as the agent). Forked rank processes also
    share its pages longer (the collector no longer writes to them)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def refuse_start(ledger: Ledger, exc: SlurmkitError) -> int:
    """An agent that cannot start on this node (no private node-local directory can be made, the
    run directory's layout.json is damaged): what a new allocation would meet again. It says so
    in its log and, as an ``end`` event, in the ledger, and asks for no requeue (93)."""
    log.error("%s", exc)
    ledger.append("end", status="failed", exit_code=contract.EXIT_NO_REQUEUE, reason=str(exc))
    ledger.close()
    return contract.EXIT_NO_REQUEUE


def agent_main(run_dir: str, env: Mapping[str, str] | None = None) -> int:
    """Entry point on every node (submitit callable and `python -m slurmkit.launch RUN_DIR`)."""
    env = dict(os.environ) if env is None else dict(env)
    if env.get(GROUP_LOG_ENV) and not env.get("SLURMKIT_NODE_RANK"):
        # a step of several nodes: each agent's log where a step of one would put it
        own_log = group_log(env, node_context(env).node_rank) or ""
        try:
            redirect_output(own_log)
        except OSError as exc:  # a link planted in the run directory, a full disk: the step's log
            print(f"slurmkit agent: Detected: cannot write {own_log} ({exc}). Requirement: the run directory's "
                  "logs are plain files only this user writes. Fix: check the run directory's owner and "
                  "permissions (slurmkit refuses links there); this agent logs to its step's file instead.",
                  file=sys.stderr, flush=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s agent %(levelname)s %(message)s")
    try:  # before anything is read from it: the run directory decides what this job runs
        check_run_dir(run_dir)
        if env.get(contract.CONFIG_SHA256):
            check_config_digest(run_dir, env[contract.CONFIG_SHA256])
    except RunDirError as exc:
        log.error("%s", exc)
        return contract.EXIT_NO_REQUEUE  # a new allocation would find the same directory
    cfg = load_frozen(os.path.join(run_dir, CONFIG_NAME))
    ctx = node_context(env)
    store = connect(ctx, run_dir)
    channel = Channel(store, ctx.attempt, load_token(run_dir, create=ctx.node_rank == 0), ctx.nodes)
    try:  # a relaunched agent: where it rejoins, checked before its first beat (node 0 waits for it)
        rejoin = read_rejoin(channel, ctx.node_rank, ctx.attempt, env, ctx.node_name)
    except SlurmkitError as exc:
        log.error("%s", exc)
        return 1
    ledger = Ledger(os.path.join(run_dir, LEDGER_NAME), source=f"agent:{ctx.node_name}",
                    flush_interval_s=LEDGER_FLUSH_INTERVAL_S)
    if ctx.node_rank == 0:  # the store keeps a few sockets per agent open: raise the limit first
        fd_warning = raise_fd_limit(store_fds_needed(ctx.num_nodes))
        if fd_warning:
            log.warning("%s", fd_warning)
            ledger.append("config_warning", message=fd_warning)
    try:
        peers = peer_checks(ctx, channel, store.port, cfg, load_layout(run_dir, cfg).train_nodes, env)
        node = NodeAgent(run_dir, cfg, ctx, env, ledger, peers=peers)
    except (LocalDirError, LayoutError) as exc:
        return refuse_start(ledger, exc)
    node.install_signal_handlers()
    node.adopter = make_adopter(cfg, ctx, node, channel, store.port, env)
    node.warm_up()  # generation 0's ranks import while the agents meet
    beater = start_alive_thread(ctx, channel, store.port,
                                beat_interval_s(ctx.num_nodes, cfg.supervisor.poll_interval_s))
    progress = CheckpointProgress(tier_readers(cfg.store, {**env, "SLURMKIT_RUN_DIR": run_dir},
                                               ctx.node_name)).start()
    # written at submit; only node 0 reads accounting (sacct), so only node 0 reads the copy
    caps = read_run_dir_copy(run_dir) if ctx.executor == "slurm" and ctx.node_rank == 0 else None
    slurm = (slurm_client(env, json_accounting=caps is not None and caps.json_accounting,
                          failed_node_field=caps is not None and bool(caps.failed_node_field))
             if ctx.executor == "slurm" else None)
    if ctx.node_rank == 0 and slurm is not None:
        warning = kill_wait_warning(cfg.cluster.kill_wait_s, slurm)
        if warning:
            log.warning(warning)
            ledger.append("config_warning", message=warning)
    where = Where(node_rank=ctx.node_rank, nodes=ctx.nodes, attempt=ctx.attempt, job_id=ctx.job_id,
                  executor=ctx.executor, master_addr=ctx.master_addr, restart_count=ctx.restart_count,
                  addr=ctx.master_addr if ctx.node_rank == 0 else own_address(ctx.master_addr, store.port))
    sup = Supervisor(cfg, where, channel, node, ledger, train_nodes=node.train_nodes, run_dir=run_dir, env=env,
                     slurm=slurm, ckpt_step=progress.latest, ckpt_seen=progress.peek,
                     free_port=free_port, end_watch=end_watch(ctx, channel, store.port), beater=beater)
    if rejoin is not None:
        sup.rejoin(rejoin)
    if ctx.node_rank == 0 and env.get(STEPS_ENDED_ENV):  # the batch script's word on the agents' steps
        sup.steps_ended = StepsEnded(env[STEPS_ENDED_ENV], len(ctx.nodes))
    if ctx.node_rank == 0 and slurm is not None and cfg.supervisor.agent_relaunches > 0:
        sup.relauncher = Relauncher(
            srun_spawn(lambda: batch_srun_prefix(cfg, run_dir, env), run_dir, env, ctx.restart_count),
            limit=cfg.supervisor.agent_relaunches, first_beat_s=cfg.supervisor.startup_timeout_s,
            spawn_many=srun_spawn_many(lambda: batch_srun_prefix(cfg, run_dir, env), run_dir, env, ctx.restart_count))
    log.info("start-up heap settled: %d objects held back from the cyclic collector", settle_heap())
    try:
        # On an unexpected exception its ranks are stopped (never orphaned) and node 0 hears
        # of it at once (agent_error), instead of waiting for this agent's beats to go silent.
        return sup.run_or_report()
    finally:
        node.kill_leftovers()  # whatever ended the agent, no rank outlives it
        if sup.relauncher is not None:  # nor an agent it relaunched (each has seen the end by now)
            sup.relauncher.stop_all(RELAUNCHED_EXIT_WAIT_S)
        ledger.close()  # what is held reaches the file (retried) before the agent leaves
        node.remove_local_files()


def submitit_entry(run_dir: str) -> None:
    """The tiny callable submitit pickles: exit with the agent's code (93 means do not requeue)."""
    code = agent_main(run_dir)
    sys.stdout.flush()
    sys.stderr.flush()
    if code:
        os._exit(code)
    ctx = node_context(os.environ)
    if ctx.executor == "slurm" and ctx.node_rank != 0:
        # On Slurm every agent is its own one-task step, so submitit calls each of them task 0
        # and each would write the same result file (the local executor numbers its tasks):
        # two agents ending together collide there ("A temporary saved file already exists",
        # a traceback in a completed job's log). Node 0's record of the success is enough.
        leave(0)
