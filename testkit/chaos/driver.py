"""One campaign run on the real local cluster: submit, place each fault on the run's own
events, inject it for real, and collect what the invariants need.

Every wait is on a condition (a ledger event, a heartbeat step, a marker file, a Slurm state)
with a deadline, never a fixed sleep. A node the driver killed is started again as soon as the
supervisor has decided about it (so the next fault and the other jobs on the machine find the
node back) and, whatever happens, in a ``finally``; so are the tier faults undone there (a
tmpfs it mounted over a node's NVMe directory, the run's own S3 server). The driver writes one
``fault_injected`` event per fault into the run's ledger (source ``chaos``), so ``slurmkit
report`` measures detection and lost work from the real fault times.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from slurmkit.ledger.ledger import Ledger, read_ledger
from slurmkit.ledger.names import (CKPT_FAILED, CKPT_SAVED, DECISION, FAILURE, FAULT_INJECTED, HEARTBEAT,
                                   RANKS_STARTED, REQUEUE, TRAIN_FINISHED, TRAIN_STARTED)
from slurmkit.runfiles import CKPT_DIR, CONFIG_NAME, FAULTS_DIR, FINAL_NAME, LEDGER_NAME, SHARED_CKPT_DIR
from slurmkit.supervise.exits.successor import successor_chain, successor_of
from testkit.chaos import nvme, procs
from testkit.chaos.invariants import Injected, RunFacts
from testkit.chaos.menu import AFTER_SAVE, item
from testkit.chaos.s3 import CampaignS3
from testkit.chaos.plan import PlannedFault, RunPlan, armed_spec, marker_name

log = logging.getLogger(__name__)
TERMINAL = ["COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
            "BOOT_FAIL", "DEADLINE"]


class RunOver(Exception):
    """The job ended (or the run's deadline passed) while the driver waited for a trigger."""


@dataclass
class Cluster:
    """The local cluster as the driver uses it: its environment and the repository's tools."""

    env: dict[str, str]
    repo: str
    python: str = sys.executable
    say: Callable[[str], None] = print

    def local_cluster(self, *args: str) -> None:
        subprocess.run([os.path.join(self.repo, "tools", "local-cluster"), *args], check=True,
                       env=self.env, capture_output=True, timeout=120)

    def slurm(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(list(args), env=self.env, capture_output=True, text=True, timeout=timeout)

    def job_state(self, job_id: str) -> str:
        res = self.slurm("sacct", "-j", job_id, "-X", "-n", "-P", "--format=State")
        rows = [r.split()[0] for r in res.stdout.splitlines() if r.strip()]
        return rows[-1] if rows else "UNKNOWN"

    def down_nodes(self, since: float) -> list[tuple[str, float]]:
        """(node, time) of every DOWN Slurm recorded since ``since`` (epoch s): its node events."""
        start = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(since))
        res = self.slurm("sacctmgr", "-n", "-P", "show", "event", f"start={start}",
                         "format=NodeName,TimeStart,State")
        return down_events(res.stdout, since)

    def restore_node(self, node: str, timeout_s: float = 180) -> None:
        """Start the node's slurmd again and wait until Slurm takes jobs on it."""
        self.local_cluster("start-node", node)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            state = self.slurm("sinfo", "-h", "-n", node, "-o", "%T").stdout.strip()
            if state.startswith(("idle", "mixed", "allocated")) and "*" not in state:
                return
            if "down" in state or "drain" in state:
                self.slurm("scontrol", "update", f"nodename={node}", "state=resume")
            time.sleep(1)
        raise RuntimeError(f"{node} did not come back within {timeout_s:.0f} s")


def down_events(sacctmgr_out: str, since: float) -> list[tuple[str, float]]:
    """(node, epoch s) of every ``sacctmgr show event`` row (NodeName|TimeStart|State) that
    took a node DOWN at or after ``since``; the cluster-wide rows (no node name) are skipped."""
    out = []
    for row in sacctmgr_out.splitlines():
        parts = row.split("|")
        if len(parts) < 3 or not parts[0] or "DOWN" not in parts[2]:
            continue
        try:
            t = time.mktime(time.strptime(parts[1], "%Y-%m-%dT%H:%M:%S"))
        except ValueError:
            continue
        if t >= since - 1:  # the event's time has whole seconds
            out.append((parts[0], t))
    return out


def down_since(sacctmgr_out: str, since: float) -> set[str]:
    return {n for n, _ in down_events(sacctmgr_out, since)}


# Slurm marks a dead node DOWN some seconds after the agents noticed (SlurmdTimeout=10 on the
# local cluster; +21 s seen): a DOWN this close to a node_loss failure is that node loss.
DOWN_WINDOW_S = (-60.0, 60.0)


def external_losses(events: list[dict[str, Any]], downs: list[tuple[str, float]],
                    killed: set[str]) -> frozenset[str]:
    """Nodes whose node_loss failure Slurm confirmed (DOWN near the failure) though the
    campaign did not kill them: another job's test. A DOWN long before or after a failure
    explains nothing (a job requeued after its own end is not excused by a later outage)."""
    out = set()
    for e in events:
        if e.get("event") != FAILURE or e.get("cls") != "node_loss" or str(e.get("node")) in killed:
            continue
        node, t = str(e.get("node")), float(e["t"])
        if any(n == node and DOWN_WINDOW_S[0] <= dt - t <= DOWN_WINDOW_S[1] for n, dt in downs):
            out.add(node)
    return frozenset(out)


def shared_steps(run_dir: str) -> tuple[int, ...]:
    """The steps the shared tier's directory holds (``step_NNNNNNNNNN``), ascending."""
    try:
        names = os.listdir(os.path.join(run_dir, CKPT_DIR, SHARED_CKPT_DIR))
    except OSError:
        return ()
    return tuple(sorted(int(n[5:]) for n in names if n.startswith("step_") and n[5:].isdigit()))


@dataclass
class Run:
    """What one run of a plan left: the facts for the invariants, and the run's handles."""

    plan: RunPlan
    job_id: str
    run_dir: str
    facts: RunFacts
    not_reached: list[str] = field(default_factory=list)
    error: str = ""


S3_KIND = "s3_down_during_promotion"


def needs_own_s3(plan: RunPlan) -> bool:
    return any(f.kind == S3_KIND for f in plan.faults)


def overrides(plan: RunPlan, *, step_delay_s: float, name: str, faults: bool = True,
              heartbeat_timeout_s: float = 20, exclusive: bool = False, object_uri: str = "") -> list[str]:
    args = ["+exp=tiny", f"train.steps={plan.steps}", f"train.ckpt_interval_steps={plan.interval}",
            f"+job.env.SLURMKIT_STEP_DELAY_S={step_delay_s:g}",
            f"supervisor.heartbeat_timeout_s={heartbeat_timeout_s:g}",
            f"supervisor.spare_nodes={plan.spare_nodes if faults else 0}", f"job.name={name}", *plan.extra]
    if faults and exclusive:
        # Whole nodes (cluster.exclusive): a node loss kills every process on its node, and
        # other jobs on a shared cluster must not pay for this campaign's faults. Off by
        # default: a requeued exclusive job was seen PENDING (Resources) on idle nodes.
        args.append("cluster.exclusive=true")
    if faults and object_uri:
        # the run's object tier on the campaign's own S3 server, promoted at every save, so
        # the save after an outage begins has a promotion to S3 that meets it
        # Quick retries: the outage is reported (ckpt_failed, pending) within about a second of
        # the promotion meeting it, not after the default five attempts (~15 s, most of a short
        # run), and the pending step is tried again 5 s after the server is back
        args += [f"store.object_uri={object_uri}", "store.object_every_saves=1", "store.object_every_min=0",
                 "store.retry_attempts=2", "store.retry_initial_s=0.5", "store.retry_max_s=1",
                 "store.retry_pending_s=5"]
    spec = armed_spec(plan) if faults else ""
    if spec:
        args.append(f"+job.env.SLURMKIT_FAULT='{spec}'")
    return args


def submit(cluster: Cluster, args: list[str], run_root: str) -> tuple[str, str]:
    os.makedirs(run_root, exist_ok=True)
    res = subprocess.run([cluster.python, "-m", "slurmkit.submit", *args, f"submit.run_root={run_root}"],
                         env=cluster.env, cwd=run_root, capture_output=True, text=True, timeout=600)
    job = re.search(r"job (\S+) \((slurm|local)\)", res.stdout)
    run_dir = re.search(r"run directory : (\S+)", res.stdout)
    if res.returncode != 0 or not job or not run_dir:
        raise RuntimeError(f"submit failed ({res.returncode}):\n{res.stdout}\n{res.stderr}")
    return job.group(1), run_dir.group(1)


def reference_digest(cluster: Cluster, plan: RunPlan, run_root: str, *, step_delay_s: float,
                     heartbeat_timeout_s: float = 20, timeout_s: float = 900) -> str:
    """param_sha256 of the plan's run without any fault. A failure in it (a starved machine
    misses a heartbeat) is said, not hidden: the digest stays right only if recovery is
    bit-exact, which every campaign run then tests against it."""
    job, run_dir = submit(cluster, overrides(plan, step_delay_s=step_delay_s, name="chaos-reference",
                                             faults=False, heartbeat_timeout_s=heartbeat_timeout_s), run_root)
    state = wait_terminal(cluster, job, timeout_s)
    try:
        with open(os.path.join(run_dir, FINAL_NAME)) as f:
            out = json.load(f)
    except (OSError, ValueError):
        out = {}
    if state != "COMPLETED" or out.get("step") != plan.steps:
        raise RuntimeError(f"the reference run {run_dir} ended {state} at step {out.get('step')}")
    failures = [e for e in read_ledger(os.path.join(run_dir, LEDGER_NAME)) if e.get("event") == FAILURE]
    for e in failures:
        cluster.say(f"  warning: the reference run (no fault injected) had a failure: {e.get('cls')} on "
                    f"{e.get('node')}: {e.get('evidence')}")
    return str(out["param_sha256"])


SETTLE_S = 15.0  # a FAILED/NODE_FAIL must last this long: a requeued attempt passes through them


def settled(state: str, terminal_since: float | None, now: float) -> bool:
    """Whether ``state`` ends the job: COMPLETED and CANCELLED at once, the other terminal
    states once they held for SETTLE_S (Slurm shows the attempt a node loss ended as NODE_FAIL
    or FAILED before the requeue makes it PENDING again)."""
    word = state.split()[0] if state else ""
    if word not in TERMINAL:
        return False
    return word in ("COMPLETED", "CANCELLED") or (terminal_since is not None and now - terminal_since >= SETTLE_S)


def wait_terminal(cluster: Cluster, job_id: str, timeout_s: float, run_dir: str | None = None) -> str:
    """The settled state of ``job_id``; with ``run_dir``, of the run's last job (one that handed
    the run to a successor job is followed to it: slurmkit.supervise.exits.successor)."""
    deadline = time.monotonic() + timeout_s
    state, since = "UNKNOWN", None
    while time.monotonic() < deadline:
        state = cluster.job_state(job_id)
        now = time.monotonic()
        since = (since or now) if state.split()[0] in TERMINAL else None
        if settled(state, since, now):
            nxt = successor_of(run_dir, job_id) if run_dir else None
            if nxt is None:
                return state
            job_id, since = nxt, None
        time.sleep(1)
    return state


class Driver:
    """Runs one plan; ``run()`` never leaves a node it killed down."""

    def __init__(self, cluster: Cluster, plan: RunPlan, run_root: str, reference_sha: str, *,
                 step_delay_s: float = 0.25, heartbeat_timeout_s: float = 20, timeout_s: float = 900,
                 exclusive: bool = False) -> None:
        self.cluster, self.plan, self.run_root = cluster, plan, run_root
        self.reference_sha = reference_sha
        self.step_delay_s = step_delay_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.exclusive = exclusive
        self.deadline = time.monotonic() + timeout_s
        self.job_id = self.run_dir = ""
        self.injected: list[Injected] = []
        self.killed: set[str] = set()
        self.down: set[str] = set()
        self.filled: list[nvme.FullTier] = []  # NVMe tiers under the campaign's tmpfs (until the end)
        self.filled_nodes: set[str] = set()
        self.s3: CampaignS3 | None = None
        # the previous fault restarted no rank (a full disk, an S3 outage): the next after_save
        # counts saves from its time and step, not from a train_started that never comes
        self._base: tuple[float, int] | None = None
        self._state_checked = 0.0
        self._terminal_since: float | None = None

    # ------------------------------------------------------------------ observing
    def events(self) -> list[dict[str, Any]]:
        return list(read_ledger(os.path.join(self.run_dir, LEDGER_NAME)))

    def over(self) -> bool:
        if time.monotonic() > self.deadline:
            return True
        if time.monotonic() - self._state_checked < 3:
            return False
        now = self._state_checked = time.monotonic()
        state = self.cluster.job_state(self.job_id)
        self._terminal_since = (self._terminal_since or now) if state.split()[0] in TERMINAL else None
        if state.split()[0] in TERMINAL and self.run_dir:
            nxt = successor_of(self.run_dir, self.job_id)
            if nxt is not None:  # the run goes on in the job this one handed it to
                self.cluster.say(f"  job {self.job_id} handed the run over to job {nxt}")
                self.job_id, self._terminal_since = nxt, None
                return False
        return settled(state, self._terminal_since, now)

    def wait(self, what: str, cond: Callable[[], Any], poll_s: float = 0.2) -> Any:
        while True:
            got = cond()
            if got:
                return got
            if self.over():
                raise RunOver(f"the job ended (or the run timed out) while waiting for {what}")
            time.sleep(poll_s)

    def ranks(self) -> dict[int, procs.Proc]:
        return procs.ranks(procs.scan(self.run_dir, self.job_id))

    def step_of(self, rank: int, pid: int) -> int:
        """The rank's step from its node-local heartbeat, -1 unless written by ``pid``."""
        from slurmkit.train.heartbeat import local_heartbeat_path

        try:
            with open(local_heartbeat_path(self.run_dir, rank)) as f:
                hb = json.load(f)
        except (OSError, ValueError):
            return -1
        return int(hb.get("step", -1)) if hb.get("pid") == pid else -1

    def max_step(self) -> int | None:
        steps = [self.step_of(r, p.pid) for r, p in self.ranks().items()]
        steps = [s for s in steps if s >= 0]
        return max(steps) if steps else None

    def _after(self, name: str, t: float, **match: Any) -> dict[str, Any] | None:
        return next((e for e in self.events() if e.get("event") == name and float(e["t"]) > t
                     and all(e.get(k) == v for k, v in match.items())), None)

    # ------------------------------------------------------------------ placing
    def resumed_after(self, t: float) -> dict[str, Any]:
        return self.wait("training to resume", lambda: self._after(TRAIN_STARTED, t))

    def wait_after_save(self, f: PlannedFault, since: float) -> int:
        """Block until ``f.saves`` new checkpoints since training resumed after ``since``, plus
        ``f.offset`` steps; returns the step the save trigger aims at."""
        if self._base is not None:
            base_t, base_step = self._base
        else:
            start = self.resumed_after(since)
            base_t, base_step = float(start["t"]), int(start["step"])

        def saved() -> int | None:
            steps = sorted({int(e["step"]) for e in self.events() if e.get("event") == CKPT_SAVED
                            and float(e["t"]) >= base_t and int(e["step"]) > base_step})
            return steps[f.saves - 1] if len(steps) >= f.saves else None

        return int(self.wait(f"{f.saves} checkpoint(s) after step {base_step}", saved)) + f.offset

    def wait_step(self, rank: int, step: int) -> tuple[procs.Proc, int]:
        def reached() -> tuple[procs.Proc, int] | None:
            p = self.ranks().get(rank)
            if p is None:
                return None
            s = self.step_of(rank, p.pid)
            return (p, s) if s >= step else None

        return self.wait(f"rank {rank} at step {step}", reached, poll_s=0.05)

    def wait_restarting(self, since: float) -> float:
        """The previous fault's recovery: a decision (or a requeue) after ``since``, then the
        ranks of the next generation started. Returns when they did."""
        def decided() -> dict[str, Any] | None:
            return self._after(DECISION, since) or self._after(REQUEUE, since)

        d = self.wait("the decision about the previous fault", decided)
        started = self.wait("the next generation's ranks", lambda: self._after(RANKS_STARTED, float(d["t"])))
        return float(started["t"])

    def phase(self, since: float) -> str:
        return "training" if self._after(TRAIN_STARTED, since) else "restarting"

    # ------------------------------------------------------------------ injecting
    def mark(self, f: PlannedFault, t: float, step: int | None, nodes: tuple[str, ...] = (),
             ranks: tuple[int, ...] = (), phase: str = "training") -> None:
        self.injected.append(Injected(f.kind, f.moment, t, step, nodes, ranks, phase))
        fields: dict[str, Any] = {"time": t, "moment": f.moment, "phase": phase, "seed": self.plan.seed}
        if step is not None:
            fields["step"] = step
        if nodes:
            fields["node"] = nodes[0]
        if ranks:
            fields["rank"] = ranks[0]
        Ledger(os.path.join(self.run_dir, LEDGER_NAME), source="chaos").append("fault_injected", kind=f.kind,
                                                                                   **fields)
        self.cluster.say(f"  seed {self.plan.seed}: injected {f.describe()} at step {step} ({phase})")

    def node_of_slot(self, slot: int) -> str:
        rank = slot * self.plan.ranks_per_node
        p = self.wait(f"the process of rank {rank}", lambda: self.ranks().get(rank))
        return p.node

    def inject(self, f: PlannedFault, since: float) -> float:
        """Place and inject ``f``; returns the time it hit."""
        restart_t = since
        if f.moment == AFTER_SAVE:
            aim = self.wait_after_save(f, since)
        else:
            restart_t = self.wait_restarting(since)
            aim = -1
        kind = f.kind
        self._base = None
        if kind == "nccl_abort":
            return self.arm_nccl(f, aim)
        if kind == "rank_sigkill_during_save":
            return self.kill_in_save(f, aim - f.offset + self.plan.interval)
        if kind in ("rank_sigkill", "rank_sigstop", "two_at_once"):
            sig = signal.SIGSTOP if kind == "rank_sigstop" else signal.SIGKILL
            p, step, phase, t = self.signal_rank(f.target, aim, restart_t, sig)
            hit = [f.target]
            nodes = [p.node]
            if kind == "two_at_once":
                time.sleep(0.3)  # the fault itself: a second kill 0.3 s after the first
                q = self.ranks().get(f.second)
                try:
                    if q is not None:
                        os.kill(q.pid, signal.SIGKILL)
                        hit.append(f.second)
                        nodes.append(q.node)
                except ProcessLookupError:
                    pass  # the agents already stopped it: the first kill was noticed within 0.3 s
            self.mark(f, t, step, tuple(nodes), tuple(hit), phase)
            return t
        if aim >= 0:
            self.wait_step(0, aim)
        step = self.max_step() if aim >= 0 else None
        phase = self.phase(restart_t) if aim < 0 else "training"
        if kind == "node_loss":
            node = self.node_of_slot(f.target)
            t = time.time()
            self.killed.add(node)
            self.down.add(node)
            self.cluster.local_cluster("kill-node", node)
            self.mark(f, t, step, (node,), (), phase)
            self.bring_back_after_decision(node, t)
            return t
        if kind == "agent_sigkill":
            node = self.node_of_slot(f.target)
            agent = self.wait(f"the agent on {node}", lambda: procs.newest(
                [p for p in procs.scan(self.run_dir, self.job_id) if procs.is_agent(p) and p.node == node]))
            t = time.time()
            os.kill(agent.pid, signal.SIGKILL)
            self.mark(f, t, step, (node,), (), phase)
            return t
        if kind in ("nvme_full", S3_KIND):
            t = self.fill_nvme(f, step) if kind == "nvme_full" else self.s3_outage(f, step)
            # the next fault counts saves from where the run is now that this one is over (the
            # outage's promotion retries take seconds while training goes on)
            now = self.max_step()
            self._base = (time.time(), now if now is not None else (step if step is not None else -1))
            return t
        if kind == "time_limit_warning":
            shell = self.wait("the batch shell", lambda: procs.newest(
                [p for p in procs.scan(self.run_dir, self.job_id) if procs.is_batch_shell(p)]))
            t = time.time()
            os.kill(shell.pid, signal.SIGUSR1)
            self.mark(f, t, step, (shell.node,), (), phase)
            return t
        raise ValueError(f"the driver cannot inject {kind!r}")

    def signal_rank(self, rank: int, aim: int, restart_t: float,
                    sig: int) -> tuple[procs.Proc, int | None, str, float]:
        """Signal ``rank`` at step ``aim`` (or, with aim < 0, as soon as its next generation
        runs); returns (its process, step, phase, time). A rank that left between the scan and
        the signal is looked up again: the signal goes to its successor."""
        while True:
            step: int | None = None
            if aim >= 0:
                p, step = self.wait_step(rank, aim)
            else:
                p = self.wait(f"rank {rank} of the next generation", lambda: self.ranks().get(rank))
            phase = self.phase(restart_t) if aim < 0 else "training"
            t = time.time()
            try:
                os.kill(p.pid, sig)
                return p, step, phase, t
            except ProcessLookupError:
                continue

    def kill_in_save(self, f: PlannedFault, step: int) -> float:
        """SIGKILL rank ``f.target`` while its node writes the save of ``step``: that save's
        ``.partial/step_N.*`` directory on the node's NVMe tier exists from the first byte DCP
        writes until the commit moves the files (polled every 5 ms; the tiny model's save takes
        0.5-1 s here). The phase recorded is ``saving`` if the directory was still there right
        after the kill (the commit had not happened), ``late`` if not."""
        from slurmkit.store.manifest import PARTIAL, step_dir

        step = min(step, self.plan.steps)
        prefix = step_dir(step) + "."
        while True:
            p = self.wait(f"rank {f.target}", lambda: self.ranks().get(f.target))
            partial_root = os.path.join(nvme.node_nvme_dir(self.run_dir, p.node), PARTIAL)

            def writing(root: str = partial_root) -> str | None:
                try:
                    return next((n for n in os.listdir(root) if n.startswith(prefix)), None)
                except FileNotFoundError:
                    return None

            name = self.wait(f"the save of step {step} on {p.node}", writing, poll_s=0.005)
            t = time.time()
            try:
                os.kill(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                continue  # the rank left (another failure): aim at its successor's save
            phase = "saving" if os.path.isdir(os.path.join(partial_root, name)) else "late"
            self.mark(f, t, step, (p.node,), (f.target,), phase)
            return t

    def fill_nvme(self, f: PlannedFault, step: int | None) -> float:
        """Fill the NVMe tier of train slot ``f.target``'s node (nvme.py); keep it full until the
        next save is over (a ``ckpt_saved`` of a later step on any tier, a ``ckpt_failed`` of
        it on a tier other than NVMe, or a failure), then remove the filler."""
        node = self.node_of_slot(f.target)
        full = nvme.fill_tier(nvme.node_nvme_dir(self.run_dir, node),
                              min_free=nvme.preflight_min_free(self.run_dir))
        self.filled.append(full)
        last = self._last_save_made()
        if last is not None:  # the tmpfs took seconds to set up: no save is left to meet it
            nvme.release(full)
            raise RunOver(f"the run saved its last step ({last}) while the NVMe tier was being filled")
        self.filled_nodes.add(node)
        t = time.time()
        self.mark(f, t, step, (node,), (), "training")
        self.cluster.say(f"    {full.path}: tmpfs of {full.size_bytes >> 20} MiB, "
                         f"{nvme.free_bytes(full.path)} bytes free after the filler")
        # A save that ended while the tmpfs was being set up (seconds, on a loaded machine) is
        # not the one that meets it: wait past the newest step saved by the time the tier is full
        # (ci63: the save of step 12 ended during the fill, the filler was released at once, and
        # the fault was reported as never noticed).
        saved = self._saved_by(t)
        after = max(s for s in (step, saved) if s is not None) if (step, saved) != (None, None) else None
        try:
            self.wait("the save that meets the full NVMe tier", lambda: self._save_after(after, t, "nvme"))
        finally:
            nvme.release(full)
        return t

    def s3_outage(self, f: PlannedFault, step: int | None) -> float:
        """Stop the run's own S3 server; start it again once the next save's promotion to the
        object tier failed (``ckpt_failed`` tier object, ``pending``) or the run failed."""
        if self.s3 is None:
            raise RuntimeError("s3_down_during_promotion needs the run's own S3 server (needs_own_s3)")
        t = time.time()
        self.s3.stop()
        self.mark(f, t, step, (), (), "training")
        try:
            self.wait("the promotion that meets the S3 outage", lambda: next(
                (e for e in self.events() if float(e["t"]) > t and (
                    e.get("event") == FAILURE or (e.get("event") == CKPT_FAILED and e.get("tier") == "object"))),
                None))
        finally:
            self.s3.start()
            self.cluster.say(f"    S3 server back at {self.s3.env()['SLURMKIT_S3_ENDPOINT']}")
        return t

    def _last_save_made(self) -> int | None:
        """The run's last step once it is saved (or training finished): a tier fault placed
        after it has nothing left to meet (seen in the 50-seed campaign, seed 47: the fill
        landed after the save of the last step and was reported as a fault never noticed)."""
        for e in self.events():
            if e.get("event") == TRAIN_FINISHED or (
                    e.get("event") == CKPT_SAVED and int(e.get("step") or -1) >= self.plan.steps):
                return self.plan.steps
        return None

    def _saved_by(self, t: float) -> int | None:
        """The newest step any tier recorded as saved at or before ``t``, None if none."""
        steps = [int(e["step"]) for e in self.events()
                 if e.get("event") == CKPT_SAVED and e.get("step") is not None and float(e.get("t", 0)) <= t]
        return max(steps) if steps else None

    def _save_after(self, step: int | None, t: float, tier: str) -> dict[str, Any] | None:
        """The first sign that a save later than ``step`` is over: saved anywhere, failed on a
        tier other than ``tier`` (the fallback failed too), or a failure of the run."""
        for e in self.events():
            kind = e.get("event")
            later = e.get("step") is not None and int(e["step"]) > (step if step is not None else -1)
            if (kind == CKPT_SAVED and later) or (kind == CKPT_FAILED and later and e.get("tier") != tier) \
                    or (kind == FAILURE and float(e["t"]) > t):
                return e
        return None

    def arm_nccl(self, f: PlannedFault, aim: int) -> float:
        """Remove the once-marker of a step ahead of the rank: it prints the NCCL line and aborts
        before that step; the trainer writes the marker again as it fires."""
        p = self.wait(f"rank {f.target}", lambda: self.ranks().get(f.target))
        now = self.step_of(f.target, p.pid)
        step = min(max(aim, now + 2), self.plan.steps)  # before_step(step) runs after step-1 is done
        marker = os.path.join(self.run_dir, FAULTS_DIR, marker_name(f.target, step))
        os.unlink(marker)
        self.wait(f"the NCCL abort of rank {f.target} before step {step}", lambda: os.path.exists(marker))
        t = os.stat(marker).st_mtime
        self.mark(f, t, step - 1, (p.node,), (f.target,), "training")
        return t

    def write_markers(self) -> None:
        spec = armed_spec(self.plan)
        if not spec:
            return
        d = os.path.join(self.run_dir, FAULTS_DIR)
        os.makedirs(d, exist_ok=True)
        for item in spec.split(";"):
            _, rank, step, _ = item.split(":")
            fd = os.open(os.path.join(d, marker_name(int(rank), int(step))), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            os.close(fd)

    def bring_back_after_decision(self, node: str, t: float) -> None:
        try:
            self.wait(f"the decision about {node}", lambda: self._after(DECISION, t))
        finally:
            self.bring_back(node)

    def bring_back(self, node: str) -> None:
        if node in self.down:
            self.cluster.restore_node(node)
            self.down.discard(node)

    # ------------------------------------------------------------------ the run
    def run(self) -> Run:
        name = f"chaos-{self.plan.seed}"
        submitted = time.time()
        args = overrides(self.plan, step_delay_s=self.step_delay_s, name=name,
                         heartbeat_timeout_s=self.heartbeat_timeout_s, exclusive=self.exclusive)
        not_reached: list[str] = []
        error = ""
        try:
            submitter = self.cluster
            if needs_own_s3(self.plan):
                self.s3 = CampaignS3(os.path.join(self.run_root, f"s3-seed{self.plan.seed}"))
                self.s3.start()
                args = overrides(self.plan, step_delay_s=self.step_delay_s, name=name,
                                 heartbeat_timeout_s=self.heartbeat_timeout_s, exclusive=self.exclusive,
                                 object_uri=self.s3.object_uri("chaos"))
                # the job reaches the server through the submitting environment (sbatch exports it)
                submitter = replace(self.cluster, env={**self.cluster.env, **self.s3.env()})
            self.job_id, self.run_dir = submit(submitter, args, self.run_root)
            self.write_markers()
            since = 0.0
            for i, f in enumerate(self.plan.faults):
                try:
                    since = self.inject(f, since)
                except RunOver as exc:
                    not_reached = [g.describe() for g in self.plan.faults[i:]]
                    error = str(exc)
                    break
            state = wait_terminal(self.cluster, self.job_id, max(60.0, self.deadline - time.monotonic()),
                                  self.run_dir)
            self.job_id = self._last_job()
            if state.split()[0] not in TERMINAL:
                self.cluster.slurm("scancel", self.job_id)
                error = (error + "; " if error else "") + f"run timed out ({state}); cancelled"
                state = wait_terminal(self.cluster, self.job_id, 120)
        finally:
            for node in sorted(self.down):
                try:
                    self.bring_back(node)
                except Exception as exc:  # noqa: BLE001 - say it, try the others
                    self.cluster.say(f"  could not bring {node} back: {exc}")
            self.clean_up()
        leftover = self.leftover()
        final = None
        try:
            with open(os.path.join(self.run_dir, FINAL_NAME)) as fh:
                final = json.load(fh)
        except (OSError, ValueError):
            pass
        try:
            external = external_losses(self.events(), self.cluster.down_nodes(submitted), self.killed)
        except (OSError, subprocess.SubprocessError) as exc:
            self.cluster.say(f"  could not read Slurm's node events: {exc}")
            external = frozenset()
        facts = RunFacts(self.events(), self.plan.interval, self.plan.steps, self.reference_sha,
                         state.split()[0], final, list(self.injected), frozenset(self.killed), leftover,
                         external, shared_steps(self.run_dir), frozenset(self.filled_nodes))
        return Run(self.plan, self.job_id, self.run_dir, facts, not_reached, error)

    def clean_up(self) -> None:
        """Unmount every tmpfs the run filled and stop its S3 server (the job ended, or
        submitting failed); each is tried whatever the others do."""
        for full in self.filled:
            try:
                nvme.release(full)
                nvme.unmount(full)
            except Exception as exc:  # noqa: BLE001 - say it, try the others
                self.cluster.say(f"  could not unmount {full.path}: {exc}")
        if self.s3 is not None:
            try:
                self.s3.close()
            except Exception as exc:  # noqa: BLE001
                self.cluster.say(f"  could not stop the run's S3 server: {exc}")

    def _last_job(self) -> str:
        return successor_chain(self.run_dir, self.job_id)[-1]

    def leftover(self, grace_s: float = 60) -> list[str]:
        """Processes of the job still alive once Slurm says it ended (slurmd cleans up
        asynchronously: waited for, up to ``grace_s``)."""
        deadline = time.monotonic() + grace_s
        while True:
            left = procs.scan(self.run_dir, self.job_id)
            if not left or time.monotonic() > deadline:
                return [f"pid {p.pid} on {p.node or '?'} state {p.state}: {' '.join(p.cmdline)[:120]}"
                        for p in left]
            time.sleep(0.5)


def facts_from_run_dir(run_dir: str, reference_sha: str, *, job_state: str) -> RunFacts:
    """The facts of a finished run read back from its directory (``--recheck``): the faults
    from its ``fault_injected`` events, the killed nodes from its node_loss faults. What only
    the live driver saw (leftover processes, Slurm's node events) is left empty."""
    events = list(read_ledger(os.path.join(run_dir, LEDGER_NAME)))
    import yaml

    with open(os.path.join(run_dir, CONFIG_NAME)) as f:
        train = yaml.safe_load(f)["train"]
    steps, interval = int(train["steps"]), int(train["ckpt_interval_steps"])
    injected = [Injected(str(e["kind"]), str(e.get("moment", "")), float(e.get("time", e["t"])),
                         e.get("step"), (str(e["node"]),) if e.get("node") else (),
                         (int(e["rank"]),) if e.get("rank") is not None else (), str(e.get("phase", "")))
                for e in events if e.get("event") == FAULT_INJECTED and e.get("source") == "chaos"]
    killed = frozenset(n for i in injected if i.kind == "node_loss" for n in i.nodes)
    filled = frozenset(n for i in injected if i.kind == "nvme_full" for n in i.nodes)
    final = None
    try:
        with open(os.path.join(run_dir, FINAL_NAME)) as f:
            final = json.load(f)
    except (OSError, ValueError):
        pass
    return RunFacts(events, interval, steps, reference_sha, job_state, final, injected, killed,
                    shared_steps=shared_steps(run_dir), filled_nodes=filled)


def diagnose(run: Run) -> str:
    """The ledger without heartbeats, one short line per event: what a failing seed prints."""
    lines = []
    for e in sorted(run.facts.events, key=lambda e: float(e["t"])):
        if e.get("event") == HEARTBEAT:
            continue
        short = {k: v for k, v in e.items() if k in (
            "t", "event", "source", "generation", "step", "cls", "rank", "node", "action", "reason",
            "status", "exit_code", "exclude", "nodes", "kind", "phase", "tier")}
        lines.append(json.dumps(short)[:300])
    return "\n".join(lines)
