"""How the supervisor's control plane grows with the job size N: the real loop, channel and
beat code, N simulated node agents, one real TCPStore, on this machine.

    python tools/bench/control_plane.py --sizes 16,128,512,2048

At each N, N + 1 node agents (N train nodes and one spare) run what a real agent runs:
slurmkit.supervise.loop.Supervisor over slurmkit.supervise.channel.Channel on its own TCPStore
connection, its beats (channel.beat at the interval the agent uses) on a second connection, and
a ledger writer (slurmkit.ledger.ledger.Ledger) on the run directory. Their nodes have no
torch ranks: a simulated node reports no failure and keeps its ranks "running" until the end.
Node 0 runs in this process, which hosts the TCPStore (libuv) as the batch host does and
answers for Slurm (the fake controller, through the SlurmClient the loop is given). The other
agents are threads spread over ``--procs`` worker processes, so one interpreter lock does not
serialise thousands of agents that on a cluster each have a host of their own. Settings are
the packaged defaults (conf/supervisor), and the beat interval is the one the agent derives
from N.

Per N it measures:

* store_rps: TCPStore round trips per second of all agents in a fault-free window (every
  client call counts one, a multi_get too; each beat is one), and per agent;
* false_lost: agents node 0 called lost in that window (must be 0: a size where node 0 calls
  an agent lost before the fault is reported as one this machine does not hold);
* fs_ops_per_step: shared-file-system operations (opens, renames, removes, listings, mkdirs:
  what Python's audit hooks report) under the run directory by a few sample training ranks,
  per step, each beating through slurmkit.train.heartbeat as the trainer does, to the file
  the real node agent names in their environment (NodeAgent.rank_env);
  agent_fs_ops_s: the same for the agents, per second of the window;
* ledger_bytes_per_h: the ledger's growth in that window, per hour. Each simulated node writes
  the heartbeat samples the real agent writes (slurmkit.launch.agent.NodeAgent: its sample
  interval, which grows with N; ``--ranks-per-node`` ranks' steps per sample) through the real
  batched Ledger (one per worker process); ledger_bytes_per_h_est: the same from the rates and
  the size of one real record (the window is short next to a 2,048-node job's 205 s interval);
* detect_s: one train node's agent dies (its threads freeze, its beats stop, Slurm calls the
  node DOWN): seconds until node 0's loop calls it lost (and posts the failure);
* decide_s: from then until the last live agent holds node 0's decision (continue on the
  spare): this end-to-end figure is the one held to the 2 s target. Its parts:
  stop_s (until node 0 holds every agent's evidence: they saw the failure, stopped and
  reported; notice_s, until the last live train node saw it, is the poll-bound part of it),
  node0_decide_s (node 0's own work after that: read the evidence, classify, decide, post) and
  fanout_s (from the post until the last agent holds it). node0_rpcs: node 0's store round
  trips from the failure to its post (bounded: they must not grow with N);
* node 0's liveness scan: the channel's one multi_get of N counters against what the agent did
  before the channel (a check and a get per agent, serially), timed on the same store; and its
  evidence read: one check + one multi_get of N sealed evidence values against a check and a
  get per agent (what the loop did before), each value's HMAC verified in both.

``--soak-s S`` is the fault-free soak: per N, no fault, a window of S seconds (600: the
10-minute check) reporting false_lost (counted, not fatal), the RPC rate and the ledger's
growth, with a line per minute.

The growth exponent of each figure is the least-squares slope of log(figure) on log(N). For
context, torchrun's elastic agent calls a node dead after 3 missed 5 s keep-alives (15 s, its
documented default, not run here). The last line is ``RESULT ...`` for the largest N run.
The machine is shared and small (2 cores): the load average is printed, expect noise; a size
that does not fit is reported and the sizes below it stand.
"""

from __future__ import annotations

import argparse
import logging
import math
import multiprocessing as mp
import os
import queue
import shutil
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
# A TCPStore client looks up its own address's name (getnameinfo) when it connects. Where no
# DNS server answers (this machine), each lookup waits out glibc's 5 s resolver timeout and
# thousands of connections take many minutes; one try of 1 s keeps the setup short. It is read
# before the first lookup of a process and changes nothing that is measured.
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")

import torch.distributed as dist  # noqa: E402

from slurmkit.config import compose  # noqa: E402
from slurmkit.slurm.client import SlurmClient  # noqa: E402
from slurmkit.slurm.retry import RetryPolicy  # noqa: E402
from slurmkit.supervise.channel import Channel, load_token  # noqa: E402
from slurmkit.launch.agent import LEDGER_FLUSH_INTERVAL_S, settle_heap  # noqa: E402
from slurmkit.ledger.ledger import LEDGER_NAME, Ledger  # noqa: E402
from slurmkit.launch.fdlimit import raise_fd_limit, store_fds_needed  # noqa: E402
from slurmkit.supervise.endwatch import EndWatch  # noqa: E402
from slurmkit.supervise.liveness import Beater  # noqa: E402
from slurmkit.supervise.deciding import Decider  # noqa: E402
from slurmkit.supervise.loop import Supervisor, Where  # noqa: E402
from testkit.fakeslurm import FakeSlurm  # noqa: E402
from slurmkit.train.heartbeat import Heartbeat  # noqa: E402

try:  # the interval the agent derives from N, where the supervisor has one
    from slurmkit.supervise.timeouts import beat_interval_s  # noqa: E402
except ImportError:  # every agent beats at each poll
    def beat_interval_s(n_nodes: int, poll_interval_s: float) -> float:
        return poll_interval_s

TORCHRUN_DEAD_S = 15.0  # torchrun elastic: keep-alive every 5 s, dead after 3 missed
ATTEMPT, JOB_ID, HOST = "bench.0", "1", "127.0.0.1"
_RPCS = frozenset({"set", "get", "add", "check", "compare_set", "multi_get", "multi_set", "wait",
                   "delete_key", "num_keys", "append"})
_FS_EVENTS = frozenset({"open", "os.rename", "os.remove", "os.rmdir", "os.mkdir", "os.listdir",
                        "os.scandir", "os.chmod", "os.truncate", "os.link", "os.symlink", "os.utime"})


