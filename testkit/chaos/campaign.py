"""``tools/chaos``: seeded fault campaigns on the local cluster, and their summary.

    tools/chaos --seeds 1-5                 # five runs, one plan per seed
    tools/chaos --seed 7                    # replay seed 7 (what a failing seed prints)
    tools/chaos --seeds 1-50 --plan-only    # the plans, without a cluster
    tools/chaos --summarize runs.jsonl      # the RESULT line of the runs an --out file holds

One uninterrupted reference run gives the digest every run's final parameters must equal
(``--reference SHA`` reuses one). Runs go one at a time (the cluster is small and shared).
Each run prints its faults as they hit, then one line per invariant; a run that breaks one
prints its ledger and the command that replays it. The campaign ends with

    RESULT runs=... faults=... survived=... bit_exact=... max_lost_steps=... healthy_excluded=...
           goodput_median=... failed_seeds=...

and exits 1 if any run broke an invariant. ``--out FILE`` appends one JSON line per run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from slurmkit.ledger.names import END, SUBMITTED
from testkit.chaos.invariants import Check, Verdict, lost_per_fault, verdict
from testkit.chaos.menu import MENU
from testkit.chaos.plan import RunPlan, draw_plan, replay_command
from slurmkit.runfiles import LEDGER_NAME


# testkit/chaos/campaign.py -> the repository root (testkit/ is a top-level package of it)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass(frozen=True)
class RunSummary:
    seed: int
    planned: int
    injected: int
    verdict: Verdict
    replay: str
    job_id: str = ""
    run_dir: str = ""
    error: str = ""

    def to_json(self) -> str:
        return json.dumps({
            "seed": self.seed, "planned": self.planned, "injected": self.injected, "ok": self.verdict.ok,
            "job_id": self.job_id, "run_dir": self.run_dir, "error": self.error, "replay": self.replay,
            "checks": {c.name: {"ok": c.ok, "detail": c.detail, "value": c.value} for c in self.verdict.checks},
        })


def from_json(line: str) -> RunSummary:
    """A run of an earlier campaign, from its ``--out`` line."""
    raw = json.loads(line)
    checks = [Check(name, bool(c["ok"]), str(c["detail"]), c.get("value")) for name, c in raw["checks"].items()]
    return RunSummary(int(raw["seed"]), int(raw["planned"]), int(raw["injected"]), Verdict(checks),
                      str(raw["replay"]), str(raw.get("job_id", "")), str(raw.get("run_dir", "")),
                      str(raw.get("error", "")))


def parse_seeds(text: str) -> list[int]:
    """``"1-5,9"`` -> [1, 2, 3, 4, 5, 9]."""
    out: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise argparse.ArgumentTypeError(f"seed list item {part!r}: use N or N-M, e.g. 1-5,9")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def result_line(runs: Sequence[RunSummary]) -> str:
    """The campaign's one-line summary (the key=value format of the project's benchmarks)."""
    def value(r: RunSummary, name: str) -> Any:
        return r.verdict.get(name).value

    goodputs = [float(value(r, "goodput") or 0.0) for r in runs]
    failed = [str(r.seed) for r in runs if not r.verdict.ok]
    return ("RESULT " + " ".join(f"{k}={v}" for k, v in [
        ("runs", len(runs)),
        ("faults", sum(r.injected for r in runs)),
        ("survived", sum(r.verdict.get("completes").ok for r in runs)),
        ("bit_exact", sum(r.verdict.get("bit_exact").ok for r in runs)),
        ("max_lost_steps", max((int(value(r, "lost_steps") or 0) for r in runs), default=0)),
        ("healthy_excluded", sum(int(value(r, "healthy_excluded") or 0) for r in runs)),
        ("leftover_procs", sum(int(value(r, "no_leftover_processes") or 0) for r in runs)),
        ("ledger_inconsistent", sum(not r.verdict.get("ledger_consistent").ok for r in runs)),
        ("external", sum(int(value(r, "external") or 0) for r in runs)),
        ("goodput_median", f"{statistics.median(goodputs):.3f}" if goodputs else "0"),
        ("failed_seeds", ",".join(failed) or "none"),
    ]))


def describe_plan(plan: RunPlan) -> str:
    faults = "; ".join(f.describe() for f in plan.faults)
    return f"seed {plan.seed}: {len(plan.faults)} faults, {plan.spare_nodes} spare: {faults}"


def run_one(plan: RunPlan, *, cluster, run_root: str, reference: str, step_delay_s: float,
            heartbeat_timeout_s: float, timeout_s: float, replay: str,
            say: Callable[[str], None], exclusive: bool = False) -> RunSummary:
    from testkit.chaos.driver import Driver, diagnose

    run = Driver(cluster, plan, run_root, reference, step_delay_s=step_delay_s,
                 heartbeat_timeout_s=heartbeat_timeout_s, timeout_s=timeout_s, exclusive=exclusive).run()
    v = verdict(run.facts)
    for c in v.checks:
        say(f"    {c.name:<22} {'ok  ' if c.ok else 'FAIL'} {c.detail}")
    for fault, at_risk, resumed in lost_per_fault(run.facts):
        say(f"    fault {fault.kind:<20} {fault.phase:<10} at step {at_risk}, resumed from {resumed}")
    if run.not_reached:
        say(f"    not reached ({run.error}): " + "; ".join(run.not_reached))
    if not v.ok:
        say(f"  seed {plan.seed} FAILED (job {run.job_id}, {run.run_dir}); ledger:\n{diagnose(run)}")
        say(f"  replay: {replay}")
    return RunSummary(plan.seed, len(plan.faults), len(run.facts.injected), v, replay, run.job_id,
                      run.run_dir, run.error)


def _job_of(run_dir: str) -> str:
    from slurmkit.ledger.ledger import read_ledger

    for e in read_ledger(os.path.join(run_dir, LEDGER_NAME)):
        if e.get("event") == SUBMITTED and e.get("job_id"):
            return str(e["job_id"])
    return ""


def cluster_env() -> dict[str, str]:
    """This process's environment plus the local cluster's (SLURM_CONF, the S3 endpoint)."""
    state = os.environ.get("SLURMKIT_CLUSTER_DIR", "/tmp/slurmkit-cluster")
    path = os.path.join(state, "env.json")
    if not os.path.exists(path):
        raise SystemExit(f"chaos: no local cluster state in {state}: run `tools/local-cluster up` first")
    with open(path) as f:
        env = {**os.environ, **json.load(f)}
    # tools/local-cluster (`env python3`) and bare `python` must be this interpreter's.
    env["PATH"] = os.pathsep.join(filter(None, [os.path.dirname(sys.executable), env.get("PATH")]))
    return env


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tools/chaos", description=__doc__.split("\n\n")[0])
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--seeds", type=parse_seeds, help="seed list, e.g. 1-5,9")
    which.add_argument("--seed", type=int, help="one seed (replay)")
    which.add_argument("--menu", action="store_true", help="print the fault menu and exit")
    which.add_argument("--summarize", metavar="FILE", help="the RESULT line of the runs an --out FILE holds")
    which.add_argument("--recheck", metavar="RUN_DIR", help="judge a finished run again from its directory "
                                                            "(needs --reference)")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--interval", type=int, default=4, help="train.ckpt_interval_steps")
    p.add_argument("--min-faults", type=int, default=3)
    p.add_argument("--max-faults", type=int, default=6)
    p.add_argument("--override", action="append", default=[], help="extra config override for every run")
    p.add_argument("--step-delay-s", type=float, default=0.25)
    p.add_argument("--heartbeat-timeout-s", type=float, default=20,
                   help="supervisor.heartbeat_timeout_s: a SIGSTOP is found after it; on a starved "
                        "machine a shorter one finds hangs nobody injected")
    p.add_argument("--run-root", default="/tmp/slurmkit-chaos")
    p.add_argument("--reference", help="param_sha256 of the uninterrupted run (skips the reference run)")
    p.add_argument("--run-timeout-s", type=float, default=900)
    p.add_argument("--exclusive", action="store_true",
                   help="whole nodes per run (cluster.exclusive): on a cluster other jobs share")
    p.add_argument("--plan-only", action="store_true", help="print the plans; touch no cluster")
    p.add_argument("--out", help="append one JSON line per run to this file")
    return p


def main(argv: Sequence[str] | None = None, say: Callable[[str], None] | None = None) -> int:
    a = parser().parse_args(argv)
    say = say or (lambda s: print(s, flush=True))
    if a.menu:
        for m in MENU:
            say(f"{m.name:<26} {'yes' if m.implemented else 'NOT YET':<8} {','.join(m.moments) or '-':<26} "
                f"{m.what if m.implemented else m.why_not}")
        return 0
    if a.summarize:
        with open(a.summarize) as f:
            done = [from_json(line) for line in f if line.strip()]
        say(result_line(done))
        return 0 if all(r.verdict.ok for r in done) else 1
    if a.recheck:
        from testkit.chaos.driver import Cluster, facts_from_run_dir

        if not a.reference:
            raise SystemExit("chaos: --recheck needs --reference SHA (the uninterrupted run's param_sha256)")
        ends = [e for e in facts_from_run_dir(a.recheck, a.reference, job_state="").events if e.get("event") == END]
        job = str(next((e.get("job_id") for e in ends if e.get("job_id")), "")) or _job_of(a.recheck)
        state = Cluster(cluster_env(), REPO).job_state(job).split()[0] if job else "UNKNOWN"
        v = verdict(facts_from_run_dir(a.recheck, a.reference, job_state=state))
        for c in v.checks:
            say(f"    {c.name:<22} {'ok  ' if c.ok else 'FAIL'} {c.detail}")
        return 0 if v.ok else 1
    seeds = a.seeds if a.seeds is not None else [a.seed]
    try:
        plans = [draw_plan(s, steps=a.steps, interval=a.interval, min_faults=a.min_faults,
                           max_faults=a.max_faults, extra=tuple(a.override)) for s in seeds]
    except ValueError as exc:  # a run too short for the faults asked for: said, no traceback
        raise SystemExit(f"chaos: {exc}") from None
    for plan in plans:
        say(describe_plan(plan))
    if a.plan_only:
        return 0
    from testkit.chaos.driver import Cluster, reference_digest

    cluster = Cluster(cluster_env(), REPO, say=say)
    # a run's own S3 server (s3_down_during_promotion) is a `weed` this process starts: found
    # on the same PATH as the cluster's tools (this interpreter's scripts directory first)
    os.environ["PATH"] = cluster.env["PATH"]
    reference = a.reference or reference_digest(cluster, plans[0], os.path.join(a.run_root, "reference"),
                                                step_delay_s=a.step_delay_s,
                                                heartbeat_timeout_s=a.heartbeat_timeout_s,
                                                timeout_s=a.run_timeout_s)
    settings = "".join(f" --{k} {v:g}" for k, v, default in [
        ("step-delay-s", a.step_delay_s, 0.25), ("heartbeat-timeout-s", a.heartbeat_timeout_s, 20)] if v != default)
    say(f"reference param_sha256 {reference}")
    runs = []
    for i, plan in enumerate(plans, 1):
        say(f"run {i}/{len(plans)} {describe_plan(plan)}")
        replay = (replay_command(plan, min_faults=a.min_faults, max_faults=a.max_faults) + settings
                  + f" --reference {reference}")
        summary = run_one(plan, cluster=cluster, run_root=os.path.join(a.run_root, f"seed{plan.seed}"),
                          reference=reference, step_delay_s=a.step_delay_s,
                          heartbeat_timeout_s=a.heartbeat_timeout_s, timeout_s=a.run_timeout_s,
                          replay=replay, say=say, exclusive=a.exclusive)
        runs.append(summary)
        if a.out:
            with open(a.out, "a") as f:
                f.write(summary.to_json() + "\n")
    say(result_line(runs))
    return 0 if all(r.verdict.ok for r in runs) else 1
