"""Mean time to recovery per fault: slurmkit vs sbatch+srun+requeue, torchrun and ft_launcher.

Real faults in real jobs on the local Slurm cluster (tools/local-cluster), one class at a time:

| class        | fault                                        | slurmkit path                  |
|--------------|----------------------------------------------|--------------------------------|
| crash        | SIGKILL of rank 3                            | restart inside the allocation  |
| hang         | SIGSTOP of rank 1 (heartbeat_timeout_s=8)    | restart inside the allocation  |
| nccl         | SLURMKIT_FAULT=nccl_abort:2:15:once          | restart inside the allocation  |
| node_spare   | `local-cluster kill-node` (spare_nodes=1)    | continue on the spare node     |
| node_requeue | `local-cluster kill-node`, no spare          | requeue without the node       |

slurmkit: ``python -m slurmkit.submit +exp=tiny`` (40 steps, a checkpoint every 10, 0.25 s per
step, ``parallel.pg_timeout_s=60``). Detection = fault -> the ledger's ``failure`` event;
resume = fault -> the next ``train_resumed`` (rank 0 restored the checkpoint and trains on).

Baseline (what a user has without slurmkit): the same frozen config.yaml (written with
``submit.emit=sbatch``) run by a plain ``sbatch --requeue`` script: ``srun --kill-on-bad-exit=1``
starts one task per rank with RANK/LOCAL_RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, and after a
non-zero srun the script runs ``scontrol requeue $SLURM_JOB_ID`` (Slurm holds it ~120 s). Node
loss: Slurm's own NODE_FAIL requeue (one run serves both node classes). The hang ends only at the
process-group timeout (60 s). Detection = fault -> srun returned / the job left RUNNING
(whichever first); resume = fault -> ``train_resumed`` in the ledger. The trainer gets
SLURMKIT_LEDGER and SLURMKIT_HEARTBEAT_FILE (the bench reads steps and pids from it) and
SLURMKIT_NODE=$SLURMD_NODENAME (every emulated node shares one hostname here; on a real
cluster the hostname would tell the per-node checkpoint tiers apart).

Elastic launcher baselines (``--baselines``), the same frozen config again, one launcher per node
started by ``srun`` in an ``sbatch --requeue`` job (2 nodes x 2 ranks), which requeues itself
when the launcher gives up:

- ``torchrun``: ``torchrun --nnodes=2 --nproc-per-node=2 --max-restarts=3 --rdzv-backend=c10d``
  restarts every rank of the job inside the allocation when one fails. It needs
  ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: without it every restart on the local cluster died in
  gloo's connectFullMesh (the agents' restart counts diverge and the ranks read the previous
  attempt's addresses from the shared store; pytorch issue 135712).
- ``ft``: nvidia-resiliency-ext's ``ft_launcher`` (the same agent, plus rank monitors), the same
  arguments and ``--ignore-missing-fault-tol-cfg``. Found beside this Python, on PATH or at
  ``--ft-launcher``; when it is missing or its ``--help`` fails the table and the RESULT line say
  it is unavailable and why (``ft_available=no``), nothing is measured. 0.7.0 ships wheels only
  for CPython 3.12/3.14 on glibc >= 2.39 (0.5.0 and 0.6.0: glibc >= 2.39); on CPython 3.11 with
  glibc 2.36 pip takes 0.4.1, which runs on CPU with gloo (NVML missing: it disables its GPU
  health checks and says so).

Detection = fault -> a launcher logged the failed worker (``failed (exitcode``, ``closing
signal``), srun returned or the job left RUNNING, whichever first; resume = fault ->
``train_resumed``. Neither launcher detects the hang: torchrun has no hang detection and
ft_launcher's needs heartbeats the program sends through its RankMonitorClient (the trainer sends
none), so the process-group timeout ends it, as in the sbatch baseline. Node loss: the survivor
cannot rendezvous without the lost node (``--nnodes=2``), so Slurm's NODE_FAIL requeue recovers
it; one run serves both node classes. The table prints each baseline's ratio to slurmkit
(baseline / slurmkit); RESULT adds ``<class>_<baseline>_detect_s``, ``<class>_<baseline>_resume_s``
and ``mttr_vs_<baseline>_<class>`` (baseline resume / slurmkit resume); ``<class>_baseline_resume_s``
stays the sbatch baseline's.

Measured on the local cluster (2 cores, 4 emulated nodes, torch 2.13.0+cpu, nvidia-resiliency-ext
0.4.1), one run each, ``--skip-goodput --snapshot --baselines sbatch,torchrun,ft --ft-launcher
<venv>/bin/ft_launcher``, ``--classes crash`` then ``--classes node_spare,node_requeue,hang``;
detect / resume in seconds (the launchers' node loss goes through Slurm's requeue):

| class        | slurmkit      | torchrun      | ft_launcher   | sbatch        |
|--------------|---------------|---------------|---------------|---------------|
| crash        | 1.03 / 13.37  | 0.25 / 24.15  | 0.35 / 18.97  | 4.72 / 160.48 |
| hang         | 8.74 / 18.07  | 62.98 / 104.92| 62.98 / 103.48| 71.15 / 224.20|
| node_spare   | 6.23 / 21.10  | 1.64 / 183.16 | 1.80 / 176.94 | 24.87 / 158.78|
| node_requeue | 6.70 / 99.69  | (same run)    | (same run)    | (same run)    |

The launchers notice a lost node sooner than slurmkit here only because ``kill-node`` SIGKILLs
the node's processes and the kernel closes their sockets at once; a host that really dies sends
no reset, and the survivors wait for TCP or the process-group timeout.

Then one slurmkit run of --goodput-minutes with three faults (crash, hang, node loss onto the
spare) at 1/4, 1/2, 3/4 of it; goodput from ``slurmkit.ledger.summary.summarize`` over the
ledger up to the end of the window (submission -> submission + --goodput-minutes), so time after
a job that died early counts as lost.

    python tools/bench/mttr.py [--classes crash,hang,...] [--baselines sbatch,torchrun,ft]
                               [--skip-baseline] [--skip-goodput] [--repeats 1]
                               [--goodput-minutes 10] [--ft-launcher PATH] [--snapshot]

Every wait has a deadline; jobs are cancelled and nodes restored in ``finally`` blocks. Ends with
exactly one line ``RESULT key=value ...``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)  # run as a script from anywhere: import the checkout's slurmkit

from slurmkit.slurm.hostlist import expand_hostlist  # noqa: E402
from testkit.slurm_build import cluster_environ  # noqa: E402
from slurmkit.ledger.ledger import Ledger, read_ledger  # noqa: E402
from slurmkit.ledger.summary import summarize  # noqa: E402
from slurmkit.train.heartbeat import local_heartbeat_path  # noqa: E402

CLASSES = ("crash", "hang", "nccl", "node_spare", "node_requeue")
BASELINES = ("sbatch", "torchrun", "ft")
EXPECTED_CLS = {"crash": "rank_crash", "hang": "hang", "nccl": "nccl_error",
                "node_spare": "node_loss", "node_requeue": "node_loss"}
HEARTBEAT_TIMEOUT_S, PG_TIMEOUT_S = 8, 60
STEPS, INTERVAL, FAULT_STEP, NCCL_STEP = 40, 10, 13, 15
# supervisor.warm_standby_after_s: the faults come ~15 s into a run; with the default (60 s) the
# first restart of a generation younger than a minute starts its ranks cold (--cold: all cold).
COMMON = ["+exp=tiny", f"train.steps={STEPS}", f"train.ckpt_interval_steps={INTERVAL}",
          "+job.env.SLURMKIT_STEP_DELAY_S=0.25", f"parallel.pg_timeout_s={PG_TIMEOUT_S}",
          f"supervisor.heartbeat_timeout_s={HEARTBEAT_TIMEOUT_S}", "supervisor.warm_standby_after_s=5"]
# Targets: detection (crash; hang = heartbeat timeout + 2) and time to resume per path.
TARGET_DETECT_S = {"crash": 2.0, "hang": HEARTBEAT_TIMEOUT_S + 2.0}
# Issue 11's targets where it sets one (a crash resumed in 5 s, a node lost onto a spare in 10 s).
TARGET_RESUME_S = {"crash": 5.0, "hang": 20.0, "nccl": 20.0, "node_spare": 10.0, "node_requeue": 45.0}
START_DEADLINE_S = 300.0  # submit -> the faulted rank reached FAULT_STEP (queue + ~20 s start)
RESUME_DEADLINE_S = {"slurmkit": 180.0, "baseline": 420.0}  # fault -> train_resumed
NODE_BACK_DEADLINE_S = 120.0
T = TypeVar("T")
DEFAULT_CLUSTER_DIR = os.environ.get("SLURMKIT_CLUSTER_DIR", "/tmp/slurmkit-cluster")


class BenchError(RuntimeError):
    """A job did not get where it had to within its deadline; the message says where."""


@dataclass
class Measure:
    """One fault in one run: seconds from the fault to detection and to resumed training."""
    detect_s: float | None
    resume_s: float | None
    note: str = ""
    job: str = ""
    run_dir: str = ""


@dataclass
class ClassResult:
    slurmkit: list[Measure] = field(default_factory=list)
    baselines: dict[str, list[Measure]] = field(default_factory=dict)  # variant -> its runs


# ------------------------------------------------------------------ cluster plumbing

class Cluster:
    """The local cluster's commands with this bench's environment; every call has a timeout."""

    def __init__(self, env: Mapping[str, str], clock: Callable[[], float] = time.time,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.env, self.clock, self.sleep = dict(env), clock, sleep
        self.killed: set[str] = set()  # nodes this bench took down and has not restored yet

    def run(self, cmd: Sequence[str], timeout_s: float = 60, cwd: str | None = None,
            check: bool = False) -> subprocess.CompletedProcess[str]:
        res = subprocess.run(list(cmd), env=self.env, cwd=cwd, capture_output=True, text=True,
                             timeout=timeout_s, check=False)
        if check and res.returncode != 0:
            last = (res.stderr.strip() or res.stdout.strip() or "no output").splitlines()[-1]
            raise BenchError(f"{' '.join(cmd)} exited {res.returncode}: {last}\n{res.stdout}{res.stderr}")
        return res

    def job_field(self, job: str, fmt: str) -> str | None:
        """One squeue field (%T state, %N nodes) of a job; '' once it left the queue, None when
        squeue itself failed (a busy controller: ask again)."""
        res = self.run(["squeue", "-h", "-j", job, "-o", fmt], timeout_s=30)
        if res.returncode != 0:
            return "" if "Invalid job id" in res.stderr else None
        return res.stdout.strip()

    def restore_all(self) -> None:
        for node in sorted(self.killed):
            self.restore_node(node)

    def cancel(self, job: str, run_dir: str = "") -> None:
        """Cancel ``job`` and the successor jobs the run was handed to (a requeue that excludes
        a node hands the run to a new job: slurmkit.supervise.exits.successor)."""
        for one in chain(job, run_dir):
            self.run(["scancel", one], timeout_s=60)

    def wait_gone(self, job: str, deadline_s: float = 90.0) -> None:
        end = self.clock() + deadline_s
        while job and self.clock() < end and self.job_field(job, "%T") != "":
            self.sleep(0.5)

    def kill_node(self, node: str) -> None:
        self.killed.add(node)  # before the kill: a half-failed kill is still restored
        self.run(local_cluster("kill-node", node), check=True)

    def restore_node(self, node: str) -> None:
        """Start the node's slurmd again and wait until Slurm schedules on it (resume if DOWN)."""
        self.run(local_cluster("start-node", node))
        end = self.clock() + NODE_BACK_DEADLINE_S
        while self.clock() < end:
            state = self.run(["sinfo", "-h", "-N", "-n", node, "-o", "%T"], timeout_s=30).stdout.strip()
            if state.startswith(("idle", "mix", "alloc")) and "*" not in state:
                self.killed.discard(node)
                return
            if "down" in state or "drain" in state:
                self.run(["scontrol", "update", f"nodename={node}", "state=resume"], timeout_s=30)
            self.sleep(1.0)
        raise BenchError(f"{node} did not come back within {NODE_BACK_DEADLINE_S:.0f} s: restore it "
                         f"with `tools/local-cluster start-node {node}` and "
                         f"`scontrol update nodename={node} state=resume`")


