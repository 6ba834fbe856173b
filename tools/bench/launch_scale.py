"""How the node agents start: one srun step per node against steps of several nodes
(launch.nodes_per_step), and against the one step over all nodes a user would otherwise write.

Part 1, on the running local cluster (tools/local-cluster up --nodes 32 gives 32 emulated nodes,
one slurmd each): one job per shape over every idle node, its agents started by the batch
script's real launch lines (slurmkit.render.sbatch.launch_agents, the same template every
slurmkit job uses). Each agent is a small Python process that finds its node rank with the real
slurmkit.launch.context.node_context and records when it started (the real agent imports torch
next, which is the same for every shape and is left out). Measured per shape:

* step_creates: REQUEST_JOB_STEP_CREATE RPCs slurmctld served for the job (sdiag, before and after);
* sruns: srun processes on the batch host at once (the most seen, polled from /proc);
* start_all_s: from the batch script's first line to the last agent's start.

Shapes: ``single`` (srun --ntasks-per-node=1 over all nodes: a lost node ends every agent),
``per_node`` (launch.nodes_per_step=1), ``grouped`` (--group, or 0: slurmkit's choice for the
job's size, slurmkit.render.jobspec.nodes_per_step). Rounds alternate the shapes.

Part 2, emulated (no Slurm): the same launch lines run for N up to 2,048 nodes with an srun that
only records its arguments: the sruns (= step creates) per attempt per shape and their growth
exponent in N (per node: 1; the default: 0 past 17 nodes).

    tools/local-cluster up --nodes 32
    python tools/bench/launch_scale.py [--rounds 3] [--group 0] [--nodes 0 (all idle)]

Ends with one line ``RESULT nodes=... group=... step_creates=... sruns=... start_all_s=...
per_node_step_creates=... per_node_sruns=... per_node_start_all_s=... single_start_all_s=...
ratio_step_creates=... ratio_start_all=... emulated_nodes=... emulated_step_creates=...
emulated_per_node_step_creates=... step_creates_exp=... per_node_step_creates_exp=...``
(unprefixed: the grouped shape; ratios: per node over grouped).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from slurmkit.render.jobspec import nodes_per_step  # noqa: E402
from slurmkit.render.sbatch import launch_agents  # noqa: E402
from testkit.slurm_build import cluster_environ  # noqa: E402

DEFAULT_CLUSTER_DIR = os.environ.get("SLURMKIT_CLUSTER_DIR", "/tmp/slurmkit-cluster")
STEP_CREATE_RE = re.compile(r"REQUEST_JOB_STEP_CREATE\s+\(\s*\d+\)\s+count:(\d+)")
SRUN_ARGS = ["--kill-on-bad-exit=0"]
JOB_TIMEOUT_S = 600.0

# The agent: its node rank from the real context code, its start time, and (node 0) a wait
# for every other agent so that the batch script does not end the steps early.
AGENT = """
import os, sys, time
t = time.time()
from slurmkit.launch.context import node_context
ctx = node_context(os.environ)
out = sys.argv[1]
with open(os.path.join(out, f"agent_{ctx.node_rank}"), "w") as f:
    f.write(f"{t} {ctx.node_name}\\n")
if ctx.node_rank == 0:
    deadline = time.time() + 300
    while time.time() < deadline and len([n for n in os.listdir(out) if n.startswith("agent_")]) < ctx.num_nodes:
        time.sleep(0.05)