# ------------------------------------------------------------------ instruments
class CountingStore:
    """A TCPStore client that counts its round trips. ``die`` freezes every later call, as the
    process on a lost host stops answering. Each one is used by one thread: no lock needed."""

    def __init__(self, store: dist.TCPStore) -> None:
        self._store = store
        self.port = store.port
        self.calls = 0
        self.gone = threading.Event()
        for name in _RPCS:  # bound once: the instrument adds one Python call per round trip
            setattr(self, name, self._counted(getattr(store, name)))

    def _counted(self, attr: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if self.gone.is_set():
                threading.Event().wait()  # a dead host: this thread never runs again
            self.calls += 1
            return attr(*args, **kwargs)

        return call

    def __getattr__(self, name: str) -> Any:  # what is not a round trip (the port, the timeout)
        return getattr(self._store, name)


class FsCounter:
    """Shared-file-system operations under one directory, by the kind of thread that made them."""

    def __init__(self) -> None:
        self.root: str | None = None
        self.counts: dict[str, int] = {}
        sys.addaudithook(self._hook)

    def _hook(self, event: str, args: tuple[Any, ...]) -> None:
        root = self.root
        if root is None or event not in _FS_EVENTS or not args:
            return
        path = args[0]
        if isinstance(path, bytes):
            path = path.decode(errors="replace")
        if not isinstance(path, str) or not os.path.abspath(path).startswith(root):
            return
        kind = threading.current_thread().name.split("-", 1)[0]
        self.counts[kind] = self.counts.get(kind, 0) + 1

    def take(self) -> dict[str, int]:
        out, self.counts = self.counts, {}
        return out


class Sink:
    """Where a supervisor reports what happened to it (node 0: the probe; workers: a queue)."""

    def __init__(self, put: Callable[[tuple[Any, ...]], None]) -> None:
        self.put = put


class Batches:
    """A worker's reports, sent to the bench in one queue message per ``every_s``. Each report
    carries its own timestamp, so the batching delays none of the figures; it keeps the
    instrument off the agents' path (a put per report to the queue shared by every worker
    woke its feeder thread and took its cross-process lock thousands of times in the decision
    window)."""

    def __init__(self, queue_put: Callable[[tuple[Any, ...]], None], every_s: float = 0.02) -> None:
        self._queue_put, self._every_s = queue_put, every_s
        self._lock = threading.Lock()
        self._held: list[tuple[Any, ...]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-batches", daemon=True)
        self._thread.start()

    def put(self, msg: tuple[Any, ...]) -> None:
        with self._lock:
            self._held.append(msg)

    def flush(self) -> None:
        with self._lock:
            held, self._held = self._held, []
        if held:
            self._queue_put(("batch", held))

    def _run(self) -> None:
        while not self._stop.wait(self._every_s):
            self.flush()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.flush()


@dataclass
class Probe:
    """Timestamps (time.monotonic, one clock for every process of this machine)."""

    started: dict[int, set[int]] = field(default_factory=dict)  # gen -> node ranks with ranks up
    applied: dict[int, dict[int, float]] = field(default_factory=dict)  # gen -> node rank -> time
    lost: list[tuple[float, int]] = field(default_factory=list)
    decide: dict[int, tuple[float, float, float, int]] = field(default_factory=dict)
    # gen -> node 0 (start, evidence complete, decision posted, its store round trips in between)
    saw: dict[int, dict[int, float]] = field(default_factory=dict)  # gen -> node rank -> saw the failure
    cpu: dict[int, dict[int, float]] = field(default_factory=dict)  # gen -> node rank -> its thread's CPU s
    errors: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, msg: tuple[Any, ...]) -> None:
        if msg[0] == "batch":  # a worker's reports of the last few milliseconds
            for m in msg[1]:
                self.record(m)
            return
        with self.lock:
            kind = msg[0]
            if kind == "started":
                self.started.setdefault(msg[1], set()).add(msg[2])
            elif kind == "applied":
                self.applied.setdefault(msg[1], {})[msg[2]] = msg[3]
            elif kind == "lost":
                self.lost.append((msg[1], msg[2]))
            elif kind == "decide":
                self.decide[msg[1]] = (msg[2], msg[3], msg[4], msg[5])
            elif kind == "saw":
                self.saw.setdefault(msg[1], {})[msg[2]] = msg[3]
            elif kind == "cpu":
                self.cpu.setdefault(msg[1], {})[msg[2]] = msg[3]
            elif kind == "error":
                self.errors.append(msg[1])


class SimNode:
    """A node with no torch ranks: they 'run' until the bench says they finished. Like the real
    agent's poll it writes a heartbeat sample of its ranks' steps to the ledger every
    ``sample_s`` (NodeAgent.sample_interval_s for this node)."""

    signal_kind: str | None = None

    def __init__(self, node_rank: int, sink: Sink, finished: Any, *, name: str = "", ledger: Any = None,
                 sample_s: float = math.inf, ranks_per_node: int = 0) -> None:
        self.node_rank, self.sink, self.finished = node_rank, sink, finished
        self.name, self.ledger, self.sample_s, self.ranks_per_node = name, ledger, sample_s, ranks_per_node
        self.slot = 0
        self._t0 = self._last = time.monotonic()

    def start(self, gen: int, slot: int, port: int, master_addr: str) -> None:
        self.slot, self._last = slot, time.monotonic()
        self.sink.put(("started", gen, self.node_rank))

    def poll(self, gen: int) -> None:
        now = time.monotonic()
        if self.ledger is not None and now - self._last >= self.sample_s:
            self._last = now
            step = 100_000 + int((now - self._t0) / 0.5)  # a step every 0.5 s, six digits as in a long run
            first = self.slot * self.ranks_per_node
            self.ledger.append("heartbeat", generation=gen, node=self.name,
                               steps={str(r): step for r in range(first, first + self.ranks_per_node)})
        return None

    def exit_codes(self) -> list[int | None]:
        return [0] if self.finished.is_set() else [None]

    def stop(self) -> list[Any]:
        return []

    def join_output(self) -> None:
        return None

    def step_window(self) -> None:  # no step times (node 0 still reads the windows each interval)
        return None

    def capture_stacks(self, gen: int) -> list[Any]:  # no ranks, no stacks (a hang is not simulated)
        return []


class TimedDecider(Decider):
    """Node 0's real decider; these overrides only record when things happened."""

    sink: Sink

    def lost_agents(self) -> Any:
        lost = super().lost_agents()
        for x in lost:
            self.sink.put(("lost", time.monotonic(), getattr(x, "node_rank", x)))
        return lost

    def gather_evidence(self, gen: int, participants: list[int]) -> Any:
        out = super().gather_evidence(gen, participants)
        self._gathered = time.monotonic()
        return out

    def decision(self, gen: int, participants: list[int]) -> Any:
        t0, calls0 = time.monotonic(), self.channel.store.calls
        d = super().decision(gen, participants)
        self.channel.post_decision(gen, d)  # what run_generation does next (set once: not twice)
        self.sink.put(("decide", gen, t0, self._gathered, time.monotonic(), self.channel.store.calls - calls0))
        return d


class TimedSupervisor(Supervisor):
    """The real loop; these overrides only record when things happened (node 0's decider: TimedDecider)."""

    decider_type = TimedDecider
    sink: Sink
    _cpu_saw: float | None = None

    def watch(self, gen: int, has_ranks: bool) -> Any:
        out = super().watch(gen, has_ranks)
        if out.kind == "failed":
            self._cpu_saw = time.thread_time()
            self.sink.put(("saw", gen, self.where.node_rank, time.monotonic()))
        return out

    def wait_decision(self, gen: int) -> Any:
        d = super().wait_decision(gen)
        self.sink.put(("applied", gen, self.where.node_rank, time.monotonic()))  # holds it
        if self._cpu_saw is not None:  # this agent's own CPU from the notice to holding the decision
            self.sink.put(("cpu", gen, self.where.node_rank, time.thread_time() - self._cpu_saw))
            self._cpu_saw = None
        return d


# ------------------------------------------------------------------ agents (node 0 here, the rest in workers)
@dataclass(frozen=True)
class Spec:
    n: int
    port: int
    run_dir: str
    token: bytes
    sample_s: tuple[float, float] = (math.inf, math.inf)  # heartbeat samples: node 0, the others
    ranks_per_node: int = 8
    push: bool = True  # each agent's EndWatch (False: poll the change counter, as before it)
    # The allocation's node names, built once (a real agent reads them once from its context).
    # Built on each use, they cost 1.1 ms at N=2,048 in every agent's EndWatch connect, and
    # 2,048 of those in the decision window were seconds of this machine's two cores.
    names: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "names", tuple(f"b{i:04d}" for i in range(self.n + 1)))