def chain(job: str, run_dir: str) -> list[str]:
    """``job`` and every job the run went on in after it (the ledger's successor events)."""
    from slurmkit.supervise.exits.successor import successor_chain

    if not job:
        return []
    return successor_chain(run_dir, job) if run_dir else [job]


def local_cluster(*args: str) -> list[str]:
    """tools/local-cluster run by this Python: on a node loss it reads the node's runs through
    slurmkit (their NVMe directories), which the ``python3`` first on PATH may lack (then it
    exits 1 with ModuleNotFoundError and no node is lost)."""
    return [sys.executable, os.path.join(REPO, "tools", "local-cluster"), *args]


def load_env(path: str) -> dict[str, str]:
    if not os.path.exists(path):
        raise BenchError(f"no cluster environment at {path}: run `tools/local-cluster up` first")
    with open(path) as f:
        cluster = json.load(f)
    return {**cluster_environ(cluster), "PYTHONUNBUFFERED": "1"}


# ------------------------------------------------------------------ reading a run

def events(run_dir: str, name: str, after: float = float("-inf")) -> list[dict]:
    return [e for e in read_ledger(os.path.join(run_dir, "ledger.jsonl"))
            if e.get("event") == name and float(e["t"]) >= after]


def heartbeat(run_dir: str, rank: int) -> dict:
    """A slurmkit rank, and one under torchrun or ft_launcher, beats into this machine's
    node-local directory (the emulated nodes share it); the sbatch baseline's script names a file
    in its run directory."""
    for path in (local_heartbeat_path(run_dir, rank), os.path.join(run_dir, "heartbeat", f"rank{rank}.json")):
        try:
            with open(path) as f:
                return dict(json.load(f))
        except (OSError, ValueError):  # not written yet, or caught mid-replace
            continue
    return {}


