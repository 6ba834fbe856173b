"""How a job that must leave a bad node behind comes back: a successor job vs an in-place requeue.

One real node loss per choice on the local Slurm cluster (tools/local-cluster: 4 emulated nodes,
process tracking as the cluster was started with, cgroup where the machine allows it). The job
is ``+exp=tiny`` on 2 nodes without a spare, so node 0's supervisor must requeue without the
lost node (node rank 1, killed with ``local-cluster kill-node`` at step 12):

- ``successor`` (``supervisor.requeue_as=successor``, what ``auto`` picks when nodes are
  excluded): node 0 submits the same batch script held, ``--dependency=afterany:<job>``,
  ``--exclude=<node>``, sets ``Requeue=0`` on its own job, releases the new one and ends.
- ``in_place`` (``supervisor.requeue_as=in_place``): ``scontrol requeuehold``, and a helper
  double-forked out of the job sets ExcNodeList and releases it once pending. Under
  proctrack/cgroup Slurm kills that helper with the job: the job then stays held (reported as
  not resumed within the deadline, and its hold reason); under linuxproc it works.

For each: decision -> the next allocation's start (``allocation_start``), fault -> training
resumed (``train_resumed``), the jobs it took and their sacct states, the next job's
``Priority`` as Slurm set it (the cluster's PriorityType: ``tools/local-cluster up --priority
multifactor`` weighs age and fair share as a center does), and whether anything of the job
survived it. A plain
``scontrol requeue`` without a release waits Slurm's requeue delay (EligibleTime = requeue + ~121 s;
docs/supervisor.md) and is not run here.

Usage: ``python tools/bench/requeue_choice.py [--choices successor,in_place] [--deadline-s 150]``
(the cluster must be up: ``tools/local-cluster up``). Ends with one ``RESULT`` line.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mttr import (  # noqa: E402 - the same cluster helpers as the MTTR bench
    DEFAULT_CLUSTER_DIR, BenchError, Cluster, chain, events, first_event, load_env, mark_fault, submit_slurmkit,
    wait_step,
)

FAULT_STEP = 12
ARGS = ["+exp=tiny", "train.steps=40", "train.ckpt_interval_steps=10", "+job.env.SLURMKIT_STEP_DELAY_S=0.25",
        "parallel.pg_timeout_s=60", "supervisor.heartbeat_timeout_s=30"]


@dataclass
class Outcome:
    choice: str
    start_s: float | None = None  # decision -> next allocation_start
    resume_s: float | None = None  # fault -> train_resumed
    jobs: list[str] = field(default_factory=list)
    states: list[str] = field(default_factory=list)
    priority: tuple[str, str] = ("?", "?")  # first job's, next job's
    note: str = ""


def conf_value(c: Cluster, key: str) -> str:
    """One value of the running controller's configuration, its plugin prefix dropped."""
    out = c.run(["scontrol", "show", "config"], timeout_s=30).stdout
    m = re.search(rf"^{key}\s*=\s*(\S+)", out, re.MULTILINE)
    return m.group(1).split("/", 1)[-1] if m else "unknown"


def field_of(c: Cluster, job: str, key: str) -> str:
    out = c.run(["scontrol", "show", "job", "-o", job], timeout_s=30).stdout
    m = re.search(rf"\b{key}=(\S+)", out)
    return m.group(1) if m else "?"


def sacct_state(c: Cluster, job: str) -> str:
    out = c.run(["sacct", "-X", "-n", "-P", "--duplicates", "-j", job, "--format=State"], timeout_s=30).stdout
    return "+".join(s.split()[0] for s in out.split() if s.strip()) or "?"


def measure(c: Cluster, choice: str, root: str, deadline_s: float) -> Outcome:
    out = Outcome(choice)
    job, run_dir = "", ""
    try:
        job, run_dir = submit_slurmkit(c, [*ARGS, f"supervisor.requeue_as={choice}", f"job.name=rq-{choice}"], root)
        out.priority = (field_of(c, job, "Priority"), "?")
        step = int(wait_step(c, run_dir, 2, FAULT_STEP)["step"])
        node = events(run_dir, "allocation_start")[-1]["nodes"][1]
        fault_t = c.clock()
        c.kill_node(node)
        mark_fault(run_dir, "node_loss", fault_t, node=node, step=step)
        decision = first_event(c, run_dir, "decision", fault_t - 1.0, 120.0)
        nxt = chain(job, run_dir)[-1]
        try:
            start = first_event(c, run_dir, "allocation_start", float(decision["t"]), deadline_s)
        except BenchError:
            out.note = (f"not started {deadline_s:.0f} s after the decision: job {nxt} is "
                        f"{field_of(c, nxt, 'JobState')} ({field_of(c, nxt, 'Reason')})")
            return out
        out.start_s = float(start["t"]) - float(decision["t"])
        nxt = chain(job, run_dir)[-1]
        out.priority = (out.priority[0], field_of(c, nxt, "Priority"))
        resumed = first_event(c, run_dir, "train_resumed", fault_t, deadline_s)
        out.resume_s = float(resumed["t"]) - fault_t
        if node in start["nodes"]:
            out.note = f"the lost node {node} is in the next allocation"
    except BenchError as exc:
        out.note = f"FAILED: {str(exc).splitlines()[0]}"
    finally:
        c.cancel(job, run_dir)
        c.restore_all()
        out.jobs = chain(job, run_dir)
        for one in out.jobs:
            c.wait_gone(one)
        out.states = [sacct_state(c, one) for one in out.jobs]
    return out


def fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--choices", default="successor,in_place")
    p.add_argument("--deadline-s", type=float, default=150.0, help="decision -> next start, at most")
    p.add_argument("--cluster-dir", default=DEFAULT_CLUSTER_DIR)
    a = p.parse_args()
    env = {**os.environ, **load_env(os.path.join(a.cluster_dir, "env.json"))}
    c = Cluster(env)
    tracking, priority = conf_value(c, "ProctrackType"), conf_value(c, "PriorityType")
    print(f"local cluster: ProctrackType=proctrack/{tracking}, PriorityType=priority/{priority}; a node lost "
          f"at step {FAULT_STEP} of 2 nodes, no spare", flush=True)
    results: dict[str, Outcome] = {}
    with tempfile.TemporaryDirectory(prefix="rq-choice-") as root:
        for choice in [x for x in a.choices.split(",") if x]:
            results[choice] = o = measure(c, choice, root, a.deadline_s)
            print(f"  {choice:<10} decision->start {fmt(o.start_s):>6} s  fault->resumed {fmt(o.resume_s):>6} s  "
                  f"jobs {','.join(o.jobs) or '-'} ({', '.join(o.states) or '-'})  priority "
                  f"{o.priority[0]}->{o.priority[1]}  {o.note}", flush=True)
    s, i = results.get("successor"), results.get("in_place")
    ratio = (f"{i.resume_s / s.resume_s:.2f}" if s and i and s.resume_s and i.resume_s else "none")
    fields = [f"proctrack={tracking}", f"priority_type={priority}"]
    for name, o in results.items():
        fields += [f"{name}_start_s={fmt(o.start_s)}", f"{name}_resume_s={fmt(o.resume_s)}",
                   f"{name}_priority={o.priority[0]}->{o.priority[1]}",
                   f"{name}_jobs={len(o.jobs)}", f"{name}_resumed={'yes' if o.resume_s is not None else 'no'}"]
    fields.append(f"in_place_vs_successor={ratio}")
    print("RESULT " + " ".join(fields))
    return 0 if s is None or s.resume_s is not None else 1


if __name__ == "__main__":
    sys.exit(main())