"""


class BenchError(RuntimeError):
    pass


def load_env(cluster_dir: str) -> dict[str, str]:
    path = os.path.join(cluster_dir, "env.json")
    if not os.path.exists(path):
        raise BenchError(f"Detected: no cluster environment at {path}. Requirement: a running local cluster. "
                         "Fix: run `tools/local-cluster up --nodes 32` first.")
    with open(path) as f:
        cluster = json.load(f)
    return {**cluster_environ(cluster), "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}


def run(cmd: list[str], env: Mapping[str, str], timeout: float = 120.0) -> str:
    res = subprocess.run(cmd, env=dict(env), capture_output=True, text=True, timeout=timeout)
    if res.returncode != 0:
        raise BenchError(f"{shlex.join(cmd)} exited {res.returncode}: {res.stdout}{res.stderr}")
    return res.stdout


def idle_nodes(env: Mapping[str, str]) -> list[str]:
    out = run(["sinfo", "-h", "-N", "-t", "idle", "-o", "%N"], env)
    return sorted(set(out.split()), key=lambda n: (len(n), n))


def step_creates(env: Mapping[str, str]) -> int:
    m = STEP_CREATE_RE.search(run(["sdiag"], env))
    return int(m.group(1)) if m else 0


def sruns_of(job: str) -> int:
    """srun processes of ``job`` on this machine (the batch host of every emulated node)."""
    count = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().strip() != "srun":
                    continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"SLURM_JOB_ID={job}".encode() in f.read().split(b"\0"):
                    count += 1
        except OSError:
            continue
    return count


def script(shape: str, nodes: int, group: int, out: str) -> str:
    agent = shlex.join([sys.executable, "-c", AGENT, out])
    if shape == "single":
        launch = shlex.join(["srun", *SRUN_ARGS, f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1",
                             sys.executable, "-c", AGENT, out])
    else:
        launch = launch_agents(out, SRUN_ARGS, agent, 1 if shape == "per_node" else group, nodes)
    return "\n".join([
        "#!/bin/bash",
        f"#SBATCH --nodes={nodes}", "#SBATCH --ntasks-per-node=1", "#SBATCH --time=10",
        f"#SBATCH --output={out}/batch_%j.out", f"#SBATCH --job-name=launch-{shape}",
        f"{shlex.quote(sys.executable)} -c 'import time; print(time.time())' > {shlex.quote(out)}/t0",
        launch, ""])


def one_job(shape: str, nodes: list[str], group: int, env: Mapping[str, str], base: str) -> dict[str, float]:
    out = tempfile.mkdtemp(prefix=f"{shape}-", dir=base)
    path = os.path.join(out, "job.sh")
    with open(path, "w") as f:
        f.write(script(shape, len(nodes), group, out))
    before = step_creates(env)
    job = run(["sbatch", "--parsable", f"--nodelist={','.join(nodes)}", path], env).strip().split(";")[0]
    most, deadline = 0, time.monotonic() + JOB_TIMEOUT_S
    while time.monotonic() < deadline:
        most = max(most, sruns_of(job))
        state = run(["squeue", "-h", "-j", job, "-o", "%T"], env).strip()
        if not state:
            break
        time.sleep(0.05)
    else:
        run(["scancel", job], env)
        raise BenchError(f"job {job} ({shape}) did not end within {JOB_TIMEOUT_S:.0f} s: see {out}")
    created = step_creates(env) - before
    starts = []
    for name in os.listdir(out):
        if name.startswith("agent_"):
            with open(os.path.join(out, name)) as f:
                starts.append(float(f.read().split()[0]))
    if len(starts) != len(nodes):
        raise BenchError(f"job {job} ({shape}): {len(starts)} of {len(nodes)} agents started: see {out}")
    with open(os.path.join(out, "t0")) as f:
        t0 = float(f.read())
    return {"step_creates": created, "sruns": most, "start_all_s": max(starts) - t0}


def emulated(nodes: int, group: int, base: str) -> int:
    """sruns the real launch lines start for ``nodes`` nodes (an srun that only records)."""
    d = tempfile.mkdtemp(prefix=f"emu{nodes}-", dir=base)
    bindir = os.path.join(d, "bin")
    os.mkdir(bindir)
    record = os.path.join(d, "sruns")
    with open(os.path.join(bindir, "srun"), "w") as f:
        f.write(f"#!/bin/sh\necho x >> {shlex.quote(record)}\n")
    with open(os.path.join(bindir, "scontrol"), "w") as f:
        f.write(f"#!/bin/sh\nseq -f 'n%g' 0 {nodes - 1}\n")
    for name in ("srun", "scontrol"):
        os.chmod(os.path.join(bindir, name), 0o755)
    path = os.path.join(d, "launch.sh")
    with open(path, "w") as f:
        f.write(launch_agents(d, [], "agent", group, nodes) + "\n")
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "x"}
    subprocess.run(["bash", path], env=env, check=True, capture_output=True, timeout=600)
    with open(record) as f:
        return len(f.read().split())


def exponent(xs: list[int], ys: list[int]) -> float:
    """Least-squares slope of log y over log x."""
    lx, ly = [math.log(x) for x in xs], [math.log(max(y, 1)) for y in ys]
    mx, my = statistics.fmean(lx), statistics.fmean(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--nodes", type=int, default=0, help="nodes per job (0: every idle node)")
    p.add_argument("--group", type=int, default=0, help="launch.nodes_per_step of the grouped shape "
                   "(0: slurmkit's choice for the size; on a cluster of at most 17 nodes that is 1, so "
                   "give one, e.g. 8)")
    p.add_argument("--emulate", default="64,256,1024,2048", help="node counts of part 2")
    p.add_argument("--cluster-dir", default=DEFAULT_CLUSTER_DIR)
    a = p.parse_args(argv)
    env = load_env(a.cluster_dir)
    idle = idle_nodes(env)
    n = a.nodes or len(idle)
    if n < 2 or n > len(idle):
        raise BenchError(f"Detected: {len(idle)} idle nodes, {n} asked for. Requirement: at least 2 idle "
                         "nodes. Fix: `tools/local-cluster up --nodes 32`, or a smaller --nodes.")
    group = nodes_per_step(n, a.group)
    print(f"{n} nodes: grouped shape with {group} node(s) per step ({1 + -(-(n - 1) // group)} steps)", flush=True)
    shapes = ["single", "per_node", "grouped"]
    got: dict[str, list[dict[str, float]]] = {s: [] for s in shapes}
    with tempfile.TemporaryDirectory(prefix="launch-scale-", dir=os.environ.get("TMPDIR", "/tmp")) as base:
        os.chmod(base, 0o755)  # the jobs' processes write here
        for r in range(a.rounds):
            for shape in shapes:
                m = one_job(shape, idle[:n], group, env, base)
                got[shape].append(m)
                print(f"round {r + 1} {shape:9s} step_creates={m['step_creates']:.0f} sruns={m['sruns']:.0f} "
                      f"start_all_s={m['start_all_s']:.2f}", flush=True)
        sizes = [int(x) for x in a.emulate.split(",") if x]
        emu_g = [emulated(s, nodes_per_step(s, 0), base) for s in sizes]
        emu_1 = [emulated(s, 1, base) for s in sizes]
    med = {s: {k: statistics.median(m[k] for m in got[s]) for k in ("step_creates", "sruns", "start_all_s")}
           for s in shapes}
    print(f"\n{'shape':9s} {'step_creates':>12s} {'sruns':>6s} {'start_all_s':>11s}  (medians of {a.rounds})")
    for s in shapes:
        print(f"{s:9s} {med[s]['step_creates']:12.0f} {med[s]['sruns']:6.0f} {med[s]['start_all_s']:11.2f}")
    print("\nemulated (the launch lines with a recording srun):")
    for s, g1, gg in zip(sizes, emu_1, emu_g):
        print(f"  N={s:5d}: per node {g1:5d} sruns, default ({nodes_per_step(s, 0)} per step) {gg:3d}")
    exp_g, exp_1 = (exponent(sizes, emu_g), exponent(sizes, emu_1)) if len(sizes) > 1 else (0.0, 0.0)
    print(f"  growth exponent in N: per node {exp_1:.2f}, default {exp_g:.2f}")
    g, one = med["grouped"], med["per_node"]
    print(" ".join([
        "RESULT", f"nodes={n}", f"group={group}", f"step_creates={g['step_creates']:.0f}", f"sruns={g['sruns']:.0f}",
        f"start_all_s={g['start_all_s']:.2f}", f"per_node_step_creates={one['step_creates']:.0f}",
        f"per_node_sruns={one['sruns']:.0f}", f"per_node_start_all_s={one['start_all_s']:.2f}",
        f"single_step_creates={med['single']['step_creates']:.0f}",
        f"single_start_all_s={med['single']['start_all_s']:.2f}",
        f"ratio_step_creates={one['step_creates'] / max(g['step_creates'], 1):.2f}",
        f"ratio_start_all={one['start_all_s'] / max(g['start_all_s'], 1e-3):.2f}",
        f"emulated_nodes={sizes[-1] if sizes else 0}", f"emulated_step_creates={emu_g[-1] if sizes else 0}",
        f"emulated_per_node_step_creates={emu_1[-1] if sizes else 0}",
        f"step_creates_exp={exp_g:.2f}", f"per_node_step_creates_exp={exp_1:.2f}"]))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BenchError as exc:
        print(f"launch_scale: {exc}", file=sys.stderr)
        sys.exit(1)