def wait_for(what: str, probe: Callable[[], T | None], deadline_s: float, clock: Callable[[], float],
             sleep: Callable[[float], None], poll_s: float = 0.1) -> T:
    """Poll ``probe`` until it returns something truthy; BenchError after ``deadline_s``."""
    end = clock() + deadline_s
    while clock() < end:
        got = probe()
        if got:
            return got
        sleep(poll_s)
    raise BenchError(f"timed out after {deadline_s:.0f} s waiting for {what}")


def wait_step(c: Cluster, run_dir: str, rank: int, step: int, generation: int | None = None,
              deadline_s: float = START_DEADLINE_S) -> dict:
    """The heartbeat of ``rank`` once it reached ``step`` (in ``generation`` when given)."""
    def probe() -> dict:
        hb = heartbeat(run_dir, rank)
        ok = int(hb.get("step", -1)) >= step and generation in (None, hb.get("generation"))
        return hb if ok else {}
    return wait_for(f"rank {rank} at step {step} in {run_dir}", probe, deadline_s, c.clock, c.sleep)


def first_event(c: Cluster, run_dir: str, name: str, after: float, deadline_s: float) -> dict:
    def probe() -> dict:
        found = events(run_dir, name, after)
        return found[0] if found else {}
    return wait_for(f"{name} in {run_dir}", probe, deadline_s, c.clock, c.sleep, 0.2)


def mark_fault(run_dir: str, kind: str, when: float, **fields: object) -> None:
    Ledger(os.path.join(run_dir, "ledger.jsonl"), source="bench").append(
        "fault_injected", kind=kind, time=when, **fields)


def nccl_fault_time(c: Cluster, run_dir: str, deadline_s: float = START_DEADLINE_S) -> float:
    """When rank 2 fired its nccl_abort: the once-marker is created just before the abort."""
    path = os.path.join(run_dir, "faults", f"nccl_abort-rank2-step{NCCL_STEP}.fired")
    wait_for(f"the nccl_abort marker {path}", lambda: os.path.exists(path), deadline_s,
             c.clock, c.sleep)
    return os.stat(path).st_mtime


# ------------------------------------------------------------------ slurmkit

def submit_slurmkit(c: Cluster, args: Sequence[str], root: str) -> tuple[str, str]:
    res = c.run([sys.executable, "-m", "slurmkit.submit", *args, f"submit.run_root={root}"],
                timeout_s=180, cwd=root)
    job = re.search(r"job (\S+) \(slurm\)", res.stdout)
    run_dir = re.search(r"run directory : (\S+)", res.stdout)
    if res.returncode != 0 or not job or not run_dir:
        raise BenchError(f"slurmkit.submit failed ({res.returncode}):\n{res.stdout}{res.stderr[-3000:]}")
    return job.group(1), run_dir.group(1)


def inject_slurmkit(c: Cluster, cls: str, run_dir: str) -> tuple[float, str]:
    """Wait for the fault step, inject the fault; (fault epoch time, node killed or '')."""
    if cls == "nccl":
        when = nccl_fault_time(c, run_dir)
        mark_fault(run_dir, "nccl_abort", when, rank=2, step=NCCL_STEP)
        return when, ""
    rank = 1 if cls == "hang" else 3
    step = int(wait_step(c, run_dir, rank, FAULT_STEP)["step"])
    if cls in ("crash", "hang"):
        pid = [e["pids"][e["ranks"].index(rank)] for e in events(run_dir, "ranks_started")
               if rank in e["ranks"]][-1]
        when = c.clock()
        os.kill(int(pid), signal.SIGKILL if cls == "crash" else signal.SIGSTOP)
        mark_fault(run_dir, "sigkill" if cls == "crash" else "sigstop", when, rank=rank, step=step)
        return when, ""
    start = events(run_dir, "allocation_start")[-1]
    node = start["train_nodes" if cls == "node_spare" else "nodes"][1]
    when = c.clock()
    c.kill_node(node)
    mark_fault(run_dir, "node_loss", when, node=node, step=step)
    return when, node