def _config(n: int) -> Any:
    return compose(["+exp=tiny", "cluster=local", f"job.nodes={n}", "supervisor.spare_nodes=1"])


def _client(port: int) -> CountingStore:
    return CountingStore(dist.TCPStore(HOST, port, is_master=False, timeout=timedelta(seconds=120),
                                       use_libuv=True))


class Agents:
    """Some of the job's agents, each a supervisor thread plus its beater, in this process."""

    def __init__(self, spec: Spec, nrs: Sequence[int], sink: Sink, finished: Any,
                 slurm: SlurmClient | None = None) -> None:
        self.spec, self.sink, self.finished = spec, sink, finished
        self.cfg = _config(spec.n)
        names = spec.names
        with ThreadPoolExecutor(32) as pool:  # connects overlap: a slow one does not hold the rest
            stores = list(pool.map(lambda _: _client(spec.port), range(3 * len(nrs))))
        self.loops = dict(zip(nrs, stores))
        self.beats = dict(zip(nrs, stores[len(nrs):]))  # the alive thread's own connection
        self.ends = dict(zip(nrs, stores[2 * len(nrs):]))  # the EndWatch's own connection
        self.channels = {nr: Channel(self.loops[nr], ATTEMPT, spec.token, names) for nr in nrs}
        self.stop_beats = threading.Event()
        self.beaters: dict[int, Beater] = {}
        self.threads: list[threading.Thread] = []
        # The heartbeat samples of this process's nodes go through one batched Ledger (a real
        # agent has its own, on its own host; here one flusher thread per simulated agent, hundreds
        # per interpreter waking every 2 s, starved the agents' beats on 2 cores). Same records,
        # same bytes: the source names a node of the same length.
        self.samples = Ledger(os.path.join(spec.run_dir, LEDGER_NAME), source=f"agent:{spec.names[-1]}",
                              flush_interval_s=LEDGER_FLUSH_INTERVAL_S)
        self._slurm = slurm

    def start(self) -> None:
        interval = beat_interval_s(len(self.spec.names), self.cfg.supervisor.poll_interval_s)
        for nr in self.channels:
            threading.Thread(target=self._beater(nr, interval).run, name=f"beat-{nr}", daemon=True).start()
            t = threading.Thread(target=self._run, args=(nr,), name=f"agent-{nr}", daemon=True)
            t.start()
            self.threads.append(t)

    def _beater(self, nr: int, interval_s: float) -> Beater:
        """The agent's alive thread (slurmkit.supervise.liveness.Beater, as the agent starts it):
        one beat per interval on its own connection; its failing beats are what a watching
        follower learns a gone store from."""
        channel, store = self.channels[nr], self.beats[nr]
        beater = Beater(lambda st, tick: channel.beat(nr, tick, st), lambda: store, interval_s=interval_s,
                        sleep=self.stop_beats.wait)
        self.beaters[nr] = beater
        return beater

    def _run(self, nr: int) -> None:
        spec = self.spec
        ledger = Ledger(os.path.join(spec.run_dir, LEDGER_NAME), source=f"agent:{spec.names[nr]}",
                        flush_interval_s=LEDGER_FLUSH_INTERVAL_S)  # as the agent makes it
        node = SimNode(nr, self.sink, self.finished, name=spec.names[nr], ledger=self.samples,
                       sample_s=spec.sample_s[0 if nr == 0 else 1], ranks_per_node=spec.ranks_per_node)
        s = TimedSupervisor(self.cfg, Where(nr, spec.names, ATTEMPT, JOB_ID, "slurm", HOST),
                            self.channels[nr], node, ledger,
                            train_nodes=spec.n, run_dir=spec.run_dir, env={}, slurm=self._slurm,
                            ckpt_step=lambda: 100, free_port=lambda: 29500,
                            end_watch=EndWatch(lambda: Channel(self.ends[nr], ATTEMPT, spec.token, spec.names))
                            if spec.push else None, beater=self.beaters[nr] if spec.push else None)
        s.sink = self.sink
        if isinstance(s.decider, TimedDecider):  # node 0
            s.decider.sink = self.sink
        try:
            s.run()
        except Exception as exc:  # noqa: BLE001 - reported to the bench, which stops
            self.sink.put(("error", f"{spec.names[nr]}: {type(exc).__name__}: {exc}"))
        finally:
            ledger.close()

    def kill(self, nr: int) -> None:
        self.beats[nr].gone.set()
        self.loops[nr].gone.set()
        self.ends[nr].gone.set()

    def rpcs(self) -> int:
        return sum(s.calls for s in (*self.loops.values(), *self.beats.values(), *self.ends.values()))

    def join(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for nr, t in zip(self.channels, self.threads):
            if not self.loops[nr].gone.is_set():
                t.join(max(deadline - time.monotonic(), 0.1))
        for b in self.beaters.values():
            b.stopped.set()
        self.stop_beats.set()
        self.samples.close()


def _worker(spec: Spec, nrs: list[int], events: Any, conn: Any, finished: Any) -> None:
    """A worker process: its agents, and a command loop for the bench (kill, counts, end)."""
    logging.basicConfig(level=logging.ERROR)
    threading.stack_size(512 * 1024)
    fs = FsCounter()
    fs.root = os.path.abspath(spec.run_dir) + os.sep
    batches = Batches(events.put)
    agents = Agents(spec, nrs, Sink(batches.put), finished)
    settle_heap()  # as each agent does once it is set up (slurmkit.launch.agent.agent_main)
    conn.send(("ready",))
    agents.start()
    while True:
        cmd = conn.recv()
        if cmd[0] == "kill":
            agents.kill(cmd[1])
        elif cmd[0] == "counts":
            conn.send((agents.rpcs(), fs.take()))
        elif cmd[0] == "stacks":  # where some agents' threads are (a size that timed out)
            conn.send(_thread_stacks({f"{kind}-{nr}" for nr in cmd[1] for kind in ("agent", "beat")}))
        elif cmd[0] == "end":
            agents.join(60)
            batches.close()
            conn.send(("ended",))
            return


def _thread_stacks(names: set[str]) -> list[str]:
    """The current stack of each thread of this process named in ``names`` (innermost last)."""
    frames = sys._current_frames()
    out = []
    for t in threading.enumerate():
        if t.name in names and t.ident in frames:
            out.append(f"{t.name}:\n" + "".join(traceback.format_stack(frames[t.ident])[-6:]))
    return out


# ------------------------------------------------------------------ one size
@dataclass(frozen=True)
class Fault:
    """One lost agent: detection, and the decision end to end with its parts (seconds)."""

    detect_s: float
    decide_s: float  # the failure posted -> every live agent holds the decision (the target's figure)
    notice_s: float
    stop_s: float
    node0_decide_s: float
    fanout_s: float
    node0_rpcs: int
    decide_cpu_s: float = float("nan")  # CPU of every bench process (agents, node 0, store) in decide_s
    steady_busy_cores: float = float("nan")  # the same before the loss is known: the agents' steady state
    # One agent's own work on the failure path (its supervisor thread's CPU from seeing the
    # failure to holding the decision: stop, report, wait, read): median and largest, in ms.
    # Flat in N means the per-agent path is O(1); on a cluster it runs on the agent's own host.
    agent_cpu_ms: float = float("nan")
    agent_cpu_max_ms: float = float("nan")


@dataclass
class Figures:
    n: int
    store_rps: float
    rps_per_agent: float
    false_lost: int
    fs_ops_per_step: float
    agent_fs_ops_s: float
    ledger_bytes_per_h: float
    ledger_bytes_per_h_est: float
    window_s: float
    scan_channel_ms: float
    scan_serial_ms: float
    evid_channel_ms: float
    evid_serial_ms: float
    setup_s: float
    load: float  # load average (1 min) when the size ended
    fault: Fault | None  # None in the soak

    def get(self, name: str) -> float | None:
        if name in Fault.__dataclass_fields__:
            return None if self.fault is None else getattr(self.fault, name)
        return getattr(self, name)


def _wait(pred: Callable[[], bool], timeout_s: float, what: str, probe: Probe, *,
          before_fault: bool = False) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if probe.errors:
            raise RuntimeError(f"an agent failed while waiting for {what}: {probe.errors[0]}")
        if before_fault and probe.lost:
            names = sorted({nr for _, nr in probe.lost})
            raise RuntimeError(f"node 0 called {len(names)} agent(s) lost before any fault (node ranks "
                               f"{names[:8]}{' ...' if len(names) > 8 else ''}) while waiting for {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.02)


class Size:
    """One N: the store, node 0 here, the other agents in worker processes."""

    def __init__(self, n: int, procs: int, workdir: str, fs: FsCounter, ranks_per_node: int,
                 push: bool = True) -> None:
        self.n, self.fs = n, fs
        run_dir = tempfile.mkdtemp(prefix=f"cp{n}-", dir=workdir)
        self.server = dist.TCPStore(HOST, 0, is_master=True, timeout=timedelta(seconds=120),
                                    wait_for_workers=False, use_libuv=True)
        names = Spec(n, 0, run_dir, b"").names
        self.spec = Spec(n, self.server.port, run_dir, load_token(run_dir, create=True),
                         sample_intervals(run_dir, names), ranks_per_node, push)
        self.fake = FakeSlurm({"bench": f"b[0000-{n:04d}]"})
        script = os.path.join(run_dir, "job.sh")
        with open(script, "w") as f:
            f.write(f"#!/bin/bash\n#SBATCH --nodes={n + 1}\n#SBATCH --requeue\n")
        job_id = self.fake.run(["sbatch", "--parsable", script]).stdout.strip()
        self.fake.start(job_id, list(self.spec.names))
        slurm = SlurmClient(self.fake, retry=RetryPolicy(max_attempts=3, initial_wait_s=0.1, jitter_s=0))
        self.probe = Probe()
        self.ctx = mp.get_context("spawn")
        self.finished = self.ctx.Event()
        self.events = self.ctx.Queue()
        others = list(range(1, n + 1))  # every agent but node 0 (train nodes and the spare)
        self.shares = [others[i::procs] for i in range(min(procs, len(others)))]
        self.conns, self.workers = [], []
        for share in self.shares:
            here, there = self.ctx.Pipe()
            p = self.ctx.Process(target=_worker, args=(self.spec, share, self.events, there, self.finished),
                                 daemon=True)
            p.start()
            self.conns.append(here)
            self.workers.append(p)
        self.drain = threading.Thread(target=self._drain, name="bench-drain", daemon=True)
        self.drain.start()
        Channel(_client(self.spec.port), ATTEMPT, self.spec.token, self.spec.names).seed_beats(
            range(len(self.spec.names)))
        for c in self.conns:
            if not c.poll(600):
                raise TimeoutError("a worker did not start within 600 s")
            c.recv()
        self.node0 = Agents(self.spec, [0], Sink(self.probe.record), self.finished, slurm=slurm)
        settle_heap()  # node 0's agent, as the others (a no-op for what an earlier size froze)
        self.node0.start()

    def _drain(self) -> None:
        while True:
            try:
                msg = self.events.get(timeout=0.5)
            except queue.Empty:
                if not any(p.is_alive() for p in self.workers):
                    return
                continue
            self.probe.record(msg)

    def counts(self) -> tuple[int, dict[str, int]]:
        total, ops = self.node0.rpcs(), self.fs.take()
        for c in self.conns:
            c.send(("counts",))
        for c in self.conns:
            rpcs, more = c.recv()
            total += rpcs
            for k, v in more.items():
                ops[k] = ops.get(k, 0) + v
        return total, ops

    def stacks(self, nrs: Sequence[int]) -> list[str]:
        """Where the agents ``nrs`` are stuck (their main and beat threads), from their workers."""
        out: list[str] = []
        for c in self.conns:
            c.send(("stacks", list(nrs)))
        for c in self.conns:
            if c.poll(30):
                out.extend(c.recv())
        return out

    def kill(self, nr: int) -> None:
        node = self.fake.nodes[self.spec.names[nr]]  # what slurmctld shows once slurmd is gone
        node.state, node.flags, node.reason = "DOWN", ["NOT_RESPONDING"], "Not responding"
        self.conns[(nr - 1) % len(self.conns)].send(("kill", nr))

    def end(self) -> None:
        self.finished.set()
        for c in self.conns:
            c.send(("end",))
        for c, p in zip(self.conns, self.workers):
            if c.poll(90):
                c.recv()
            p.join(30)
            if p.is_alive():
                p.terminate()
        self.node0.join(30)
        shutil.rmtree(self.spec.run_dir, ignore_errors=True)


def run_size(n: int, steady_s: float, sample_ranks: int, procs: int, fs: FsCounter, workdir: str, *,
             ranks_per_node: int = 8, soak: bool = False, push: bool = True) -> Figures:
    """One N: the fault-free window of ``steady_s``, then (unless ``soak``) one agent lost."""
    t_setup = time.monotonic()
    fs.root = None
    size = Size(n, procs, workdir, fs, ranks_per_node, push)
    probe, run_dir = size.probe, size.spec.run_dir
    try:
        _wait(lambda: len(probe.started.get(0, ())) == n, 300 + n / 5, f"{n} nodes to start generation 0",
              probe, before_fault=True)
        setup_s = time.monotonic() - t_setup
        time.sleep(3.0)  # every beat counter has moved a few times

        # ---- fault-free window: RPC rate, false losses, shared-FS operations, ledger growth
        ledger_path = os.path.join(run_dir, LEDGER_NAME)
        size0 = os.path.getsize(ledger_path) if os.path.exists(ledger_path) else 0
        fs.root = os.path.abspath(run_dir) + os.sep
        envs = rank_envs(run_dir, size.spec.names, sample_ranks)
        rpc0, _ = size.counts()
        lost0 = len(probe.lost)
        steps = [0] * sample_ranks
        window_over = threading.Event()

        def rank(i: int) -> None:  # a training rank's per-step heartbeat, as the trainer calls it
            hb = Heartbeat.from_env(envs[i], int(envs[i]["RANK"]))
            while not window_over.is_set():
                if hb is not None:
                    hb.beat(steps[i])
                steps[i] += 1
                window_over.wait(0.05)

        ranks = [threading.Thread(target=rank, args=(i,), name=f"rank-{i}", daemon=True)
                 for i in range(sample_ranks)]
        t0 = time.monotonic()
        for t in ranks:
            t.start()
        if soak:
            _soak(steady_s, probe, lost0)
        else:
            time.sleep(steady_s)
        window_over.set()
        for t in ranks:
            t.join()
        rpc1, ops = size.counts()
        window = time.monotonic() - t0
        fs.root = None
        false_lost = len(probe.lost) - lost0
        size1 = os.path.getsize(ledger_path) if os.path.exists(ledger_path) else 0
        if false_lost and not soak:
            raise RuntimeError(f"node 0 called {false_lost} agent(s) lost in the fault-free window")
        scan_channel, scan_serial = _time_scans(size.spec, n)
        evid_channel, evid_serial = _time_evidence_reads(size.spec, n)
        fault = None if soak else _one_fault(size, n)
    finally:
        size.end()
    if probe.errors:
        raise RuntimeError(f"agents failed: {probe.errors[:3]}")
    agent_ops = sum(v for k, v in ops.items() if k != "rank")
    rpcs = rpc1 - rpc0
    record = heartbeat_record_bytes(size.spec)
    per_h = 3600 / size.spec.sample_s[0] + n * 3600 / size.spec.sample_s[1]
    return Figures(
        n=n, store_rps=rpcs / window, rps_per_agent=rpcs / window / (n + 1), false_lost=false_lost,
        fs_ops_per_step=ops.get("rank", 0) / max(sum(steps), 1), agent_fs_ops_s=agent_ops / window,
        ledger_bytes_per_h=(size1 - size0) / window * 3600, ledger_bytes_per_h_est=per_h * record,
        window_s=window, scan_channel_ms=scan_channel * 1e3, scan_serial_ms=scan_serial * 1e3,
        evid_channel_ms=evid_channel * 1e3, evid_serial_ms=evid_serial * 1e3, setup_s=setup_s,
        load=os.getloadavg()[0], fault=fault)


def _soak(seconds: float, probe: Probe, lost0: int) -> None:
    """The fault-free soak: wait out the window, a line a minute (nothing is fatal in it)."""
    t0 = time.monotonic()
    while (left := t0 + seconds - time.monotonic()) > 0:
        time.sleep(min(60.0, left))
        if probe.errors:
            raise RuntimeError(f"an agent failed in the soak: {probe.errors[0]}")
        lost = sorted({nr for _, nr in probe.lost[lost0:]})
        print(f"  soak {time.monotonic() - t0:5.0f} s: false lost {len(lost)} {lost[:8]}, "
              f"load {os.getloadavg()[0]:.1f}", flush=True)


class CpuTimeline:
    """CPU seconds (user + system) used by this process and the worker processes, sampled every
    ``every_s`` from /proc, so that the CPU spent inside a window known only afterwards can be
    read: how busy this machine's cores were while the decision ran (at N=2,048 the simulated
    agents' own work fills both cores, which on a cluster each agent has on its own host)."""

    def __init__(self, pids: Sequence[int], every_s: float = 0.02) -> None:
        self.pids, self.every_s = [os.getpid(), *pids], every_s
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._tick = os.sysconf("SC_CLK_TCK")
        self._thread = threading.Thread(target=self._run, name="cpu-timeline", daemon=True)

    def _cpu(self) -> float:
        total = 0
        for pid in self.pids:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)
            except (OSError, IndexError, ValueError):
                continue
        return total / self._tick

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.monotonic(), self._cpu()))
            self._stop.wait(self.every_s)

    def start(self) -> CpuTimeline:
        # The first sample before start returns: a window that opens right after (the steady
        # window opens at the kill) has a sample at or before its start however late the
        # thread first runs (a loaded machine: else the window read NaN).
        self.samples.append((time.monotonic(), self._cpu()))
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def between(self, t0: float, t1: float) -> float:
        """CPU seconds used from ``t0`` to ``t1`` (the nearest samples around them)."""
        before = [c for t, c in self.samples if t <= t0]
        after = [c for t, c in self.samples if t >= t1]
        if not before or not after:
            return float("nan")
        return after[0] - before[-1]