def measure_slurmkit(c: Cluster, cls: str, root: str, tag: str) -> Measure:
    args = [*COMMON, f"job.name=mttr-sk-{cls}-{tag}"]
    if cls == "nccl":
        args.append(f"+job.env.SLURMKIT_FAULT=nccl_abort:2:{NCCL_STEP}:once")
    if cls == "node_spare":
        args.append("supervisor.spare_nodes=1")
    job, run_dir = "", ""
    try:
        job, run_dir = submit_slurmkit(c, args, root)
        fault_t, _node = inject_slurmkit(c, cls, run_dir)
        failure = first_event(c, run_dir, "failure", fault_t - 1.0, RESUME_DEADLINE_S["slurmkit"])
        resumed = first_event(c, run_dir, "train_resumed", fault_t, RESUME_DEADLINE_S["slurmkit"])
        note = f"{failure.get('cls')}/{next(iter(d['action'] for d in events(run_dir, 'decision', fault_t - 1)), '?')}"
        if failure.get("cls") != EXPECTED_CLS[cls]:
            note += f" MISCLASSIFIED (expected {EXPECTED_CLS[cls]})"
        return Measure(float(failure["t"]) - fault_t, float(resumed["t"]) - fault_t, note, job, run_dir)
    except BenchError as e:
        return Measure(None, None, f"FAILED: {str(e).splitlines()[0]}", job, run_dir)
    finally:
        c.cancel(job, run_dir)
        c.restore_all()
        c.wait_gone((chain(job, run_dir) or [job])[-1])


# ------------------------------------------------------------------ baseline: sbatch + srun + requeue

BASELINE_SCRIPT = """#!/bin/bash
#SBATCH --job-name={name}
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=2
#SBATCH --time=00:15:00
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output={run_dir}/logs/baseline_%j.out
# The same training job without slurmkit: plain srun, and requeue when it fails.
export SLURMKIT_RUN_DIR={run_dir}
export SLURMKIT_CONFIG={run_dir}/config.yaml
export SLURMKIT_LEDGER={run_dir}/ledger.jsonl
export SLURMKIT_STEP_DELAY_S=0.25
{fault_env}export MASTER_ADDR=127.0.0.1
export MASTER_PORT=$(( 20000 + (SLURM_JOB_ID * 4 + ${{SLURM_RESTART_COUNT:-0}}) % 20000 ))
export WORLD_SIZE=$SLURM_NTASKS LOCAL_WORLD_SIZE=$SLURM_NTASKS_PER_NODE
echo "start $(date +%s.%N) restart=${{SLURM_RESTART_COUNT:-0}}" >> {run_dir}/baseline_events.txt
srun --kill-on-bad-exit=1 --cpu-bind=none bash -c 'export RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID \\
  SLURMKIT_NODE=$SLURMD_NODENAME SLURMKIT_HEARTBEAT_FILE=$SLURMKIT_RUN_DIR/heartbeat/rank$SLURM_PROCID.json
  exec {python} -u -m slurmkit.train > $SLURMKIT_RUN_DIR/logs/rank$SLURM_PROCID.log 2>&1'
rc=$?
echo "srun_end $(date +%s.%N) rc=$rc" >> {run_dir}/baseline_events.txt
if [ $rc -ne 0 ]; then
  scontrol requeue $SLURM_JOB_ID
fi
exit $rc
"""


def freeze_config(c: Cluster, name: str, root: str) -> str:
    """The run directory of ``name`` with its frozen config.yaml (``submit.emit=sbatch``: written,
    not submitted), for a baseline that runs the same training without slurmkit."""
    res = c.run([sys.executable, "-m", "slurmkit.submit", *COMMON, f"job.name={name}",
                 "submit.emit=sbatch", f"submit.run_root={root}"], timeout_s=180, cwd=root)
    m = re.search(r"wrote (\S+)/job\.sbatch", res.stdout)
    if res.returncode != 0 or not m:
        raise BenchError(f"submit.emit=sbatch failed ({res.returncode}):\n{res.stdout}{res.stderr[-3000:]}")
    return m.group(1)


def fault_env(cls: str) -> str:
    return f"export SLURMKIT_FAULT=nccl_abort:2:{NCCL_STEP}:once\n" if cls == "nccl" else ""


def write_baseline(c: Cluster, cls: str, root: str, tag: str) -> tuple[str, str]:
    """Freeze the config and write the plain sbatch + srun script; (script, run dir)."""
    name = f"mttr-bl-{cls}-{tag}"
    run_dir = freeze_config(c, name, root)
    path = os.path.join(run_dir, "baseline.sbatch")
    with open(path, "w") as f:
        f.write(BASELINE_SCRIPT.format(name=name, run_dir=run_dir, fault_env=fault_env(cls),
                                       python=sys.executable))
    return path, run_dir


def srun_end_after(run_dir: str, after: float) -> float | None:
    try:
        with open(os.path.join(run_dir, "baseline_events.txt")) as f:
            ends = [float(ln.split()[1]) for ln in f if ln.startswith("srun_end ")]
    except OSError:
        return None
    return next((t for t in ends if t >= after), None)


def inject_baseline(c: Cluster, cls: str, job: str, run_dir: str) -> tuple[float, str]:
    if cls == "nccl":
        return nccl_fault_time(c, run_dir), ""
    rank = 1 if cls == "hang" else 3
    hb = wait_step(c, run_dir, rank, FAULT_STEP)
    if cls in ("crash", "hang"):
        when = c.clock()
        os.kill(int(hb["pid"]), signal.SIGKILL if cls == "crash" else signal.SIGSTOP)
        return when, ""
    node = expand_hostlist(c.job_field(job, "%N") or "")[1]
    when = c.clock()
    c.kill_node(node)
    return when, node


def baseline_detect(c: Cluster, job: str, run_dir: str, fault_t: float, deadline_s: float,
                    noticed: Callable[[], float | None] = lambda: None) -> float:
    """Fault -> srun returned (the script logs it), the job left RUNNING or ``noticed`` (a
    launcher's own log of the failure), whichever first."""
    def probe() -> float:
        state = c.job_field(job, "%T")
        if state is not None and state != "RUNNING":
            return c.clock()
        return srun_end_after(run_dir, fault_t) or noticed() or 0.0
    left = wait_for(f"baseline job {job} to notice the fault", probe, deadline_s, c.clock, c.sleep, 0.25)
    return max(0.0, min(t for t in (left, srun_end_after(run_dir, fault_t), noticed()) if t) - fault_t)


def measure_baseline(c: Cluster, cls: str, root: str, tag: str) -> Measure:
    job, run_dir = "", ""
    try:
        script, run_dir = write_baseline(c, cls, root, tag)
        job = c.run(["sbatch", "--parsable", script], check=True).stdout.strip().split(";")[0]
        fault_t, _node = inject_baseline(c, cls, job, run_dir)
        detect = baseline_detect(c, job, run_dir, fault_t, PG_TIMEOUT_S + 90.0)
        resumed = first_event(c, run_dir, "train_resumed", fault_t, RESUME_DEADLINE_S["baseline"])
        how = "Slurm NODE_FAIL requeue" if cls == "node" else "srun + scontrol requeue"
        return Measure(detect, float(resumed["t"]) - fault_t, how, job, run_dir)
    except BenchError as e:
        return Measure(None, None, f"FAILED: {str(e).splitlines()[0]}", job, run_dir)
    finally:
        c.cancel(job)
        c.restore_all()
        c.wait_gone(job)


# ------------------------------------------------------------------ baselines: torchrun, ft_launcher

LAUNCHER_SCRIPT = """#!/bin/bash
#SBATCH --job-name={name}
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=2
#SBATCH --time=00:15:00
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output={run_dir}/logs/{variant}_%j.out
# The same training job under an elastic launcher: one launcher per node (srun) starts that node's
# two ranks and restarts every rank of the job when one fails, up to {max_restarts} times; when it
# gives up (or srun fails), requeue.
export SLURMKIT_RUN_DIR={run_dir}
export SLURMKIT_CONFIG={run_dir}/config.yaml
export SLURMKIT_LEDGER={run_dir}/ledger.jsonl
export SLURMKIT_STEP_DELAY_S=0.25
# Without this the workers share the rendezvous store, keyed by a restart count that each agent
# keeps for itself: an agent that restarts for the other node's failure (not its own) keeps its
# count, its ranks read the previous attempt's addresses and the restart dies in gloo's
# connectFullMesh (connection refused), every time on the local cluster (pytorch issue 135712).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
{fault_env}export RDZV_PORT=$(( 20000 + (SLURM_JOB_ID * 4 + ${{SLURM_RESTART_COUNT:-0}}) % 20000 ))
echo "start $(date +%s.%N) restart=${{SLURM_RESTART_COUNT:-0}}" >> {run_dir}/baseline_events.txt
srun --kill-on-bad-exit=1 --cpu-bind=none --output={run_dir}/logs/{variant}_%j_node%n.log \\
  bash -c 'export SLURMKIT_NODE=$SLURMD_NODENAME
  is_host=$([ "$SLURM_NODEID" = 0 ] && echo 1 || echo 0)
  exec {launcher} --nnodes=2 --nproc-per-node=2 --max-restarts={max_restarts} \\
    --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:$RDZV_PORT --rdzv-id=$SLURM_JOB_ID \\
    --rdzv-conf=is_host=$is_host --local-addr=127.0.0.1 {extra}--no-python {python} -m slurmkit.train'
rc=$?
echo "srun_end $(date +%s.%N) rc=$rc" >> {run_dir}/baseline_events.txt
if [ $rc -ne 0 ]; then
  scontrol requeue $SLURM_JOB_ID
fi
exit $rc
"""
LAUNCHER_MAX_RESTARTS = 3
# Lines a launcher logs when it notices a failed worker (torch.distributed.elastic's agent; the
# ft_launcher's is the same agent with its own log format).
LAUNCHER_FAILURE_MARKS = ("failed (exitcode", "closing signal", "Worker group FAILED",
                          "Worker group UNHEALTHY")
GLOG_TIME = re.compile(r"^[IWEF](\d\d)(\d\d) (\d\d):(\d\d):(\d\d(?:\.\d+)?) ")  # torch: E1203 06:45:33.312000
NVRX_TIME = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3})\] ")  # [2026-12-03 06:43:55,280]
HANG_NOTES = {
    "torchrun": "torchrun has no hang detection: the process-group timeout ended the hang",
    "ft": "ft_launcher sees hangs only through heartbeats the program sends with its "
          "RankMonitorClient (python -m slurmkit.train sends none): the process-group timeout "
          "ended the hang",
}


@dataclass
class Launcher:
    """An elastic launcher baseline: its command, or None with the reason it cannot run here."""
    variant: str  # "torchrun" or "ft"
    path: str | None
    about: str  # the version when found, else why not
    extra: str = ""  # launcher-specific arguments, each followed by a space


def launcher_time(line: str, year: int) -> float | None:
    """Epoch seconds of a launcher log line (local time, as both formats are written); torch's
    glog-style prefix has no year: ``year`` is the fault's."""
    if m := GLOG_TIME.match(line):
        month, day, hh, mm, ss = m.groups()
        whole = time.mktime((year, int(month), int(day), int(hh), int(mm), 0, 0, 0, -1))
        return whole + float(ss)
    if m := NVRX_TIME.match(line):
        whole = time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S"))
        return whole + int(m.group(2)) / 1000.0
    return None


def launcher_failure_after(run_dir: str, variant: str, after: float) -> float | None:
    """The first time after ``after`` that a launcher of the run logged a failed worker."""
    year = time.localtime(after).tm_year
    logs = os.path.join(run_dir, "logs")
    found: list[float] = []
    for name in sorted(os.listdir(logs)) if os.path.isdir(logs) else []:
        if not (name.startswith(f"{variant}_") and "_node" in name):
            continue
        with open(os.path.join(logs, name), errors="replace") as f:
            for line in f:
                if any(mark in line for mark in LAUNCHER_FAILURE_MARKS):
                    t = launcher_time(line, year)
                    if t is not None and t >= after - 0.001:  # ft_launcher stamps in ms
                        found.append(t)
                        break
    return min(found) if found else None


def _runs(cmd: Sequence[str], timeout_s: float = 120) -> subprocess.CompletedProcess[str] | str:
    try:
        return subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)