def _one_fault(size: Size, n: int) -> Fault:
    """One train node's agent dies; the phases from its death until every live agent holds the
    decision (all times on this machine's one monotonic clock)."""
    probe = size.probe
    victim = n - 1 if n > 1 else 1
    cpu = CpuTimeline([p.pid for p in size.workers if p.pid is not None]).start()
    t_kill = time.monotonic()
    size.kill(victim)
    _wait(lambda: any(nr == victim for _, nr in probe.lost), 300, "node 0 to call the node lost", probe)
    t_lost = min(t for t, nr in probe.lost if nr == victim)
    _wait(lambda: len(probe.applied.get(0, {})) == n, 300, "every live agent to hold the decision", probe)
    t_held = max(probe.applied[0].values())
    time.sleep(2 * cpu.every_s)  # one more sample after the window (a sampling period, not a wait)
    cpu.stop()
    d0, gathered, posted, node0_rpcs = probe.decide[0]
    t_saw = max(t for nr, t in probe.saw.get(0, {}).items() if nr not in (victim, n))  # n: the spare
    try:
        _wait(lambda: len(probe.started.get(1, ())) == n, 300, "generation 1 on the spare", probe)
    except TimeoutError:
        missing = sorted(set(range(n + 1)) - {victim} - probe.started.get(1, set()))
        print(f"  agents without generation 1: {missing[:16]}", flush=True)
        for st in size.stacks(missing[:4]):
            print("  " + st.replace("\n", "\n    "), flush=True)
        raise
    own = sorted(v for nr, v in probe.cpu.get(0, {}).items() if nr != 0)  # the followers'
    late = sorted(t - posted for nr, t in probe.applied[0].items() if nr != 0)
    saw = sorted(t - t_lost for nr, t in probe.saw.get(0, {}).items() if nr not in (0, victim))
    print(f"  the failure seen (from the loss) / the decision held (from its post), in s: "
          f"{_quantiles(saw)} / {_quantiles(late)}", flush=True)
    return Fault(detect_s=t_lost - t_kill, decide_s=t_held - t_lost, notice_s=t_saw - t_lost,
                 stop_s=gathered - t_lost, node0_decide_s=posted - gathered, fanout_s=t_held - posted,
                 node0_rpcs=node0_rpcs, decide_cpu_s=cpu.between(t_lost, t_held),
                 steady_busy_cores=cpu.between(t_kill, t_lost) / max(t_lost - t_kill, 1e-9),
                 agent_cpu_ms=1e3 * own[len(own) // 2] if own else float("nan"),
                 agent_cpu_max_ms=1e3 * own[-1] if own else float("nan"))


def _quantiles(xs: list[float]) -> str:
    """``xs`` (sorted) as its median, 90th and 99th percentiles and largest."""
    if not xs:
        return "none"
    at = [xs[min(int(q * len(xs)), len(xs) - 1)] for q in (0.5, 0.9, 0.99)]
    return f"p50 {at[0]:.2f} p90 {at[1]:.2f} p99 {at[2]:.2f} max {xs[-1]:.2f}"


def sample_intervals(run_dir: str, names: tuple[str, ...]) -> tuple[float, float]:
    """How often the real node agent writes a heartbeat sample to the ledger: node 0's interval
    and the others' (NodeAgent.sample_interval_s, which grows with N), on this run directory."""
    from slurmkit.launch.agent import NodeAgent
    from slurmkit.launch.context import NodeContext
    from slurmkit.cli.submit import freeze

    cfg = _config(len(names) - 1)
    freeze(cfg, run_dir)
    out = []
    for nr in (0, 1):
        ctx = NodeContext(nr, len(names), names[nr], names, JOB_ID, 0, HOST, "slurm")
        agent = NodeAgent(run_dir, cfg, ctx, {}, Ledger(os.path.join(run_dir, LEDGER_NAME)))
        out.append(agent.sample_interval_s)
        agent.remove_local_files()
    return out[0], out[1]


def heartbeat_record_bytes(spec: Spec) -> int:
    """The bytes one heartbeat sample of a node (``spec.ranks_per_node`` ranks, the last node's
    rank numbers, six-digit steps) takes in a ledger, written by the real Ledger to a scratch file."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, LEDGER_NAME)
        first = (spec.n - 1) * spec.ranks_per_node
        led = Ledger(path, source=f"agent:{spec.names[-1]}")
        led.append("heartbeat", generation=3, node=spec.names[-1],
                   steps={str(r): 123456 for r in range(first, first + spec.ranks_per_node)})
        led.close()
        return os.path.getsize(path)


def rank_envs(run_dir: str, names: tuple[str, ...], k: int) -> list[dict[str, str]]:
    """The environment the real node agent gives rank 0 of its first ``k`` nodes (where its
    heartbeat file goes), from slurmkit.launch.agent.NodeAgent on this run directory, frozen
    (config.yaml, layout.json) as submit freezes it."""
    from slurmkit.launch.agent import NodeAgent
    from slurmkit.launch.context import NodeContext
    from slurmkit.cli.submit import freeze

    cfg = _config(len(names) - 1)
    freeze(cfg, run_dir)  # again: the same files
    envs = []
    for nr in range(k):
        ctx = NodeContext(nr, len(names), names[nr], names, JOB_ID, 0, HOST, "slurm")
        agent = NodeAgent(run_dir, cfg, ctx, {}, Ledger(os.path.join(run_dir, LEDGER_NAME)))
        envs.append(agent.rank_env(0, 0, nr, 29500))
    return envs


def _time_scans(spec: Spec, n: int, repeats: int = 3) -> tuple[float, float]:
    """Node 0's liveness scan of n agents: the channel's one multi_get, and the serial check +
    get per agent that the agent made before the channel (its key scheme), on the same store."""
    store = _client(spec.port)
    keys = [f"old/alive/{nr}" for nr in range(1, n + 1)]
    for k in keys:
        store.set(k, "1")
    chan = Channel(store, ATTEMPT, spec.token, spec.names)
    best_c = best_s = math.inf
    for _ in range(repeats):
        t = time.monotonic()
        chan.beats(list(range(1, n + 1)))
        best_c = min(best_c, time.monotonic() - t)
        t = time.monotonic()
        for k in keys:
            if store.check([k]):
                store.get(k)
        best_s = min(best_s, time.monotonic() - t)
    return best_c, best_s


def _time_evidence_reads(spec: Spec, n: int, repeats: int = 3) -> tuple[float, float]:
    """Node 0 reading n agents' evidence of a generation (sealed values, HMAC checked): the
    loop's one check + one multi_get, and the check + get per agent it made before."""
    from slurmkit.failures.classes import FailureClass
    from slurmkit.failures.classify import Evidence

    store = _client(spec.port)
    chan = Channel(store, ATTEMPT, spec.token, spec.names)
    gen, nrs = 999, list(range(1, n + 1))
    for nr in nrs:
        chan.post_evidence(gen, nr, [Evidence(time.time(), spec.names[nr], 8 * nr, "exit",
                                              FailureClass.PEER_FAILURE, "returncode -9")])
    best_c = best_s = math.inf
    for _ in range(repeats):
        t = time.monotonic()
        assert chan.has_all_evidence(gen, nrs)
        got = chan.all_evidence(gen, nrs)
        best_c = min(best_c, time.monotonic() - t)
        t = time.monotonic()
        serial = {nr: chan.evidence(gen, nr) for nr in nrs}
        best_s = min(best_s, time.monotonic() - t)
        assert got == serial, "the two reads disagree"
    return best_c, best_s


# ------------------------------------------------------------------ report
def slope(ns: list[int], ys: list[float]) -> float | None:
    pts = [(math.log(x), math.log(y)) for x, y in zip(ns, ys) if y > 0]
    if len(pts) < 2:
        return None
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    den = sum((p[0] - mx) ** 2 for p in pts)
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / den if den else None


def _fmt(v: float | None, nd: int = 2) -> str:
    return "na" if v is None else f"{v:.{nd}f}"


COLUMNS = ("n", "setup_s", "load", "store_rps", "rps_per_agent", "false_lost", "fs_ops_per_step",
           "agent_fs_ops_s", "ledger_bytes_per_h", "ledger_bytes_per_h_est", "detect_s", "decide_s",
           "notice_s", "stop_s", "node0_decide_s", "fanout_s", "node0_rpcs", "agent_cpu_ms", "scan_channel_ms",
           "scan_serial_ms", "evid_channel_ms", "evid_serial_ms")


def print_table(rows: list[Figures]) -> dict[str, float | None]:
    sup = _config(rows[-1].n).supervisor
    print(f"\nsettings: poll_interval_s={sup.poll_interval_s:g} node_timeout_s={sup.node_timeout_s:g} "
          f"(packaged defaults); beat interval at N={rows[-1].n}: "
          f"{beat_interval_s(rows[-1].n + 1, sup.poll_interval_s):g} s")
    print(" ".join(f"{h[:11]:>11}" for h in COLUMNS))
    for r in rows:
        vals = [r.get(c) for c in COLUMNS]
        print(" ".join(f"{'na':>11}" if v is None else f"{v:>11}" if isinstance(v, int) else f"{v:>11.2f}"
                       for v in vals))
    ns = [r.n for r in rows]
    exps: dict[str, float | None] = {}
    for name in ("store_rps", "rps_per_agent", "detect_s", "decide_s", "node0_decide_s", "fanout_s",
                 "node0_rpcs", "agent_cpu_ms", "scan_channel_ms", "scan_serial_ms", "evid_channel_ms",
                 "ledger_bytes_per_h_est"):
        ys = [r.get(name) for r in rows]
        exps[name] = None if any(y is None for y in ys) else slope(ns, [float(y) for y in ys])  # type: ignore[arg-type]
    print("growth exponent in N (slope of log figure on log N; 0: flat, 1: linear): "
          + " ".join(f"{k}={_fmt(v)}" for k, v in exps.items()))
    last = rows[-1]
    ratio_scan = last.scan_serial_ms / max(last.scan_channel_ms, 1e-9)
    ratio_evid = last.evid_serial_ms / max(last.evid_channel_ms, 1e-9)
    detect = (f"detect {last.fault.detect_s:.2f} s = {last.fault.detect_s / TORCHRUN_DEAD_S:.2f}x"
              if last.fault else "no fault (soak)")
    if last.fault is not None:
        f = last.fault
        print(f"while the decision ran ({f.decide_s:.2f} s at N={last.n}) the bench's processes used "
              f"{f.decide_cpu_s:.2f} CPU-seconds: {f.decide_cpu_s / max(f.decide_s, 1e-9):.2f} of this machine's "
              f"{os.cpu_count()} cores, {1e3 * f.decide_cpu_s / (last.n + 1):.2f} ms per agent (on a cluster each "
              f"agent's share runs on its own host); before the loss was known the agents' steady state "
              f"kept {f.steady_busy_cores:.2f} cores busy")
    print(f"vs torchrun's keep-alive (dead after {TORCHRUN_DEAD_S:g} s, documented): {detect} at N={last.n}; "
          f"node 0's scan with the channel {ratio_scan:.1f}x faster than serial check+get; its evidence "
          f"read {ratio_evid:.1f}x faster than a check+get per agent")
    return exps


def result_line(rows: list[Figures], exps: dict[str, float | None], soak_s: float | None = None) -> str:
    r = rows[-1]
    fs_ops = f"{r.fs_ops_per_step:.2f}" if r.fs_ops_per_step else "0"
    common = (f"store_rps={r.store_rps:.0f} fs_ops_per_step={fs_ops} "
              f"ledger_bytes_per_h={r.ledger_bytes_per_h:.0f} ledger_bytes_per_h_est={r.ledger_bytes_per_h_est:.0f} "
              f"false_lost={r.false_lost} rps_per_agent={r.rps_per_agent:.2f}")
    if r.fault is None:
        return (f"RESULT mode=soak n={r.n} soak_s={soak_s:.0f} {common} load={r.load:.1f} "
                f"sizes={','.join(str(x.n) for x in rows)}")
    f = r.fault
    # milliseconds shown: at small N a whole decision takes a few of them
    return (f"RESULT n={r.n} detect_s={f.detect_s:.2f} decide_s={f.decide_s:.3f} {common} "
            f"notice_s={f.notice_s:.3f} stop_s={f.stop_s:.3f} node0_decide_s={f.node0_decide_s:.3f} "
            f"fanout_s={f.fanout_s:.3f} node0_rpcs={f.node0_rpcs} "
            f"decide_cpu_s={f.decide_cpu_s:.2f} decide_busy_cores={f.decide_cpu_s / max(f.decide_s, 1e-9):.2f} "
            f"steady_busy_cores={f.steady_busy_cores:.2f} cores={os.cpu_count()} "
            f"agent_cpu_ms={f.agent_cpu_ms:.2f} agent_cpu_max_ms={f.agent_cpu_max_ms:.2f} "
            f"detect_exp={_fmt(exps['detect_s'])} decide_exp={_fmt(exps['decide_s'])} "
            f"store_rps_exp={_fmt(exps['store_rps'])} load={r.load:.1f} sizes={','.join(str(x.n) for x in rows)}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="16,128,512,2048", help="comma-separated N (train nodes)")
    p.add_argument("--steady-s", type=float, default=10.0, help="length of the fault-free window per N")
    p.add_argument("--soak-s", type=float, default=None,
                   help="fault-free soak instead: a window of this many seconds per N, no fault (600: the "
                        "10-minute check)")
    p.add_argument("--sample-ranks", type=int, default=4, help="training ranks that beat per step")
    p.add_argument("--ranks-per-node", type=int, default=8, help="ranks per node in the ledger's heartbeat samples")
    p.add_argument("--poll", action="store_true",
                   help="agents poll the generation's change counter every poll instead of waiting on "
                        "its end key (the control plane before slurmkit.supervise.endwatch), for comparison")
    p.add_argument("--procs", type=int, default=16,
                   help="worker processes for the agents (fewer puts more agent threads behind one "
                        "interpreter lock: at 4, one decision's fan-out at N=2,048 took 5.7 s of lock hand-offs)")
    p.add_argument("--dir", default=None, help="where run directories go (default: a temp dir)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    sizes = [int(x) for x in args.sizes.split(",") if x.strip()]
    fd_warning = raise_fd_limit(store_fds_needed(max(sizes, default=0) + 1))  # this process hosts the store
    if fd_warning:
        print(fd_warning, file=sys.stderr)
    threading.stack_size(512 * 1024)  # thousands of agent threads
    workdir = tempfile.mkdtemp(prefix="cpbench-", dir=args.dir)
    fs = FsCounter()
    soak = args.soak_s is not None
    window = args.soak_s if soak else args.steady_s
    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at start (shared machine); "
          f"agents in {args.procs} worker processes" + (f"; fault-free soak of {window:g} s per N" if soak else ""),
          flush=True)
    rows: list[Figures] = []
    try:
        for n in sizes:
            print(f"N={n}: {n + 1} agents, {3 * (n + 1)} store connections ...", flush=True)
            try:
                rows.append(run_size(n, window, args.sample_ranks, args.procs, fs, workdir,
                                     ranks_per_node=args.ranks_per_node, soak=soak, push=not args.poll))
            except (TimeoutError, RuntimeError, OSError) as exc:
                print(f"N={n} did not fit this machine: {exc}; stopping at the sizes above", flush=True)
                break
            r = rows[-1]
            what = (f"detect {r.fault.detect_s:.2f} s, decide {r.fault.decide_s:.2f} s (notice {r.fault.notice_s:.2f}, "
                    f"stop {r.fault.stop_s:.2f}, node 0 {r.fault.node0_decide_s:.2f}, fan-out {r.fault.fanout_s:.2f}; "
                    f"node 0 {r.fault.node0_rpcs} RPCs)" if r.fault else f"soak {r.window_s:.0f} s")
            print(f"N={n}: {what}, {r.store_rps:.0f} store RPC/s, false lost {r.false_lost}, "
                  f"setup {r.setup_s:.1f} s, load {r.load:.1f}", flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if not rows:
        print("no size completed")
        return 1
    exps = print_table(rows)
    print(f"ran N = {','.join(str(r.n) for r in rows)} of {','.join(map(str, sizes))}; "
          f"load average {os.getloadavg()[0]:.1f} at end")
    print(result_line(rows, exps, window if soak else None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