def find_launcher(variant: str, explicit: str | None = None) -> Launcher:
    """torchrun (beside this Python, else PATH) or ft_launcher (--ft-launcher, PATH, beside this
    Python); a launcher that is missing or whose ``--help`` fails is unavailable, with the reason."""
    exe = {"torchrun": "torchrun", "ft": "ft_launcher"}[variant]
    beside = os.path.join(os.path.dirname(sys.executable), exe)
    path = explicit or (beside if os.access(beside, os.X_OK) else None) or shutil.which(exe)
    hint = ("pip install torch" if variant == "torchrun" else
            "pip install -e '.[ft]' (nvidia-resiliency-ext) or pass --ft-launcher PATH")
    if not path or not os.access(path, os.X_OK):
        where = explicit or f"not beside {sys.executable} nor on PATH"
        return Launcher(variant, None, f"{exe} not found ({where}): {hint}")
    got = _runs([path, "--help"])
    if isinstance(got, str) or got.returncode != 0:
        why = got if isinstance(got, str) else (got.stderr.strip().splitlines() or ["no output"])[-1]
        return Launcher(variant, None, f"`{path} --help` failed: {why}")
    dist = "torch" if variant == "torchrun" else "nvidia-resiliency-ext"
    with open(path, errors="replace") as f:
        first = f.readline()
    shebang = first[2:].strip() if first.startswith("#!") else ""
    ver = _runs([shebang or sys.executable, "-c",
                 f"import importlib.metadata as m; print(m.version({dist!r}))"]) if shebang else ""
    version = ver.stdout.strip() if isinstance(ver, subprocess.CompletedProcess) else ""
    extra = "--ignore-missing-fault-tol-cfg " if variant == "ft" else ""
    return Launcher(variant, path, f"{dist} {version or '?'}", extra)


def write_launcher(c: Cluster, launcher: Launcher, cls: str, root: str, tag: str) -> tuple[str, str]:
    name = f"mttr-{launcher.variant}-{cls}-{tag}"
    run_dir = freeze_config(c, name, root)
    path = os.path.join(run_dir, f"{launcher.variant}.sbatch")
    with open(path, "w") as f:
        f.write(LAUNCHER_SCRIPT.format(name=name, run_dir=run_dir, variant=launcher.variant,
                                       fault_env=fault_env(cls), launcher=launcher.path,
                                       max_restarts=LAUNCHER_MAX_RESTARTS, extra=launcher.extra,
                                       python=sys.executable))
    return path, run_dir


def requeued_after(run_dir: str, after: float) -> bool:
    """Whether the launcher job started again (a requeue) after ``after``."""
    try:
        with open(os.path.join(run_dir, "baseline_events.txt")) as f:
            return any(float(ln.split()[1]) >= after for ln in f if ln.startswith("start "))
    except OSError:
        return False


def measure_launcher(c: Cluster, launcher: Launcher, cls: str, root: str, tag: str) -> Measure:
    """Detection: fault -> a launcher logged the failed worker, srun returned or the job left
    RUNNING (whichever first); resume: fault -> ``train_resumed``."""
    job, run_dir = "", ""
    try:
        script, run_dir = write_launcher(c, launcher, cls, root, tag)
        job = c.run(["sbatch", "--parsable", script], check=True).stdout.strip().split(";")[0]
        fault_t, _node = inject_baseline(c, cls, job, run_dir)
        detect = baseline_detect(c, job, run_dir, fault_t, PG_TIMEOUT_S + 90.0,
                                 lambda: launcher_failure_after(run_dir, launcher.variant, fault_t))
        resumed = first_event(c, run_dir, "train_resumed", fault_t, RESUME_DEADLINE_S["baseline"])
        how = ("Slurm requeue" if requeued_after(run_dir, fault_t)
               else f"{launcher.variant} restart in the allocation")
        if cls == "hang":
            how += f"; {HANG_NOTES[launcher.variant]}"
        return Measure(detect, float(resumed["t"]) - fault_t, how, job, run_dir)
    except BenchError as e:
        return Measure(None, None, f"FAILED: {str(e).splitlines()[0]}", job, run_dir)
    finally:
        c.cancel(job, run_dir)
        c.restore_all()
        c.wait_gone((chain(job, run_dir) or [job])[-1])


# ------------------------------------------------------------------ goodput over a long run

def fresh_generation(run_dir: str, after: float) -> tuple[int] | None:
    """(generation,) training runs in again after ``after``; None while it restarts."""
    started = events(run_dir, "train_started", after)
    ranks = events(run_dir, "ranks_started")
    return (int(ranks[-1]["generation"]),) if started and ranks else None


def goodput_fault(c: Cluster, run_dir: str, kind: str, since: float) -> tuple[float, str]:
    """Inject ``kind`` once training runs again after ``since``; (fault time, node killed or '')."""
    (gen,) = wait_for(f"training to run again in {run_dir}", lambda: fresh_generation(run_dir, since),
                   RESUME_DEADLINE_S["slurmkit"], c.clock, c.sleep, 0.5)
    rank = 1 if kind == "hang" else 3
    restored = int(events(run_dir, "train_started")[-1].get("step") or 0)
    step = int(wait_step(c, run_dir, rank, restored + 2, gen, 120.0)["step"])
    started = [e for e in events(run_dir, "ranks_started") if rank in e["ranks"]][-1]
    when = c.clock()
    if kind == "node_loss":
        c.kill_node(started["node"])
        mark_fault(run_dir, kind, when, node=started["node"], step=step)
        return when, str(started["node"])
    os.kill(int(started["pids"][started["ranks"].index(rank)]),
            signal.SIGKILL if kind == "crash" else signal.SIGSTOP)
    mark_fault(run_dir, "sigkill" if kind == "crash" else "sigstop", when, rank=rank, step=step)
    return when, ""


def run_goodput(c: Cluster, root: str, minutes: float) -> tuple[float | None, str]:
    """One run of ``minutes`` with a crash, a hang and a node loss; (goodput, report text)."""
    limit = int(minutes + 6)
    args = ["+exp=tiny", "train.steps=1000000", f"train.ckpt_interval_steps={INTERVAL}",
            "+job.env.SLURMKIT_STEP_DELAY_S=0.25", f"parallel.pg_timeout_s={PG_TIMEOUT_S}",
            f"supervisor.heartbeat_timeout_s={HEARTBEAT_TIMEOUT_S}", "supervisor.spare_nodes=1",
            f"job.time={limit // 60:02d}:{limit % 60:02d}:00", "job.name=mttr-goodput"]
    job, run_dir = "", ""
    try:
        job, run_dir = submit_slurmkit(c, args, root)
        t0, span = c.clock(), minutes * 60.0
        since = t0
        for i, kind in enumerate(("crash", "hang", "node_loss"), start=1):
            c.sleep(max(0.0, t0 + span * i / 4 - c.clock()))  # the run trains on meanwhile
            when, node = goodput_fault(c, run_dir, kind, since)
            since = float(first_event(c, run_dir, "failure", when - 1.0, 120.0)["t"])
            if node:
                c.restore_node(node)  # the job runs on its spare; give the cluster its node back
        c.sleep(max(0.0, t0 + span - c.clock()))
        cut, state = c.clock(), c.job_field(job, "%T")
    except BenchError as e:
        return None, f"goodput run FAILED: {e}\n  run dir {run_dir}"
    finally:
        c.cancel(job, run_dir)
        c.restore_all()
        c.wait_gone((chain(job, run_dir) or [job])[-1])
    kept = [e for e in read_ledger(os.path.join(run_dir, "ledger.jsonl")) if float(e["t"]) <= cut]
    # The window ends at the cut, not at the last event: a job that died early must not shorten
    # the wall time its goodput is divided by (an in-memory marker; nothing is written).
    rep = summarize([*kept, {"t": cut, "event": "bench_window_end", "source": "bench"}])
    lines = [f"goodput run {job} ({run_dir}): wall {rep.wall_s:.0f} s, productive {rep.productive_s:.0f} s, "
             f"goodput {rep.goodput:.3f}, final step {rep.final_step}, steps lost {rep.steps_lost}"]
    if state != "RUNNING":  # the job died before the cut: say so, the figures include it
        sacct = c.run(["sacct", "-X", "-n", "-P", "-j", job, "-o", "State,ExitCode,End"]).stdout.split()
        lines.append(f"  job {job} was no longer running at the end ({state or 'gone'}; sacct "
                     f"{' '.join(sacct) or '?'}): the rest of the time counts as lost")
    for f in rep.failures:
        lines.append(f"  {f.cls:10s} rank {f.rank} {f.node:6s} -> {f.action}: detect "
                     f"{_fmt(f.detection_s)} s, restore {_fmt(f.restore_s)} s, steps lost {f.steps_lost}")
    return rep.goodput, "\n".join(lines)


# ------------------------------------------------------------------ reporting

def _fmt(v: float | None, width: int = 0) -> str:
    return f"{'na':>{width}s}" if v is None else f"{v:{width}.2f}"


def med(ms: Sequence[Measure], attr: str) -> float | None:
    vals = [getattr(m, attr) for m in ms if getattr(m, attr) is not None]
    return statistics.median(vals) if vals else None


def ratio(base: float | None, ours: float | None) -> str:
    return "na" if base is None or not ours else f"{base / ours:.1f}x"


def verdict(value: float | None, target: float | None) -> str:
    if target is None:
        return "-"
    return "MISS (no value)" if value is None else ("ok" if value <= target else "MISS")


def print_table(results: dict[str, ClassResult], unavailable: Mapping[str, str]) -> None:
    print(f"\n{'class':13s} {'variant':9s} {'detect s':>9s} {'resume s':>9s}  runs / note")
    for cls, r in results.items():
        d, res = med(r.slurmkit, "detect_s"), med(r.slurmkit, "resume_s")
        print(f"{cls:13s} {'slurmkit':9s} {_fmt(d, 9)} {_fmt(res, 9)}  n={len(r.slurmkit)} "
              f"{'; '.join(sorted({m.note for m in r.slurmkit}))}")
        for variant, ms in r.baselines.items():
            if variant in unavailable:
                print(f"{'':13s} {variant:9s} {'na':>9s} {'na':>9s}  unavailable: {unavailable[variant]}")
                continue
            bd, bres = med(ms, "detect_s"), med(ms, "resume_s")
            print(f"{'':13s} {variant:9s} {_fmt(bd, 9)} {_fmt(bres, 9)}  n={len(ms)} "
                  f"{'; '.join(sorted({m.note for m in ms}))}")
            print(f"{'':13s} {'ratio':9s} {ratio(bd, d):>9s} {ratio(bres, res):>9s}  ({variant} / slurmkit)")
        td, tr = TARGET_DETECT_S.get(cls), TARGET_RESUME_S[cls]
        print(f"{'':13s} {'target':9s} {verdict(d, td) + (f' <={td:.0f}' if td else ''):>9s} "
              f"{verdict(res, tr) + f' <={tr:.0f}':>9s}")


def result_line(results: dict[str, ClassResult], goodput: float | None,
                unavailable: Mapping[str, str] | None = None, warm: bool = True) -> str:
    """``{cls}_baseline_resume_s`` is the sbatch baseline's (the key older runs have);
    ``mttr_vs_{variant}_{cls}`` = the baseline's time to resume / slurmkit's."""
    parts = []
    for cls, r in results.items():
        res = med(r.slurmkit, "resume_s")
        parts += [f"{cls}_detect_s={_fmt(med(r.slurmkit, 'detect_s'))}", f"{cls}_resume_s={_fmt(res)}",
                  f"{cls}_baseline_resume_s={_fmt(med(r.baselines.get('sbatch', []), 'resume_s'))}"]
        for variant, ms in r.baselines.items():
            bres = med(ms, "resume_s")
            if variant != "sbatch":
                parts += [f"{cls}_{variant}_detect_s={_fmt(med(ms, 'detect_s'))}",
                          f"{cls}_{variant}_resume_s={_fmt(bres)}"]
            times = "na" if bres is None or not res else f"{bres / res:.2f}"
            parts.append(f"mttr_vs_{variant}_{cls}={times}")
    parts += [f"{variant}_available=no" for variant in sorted(unavailable or {})]
    parts.append(f"goodput={'na' if goodput is None else f'{goodput:.4f}'}")
    parts.append(f"warm_standby={'yes' if warm else 'no'}")
    return "RESULT " + " ".join(parts)


def print_measure(cls: str, variant: str, i: int, m: Measure) -> None:
    print(f"{cls:13s} {variant:9s} #{i} detect {_fmt(m.detect_s)} s  resume {_fmt(m.resume_s)} s  "
          f"job {m.job or '-'} {m.note}  {m.run_dir}", flush=True)


# ------------------------------------------------------------------ main

def run_classes(c: Cluster, classes: Sequence[str], repeats: int, variants: Sequence[str],
                launchers: Mapping[str, Launcher], root: str) -> dict[str, ClassResult]:
    """Every class with slurmkit, then with each available baseline in ``variants``; one
    baseline node-loss run serves both node classes (the baselines have no spare)."""
    results = {cls: ClassResult(baselines={v: [] for v in variants}) for cls in classes}
    for i in range(1, repeats + 1):
        node_runs: dict[str, Measure] = {}
        for cls in classes:
            m = measure_slurmkit(c, cls, root, f"{i}")
            results[cls].slurmkit.append(m)
            print_measure(cls, "slurmkit", i, m)
            kind = "node" if cls.startswith("node") else cls
            for variant in variants:
                launcher = launchers.get(variant)
                if variant != "sbatch" and (launcher is None or launcher.path is None):
                    continue
                if kind == "node" and variant in node_runs:
                    results[cls].baselines[variant].append(node_runs[variant])
                    continue
                b = (measure_baseline(c, kind, root, f"{i}") if launcher is None
                     else measure_launcher(c, launcher, kind, root, f"{i}"))
                if kind == "node":
                    node_runs[variant] = b
                results[cls].baselines[variant].append(b)
                print_measure(cls, variant, i, b)
    return results


def snapshot(root: str) -> str:
    """Export git HEAD to ROOT/src; returns that directory (its slurmkit, conf/, templates)."""
    src = os.path.join(root, "src")
    os.makedirs(src)
    rev = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True,
                         text=True, timeout=60, check=True).stdout.strip()
    with subprocess.Popen(["git", "-C", REPO, "archive", "--format=tar", "HEAD"],
                          stdout=subprocess.PIPE) as git:
        subprocess.run(["tar", "-x", "-C", src], stdin=git.stdout, check=True, timeout=120)
    if git.returncode != 0:
        raise BenchError(f"git archive HEAD failed ({git.returncode})")
    print(f"slurmkit snapshot: git HEAD {rev} in {src}", flush=True)
    return src


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--classes", default=",".join(CLASSES),
                    help=f"comma-separated subset of {','.join(CLASSES)} (default: all)")
    ap.add_argument("--baselines", default="sbatch,torchrun",
                    help=f"comma-separated subset of {','.join(BASELINES)} to measure against "
                         "(default: sbatch,torchrun; ft = nvidia-resiliency-ext's ft_launcher: when "
                         "listed, measured if installed, else reported unavailable with the reason; '' = none). "
                         "On the local cluster each launcher baseline adds about 1 min for a crash "
                         "or nccl class, 3 min for the hang and 4 min for the node loss; sbatch "
                         "about 4 min per class (Slurm holds a requeued job ~120 s)")
    ap.add_argument("--skip-baseline", action="store_true", help="measure slurmkit only (--baselines '')")
    ap.add_argument("--ft-launcher", default=None,
                    help="the ft_launcher to run (default: beside this Python, else on PATH)")
    ap.add_argument("--skip-goodput", action="store_true", help="no long goodput run")
    ap.add_argument("--cold", action="store_true",
                    help="slurmkit without warm standby ranks (supervisor.warm_standby=false): every "
                         "restart starts Python and imports torch again, as before the standbys")
    ap.add_argument("--model", default="tiny",
                    help="the reference trainer's model for every run, slurmkit's and the baselines' "
                         "(conf/model/; default tiny: 5 M parameters; micro, 0.1 M, for a smoke "
                         "test, where the step's compute should not set the run's length)")
    ap.add_argument("--repeats", type=int, default=1, help="runs per class and variant (default 1)")
    ap.add_argument("--goodput-minutes", type=float, default=10.0,
                    help="length of the goodput run in minutes (default 10)")
    ap.add_argument("--cluster-env", default=os.path.join(DEFAULT_CLUSTER_DIR, "env.json"),
                    help="the local cluster's env.json (default %(default)s)")
    ap.add_argument("--keep", action="store_true", help="keep the run directories (printed)")
    ap.add_argument("--snapshot", action="store_true",
                    help="run the committed slurmkit (git HEAD exported under the run root and put "
                         "first on PYTHONPATH), not the working tree others may be editing")
    args = ap.parse_args(argv)
    args.classes = [x for x in args.classes.split(",") if x]
    bad = [x for x in args.classes if x not in CLASSES]
    if bad or not args.classes:
        ap.error(f"unknown class(es) {bad}: choose from {','.join(CLASSES)}")
    args.baselines = [] if args.skip_baseline else [x for x in args.baselines.split(",") if x]
    if [x for x in args.baselines if x not in BASELINES]:
        ap.error(f"unknown baseline(s) in {args.baselines}: choose from {','.join(BASELINES)}")
    if args.repeats < 1 or args.goodput_minutes <= 0:
        ap.error("--repeats must be >= 1 and --goodput-minutes > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not re.fullmatch(r"[a-z0-9_]+", args.model):
        ap_error = f"--model {args.model!r}: Detected: not a model name. Requirement: a file of conf/model/. Fix: --model tiny"
        raise SystemExit(ap_error)
    COMMON.append(f"model={args.model}")
    if args.cold:
        COMMON.append("supervisor.warm_standby=false")
    c = Cluster(load_env(args.cluster_env))
    load = os.getloadavg()[0]
    root = tempfile.mkdtemp(prefix="mttr-", dir=os.environ.get("TMPDIR", "/tmp"))
    if args.snapshot:
        c.env["PYTHONPATH"] = os.pathsep.join(filter(None, [snapshot(root), c.env.get("PYTHONPATH")]))
    print(f"runs under {root}; load average at start {load:.1f} on {os.cpu_count()} cores "
          "(the cluster is shared: expect noise); slurmkit ranks "
          + ("cold (no standbys)" if args.cold else "from warm standbys"), flush=True)
    launchers = {v: find_launcher(v, args.ft_launcher if v == "ft" else None)
                 for v in args.baselines if v != "sbatch"}
    unavailable = {v: la.about for v, la in launchers.items() if la.path is None}
    for v, la in launchers.items():
        print(f"baseline {v}: " + (f"{la.path} ({la.about})" if la.path else f"unavailable: {la.about}"),
              flush=True)
    try:
        results = run_classes(c, args.classes, args.repeats, args.baselines, launchers, root)
        print_table(results, unavailable)
        goodput = None
        if not args.skip_goodput:
            goodput, text = run_goodput(c, root, args.goodput_minutes)
            print("\n" + text)
    finally:
        c.restore_all()  # never leave a node down, whatever went wrong
    print(f"load average at end {os.getloadavg()[0]:.1f}")
    if not args.keep:
        subprocess.run(["rm", "-rf", root], check=False, timeout=120)
    print(result_line(results, goodput, unavailable, warm=not args.cold))
    return 0


if __name__ == "__main__":
    sys.exit(main())
