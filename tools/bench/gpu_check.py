"""What only a GPU can show, in one run: MFU, the supervisor's NCCL path, pinning on a real node.

Everything goes through the real entry point (``python -m slurmkit.submit``, ``cluster=local``:
the node agents as local processes, as on a laptop without Slurm) and is read back from the
run directory (``metrics.jsonl``, ``ledger.jsonl``, ``nccl_trace/``):

1. ``node``: ``nvidia-smi -L``, ``python -m slurmkit.topo show`` and ``plan`` on this machine.
2. ``pin``: a one-rank job whose program is this file (``--probe``): it prints the CPUs, NUMA
   memory policy, device and NIC variables the agent gave it (the pin wrapper's work).
3. ``mfu``: the reference trainer on Llama 3 8B's shapes at reduced depth (``--layers``), bf16,
   sequence 8192, one GPU, eager and with ``train.compile=true``. MFU is the trainer's own
   figure (6N + 12 L d s FLOPs per token over the H100/H200 dense bf16 peak, 989 TFLOP/s), the
   median over the steps after ``--skip`` (the first ones compile and warm up).
4. ``nccl``: two emulated nodes of one rank each on the same GPU, NCCL over its socket transport
   (each node gets its own ``NCCL_HOSTID`` through ``--as-host``; NCCL refuses two ranks of one
   communicator on one GPU of one host). Rank 1 hits an NCCL error before step 6 (the injected
   ``nccl_abort``: the NCCL line, then SIGABRT; rank 0 then loses its peer for real), rank 0
   stalls in data loading before step 14 while rank 1 waits in the all-reduce (a real hang
   inside an NCCL collective). The supervisor must restart both times and the run complete;
   before the hung generation is killed the agents write the flight recorder's FIFOs, and the
   dumps must be in ``nccl_trace/``.

Each section runs under its own time limit and records what failed; the last line is
``RESULT key=value ...``. ``--rehearse`` runs the same sections on CPU (gloo, the tiny model,
no GPU), to try the script before a GPU session.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import statistics
import subprocess
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SELF = os.path.abspath(__file__)


# ---- helpers run as the job's program ---------------------------------------------------------
def probe() -> int:
    """Print what the agent gave this rank: CPUs, memory policy, device, NIC variables."""
    status = {}
    with open("/proc/self/status", encoding="utf-8") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("Cpus_allowed_list", "Mems_allowed_list"):
                status[key] = value.strip()
    try:
        with open("/proc/self/numa_maps", encoding="utf-8") as f:
            policy = f.readline().split()[1]  # e.g. "default", "bind:0", "prefer:0"
    except (OSError, IndexError):
        policy = "unknown"
    keys = ("CUDA_VISIBLE_DEVICES", "SLURMKIT_DEVICE", "LOCAL_RANK", "RANK", "WORLD_SIZE",
            "NCCL_IB_HCA", "NCCL_SOCKET_IFNAME", "UCX_NET_DEVICES", "OMP_NUM_THREADS")
    out = {"cpus": status.get("Cpus_allowed_list"), "mems": status.get("Mems_allowed_list"),
           "numa_policy": policy, "affinity_count": len(os.sched_getaffinity(0)),
           "env": {k: os.environ[k] for k in keys if k in os.environ}}
    try:
        import torch
        if torch.cuda.is_available():
            out["cuda_device_count"] = torch.cuda.device_count()
            out["cuda_name"] = torch.cuda.get_device_name(0)
    except Exception as exc:  # the probe reports, it does not fail
        out["torch_error"] = repr(exc)
    print("PIN_PROBE " + json.dumps(out, sort_keys=True), flush=True)
    return 0


def as_host(argv: list[str]) -> int:
    """exec ``argv`` with an NCCL host id of this emulated node (GROUP_RANK, the node's slot)."""
    os.environ["NCCL_HOSTID"] = f"slurmkit-check-node{os.environ.get('GROUP_RANK', '0')}"
    if argv[:1] == ["python"]:  # the agent's own interpreter, as the agent does for job.command
        argv = [sys.executable, *argv[1:]]
    os.execvp(argv[0], argv)
    return 127  # not reached


# ---- the driver -----------------------------------------------------------------------------------
def run(cmd: list[str], log: str, timeout_s: float, env: dict[str, str] | None = None) -> tuple[int, float]:
    """Run ``cmd`` with its output in ``log``; (exit code or 124 on timeout, seconds)."""
    start = time.monotonic()
    with open(log, "w", encoding="utf-8") as out:
        out.write("$ " + " ".join(cmd) + "\n")
        out.flush()
        try:
            proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s,
                                  cwd=ROOT, env=env, check=False)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = 124
    return rc, time.monotonic() - start


def tail(path: str, lines: int = 15) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def submit(work: str, name: str, overrides: list[str], timeout_s: float) -> tuple[int, float, str | None]:
    """``slurmkit submit ... submit.wait=true``; (exit code, seconds, run directory or None)."""
    log = os.path.join(work, f"{name}.log")
    cmd = [sys.executable, "-m", "slurmkit.submit", "cluster=local", f"job.name={name}",
           f"submit.run_root={work}/runs", "submit.wait=true", *overrides]
    rc, secs = run(cmd, log, timeout_s)
    found = sorted(glob.glob(os.path.join(work, "runs", name, "*", "ledger.jsonl")))
    return rc, secs, os.path.dirname(found[-1]) if found else None


def jsonl(path: str) -> list[dict[str, Any]]:
    out = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue
    except OSError:
        pass
    return out


def section_node(work: str, results: dict[str, Any]) -> None:
    for name, cmd in (("nvidia_smi", ["nvidia-smi", "-L"]),
                      ("topo_show", [sys.executable, "-m", "slurmkit.topo", "show"]),
                      ("topo_plan", [sys.executable, "-m", "slurmkit.topo", "plan"])):
        try:
            rc, _ = run(cmd, os.path.join(work, f"{name}.log"), 60)
        except FileNotFoundError:
            rc = 127
        results[f"{name}_rc"] = rc
        print(f"--- {name} (rc {rc})\n{tail(os.path.join(work, f'{name}.log'), 25)}", flush=True)


def matmul_tflops(results: dict[str, Any]) -> None:
    """The ceiling MFU is read against: an 8192^3 bf16 matrix product on random data (mean of
    20 after 3 warm-ups, timed with CUDA events)."""
    import torch
    results["torch"] = torch.__version__
    if not torch.cuda.is_available():
        return
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        a @ b
    end.record()
    torch.cuda.synchronize()
    tflops = 2 * 8192**3 * 20 / (start.elapsed_time(end) / 1e3) / 1e12
    results["matmul_tflops"] = round(tflops)
    print(f"--- bf16 matmul 8192^3: {tflops:.0f} TFLOP/s ({torch.cuda.get_device_name(0)}, torch {torch.__version__})",
          flush=True)
    del a, b
    torch.cuda.empty_cache()


def section_pin(work: str, gpu: bool, results: dict[str, Any]) -> None:
    rc, secs, run_dir = submit(work, "pin", [
        "+exp=tiny", "job.nodes=1", "job.ranks_per_node=1", f"job.gpus_per_node={1 if gpu else 0}",
        f"job.command=[python,{SELF},--probe]", "supervisor.require_heartbeat=false",
        "supervisor.exit0_after_signal=completed"], 300)
    results["pin_rc"] = rc
    probe_line = ""
    for path in glob.glob(os.path.join(run_dir or "/nonexistent", "logs", "rank*.log")):
        with open(path, encoding="utf-8", errors="replace") as f:
            probe_line = next((ln for ln in f if ln.startswith("PIN_PROBE ")), probe_line)
    if probe_line:
        seen = json.loads(probe_line.split(" ", 1)[1])
        results["pin_cpus"] = seen.get("cpus")
        results["pin_policy"] = seen.get("numa_policy")
        results["pin_device"] = seen.get("env", {}).get("SLURMKIT_DEVICE") or seen.get("env", {}).get(
            "CUDA_VISIBLE_DEVICES")
        print(f"--- pin probe: {json.dumps(seen, sort_keys=True)}", flush=True)
    else:
        print(f"--- pin: no probe line (rc {rc}, {secs:.0f} s)\n{tail(os.path.join(work, 'pin.log'))}",
              flush=True)


def section_mfu(work: str, gpu: bool, layers: int, steps: int, skip: int, compiled: bool,
                results: dict[str, Any]) -> None:
    tag = "compiled" if compiled else "eager"
    if gpu:
        shape = ["+exp=llama8b", f"model.n_layers={layers}", "job.gpus_per_node=1",
                 "train.seq_len=8192", "train.micro_batch=1", "train.global_batch=2",
                 "parallel.activation_checkpointing=false", "parallel.strategy=ddp"]
    else:
        shape = ["+exp=tiny", "job.gpus_per_node=0", "train.seq_len=128", "train.micro_batch=4",
                 "train.global_batch=8"]
    rc, secs, run_dir = submit(work, f"mfu-{tag}", [
        *shape, "job.nodes=1", "job.ranks_per_node=1", f"train.steps={steps}",
        "train.ckpt_interval_steps=0", "train.ckpt_at_end=false", "train.deterministic=false",
        f"train.compile={'true' if compiled else 'false'}", "train.warmup_steps=2",
        "supervisor.warm_standby=false"], 900)
    rows = [r for r in jsonl(os.path.join(run_dir or "/nonexistent", "metrics.jsonl")) if r.get("step", 0) > skip]
    results[f"mfu_{tag}_rc"] = rc
    if rows:
        mfu = statistics.median(r["mfu"] for r in rows)
        tps = statistics.median(r["tokens_per_s"] for r in rows)
        step = statistics.median(r["step_time_s"] for r in rows)
        results[f"mfu_{tag}"] = round(mfu, 4)
        results[f"tokens_per_s_{tag}"] = round(tps)
        results[f"step_s_{tag}"] = round(step, 4)
        print(f"--- mfu {tag}: MFU {mfu:.1%}, {tps:,.0f} tokens/s, {step:.3f} s/step "
              f"(median of {len(rows)} steps after step {skip}; job {secs:.0f} s)", flush=True)
    else:
        print(f"--- mfu {tag}: no metrics (rc {rc}, {secs:.0f} s)\n{tail(os.path.join(work, f'mfu-{tag}.log'), 30)}",
              flush=True)
        for agent_log in glob.glob(os.path.join(run_dir or "/nonexistent", "submitit", "*_log.*")):
            print(f"{agent_log}:\n{tail(agent_log, 30)}", flush=True)


def section_nccl(work: str, gpu: bool, results: dict[str, Any]) -> None:
    rc, secs, run_dir = submit(work, "nccl", [
        "+exp=tiny", "job.nodes=2", "job.ranks_per_node=1", f"job.gpus_per_node={1 if gpu else 0}",
        f"job.command=[python,{SELF},--as-host,python,-m,slurmkit.train]",
        "supervisor.require_heartbeat=true", "supervisor.heartbeat_timeout_s=10",
        "supervisor.exit0_after_signal=completed", "train.steps=30", "train.ckpt_interval_steps=4",
        "train.deterministic=false", "+job.env.SLURMKIT_FAULT='nccl_abort:1:6:once;data_stall:0:14:once'",
        "+job.env.NCCL_DEBUG=WARN"], 600)
    results["nccl_rc"] = rc
    events = jsonl(os.path.join(run_dir or "/nonexistent", "ledger.jsonl"))
    failures = [e for e in events if e.get("event") == "failure"]
    decisions = [e for e in events if e.get("event") == "decision"]
    resumed = [e for e in events if e.get("event") == "train_resumed"]
    ends = [e for e in events if e.get("event") == "end"]
    results["nccl_end"] = ends[-1].get("status") if ends else "none"
    print(f"--- nccl job: rc {rc}, {secs:.0f} s, end {results['nccl_end']}", flush=True)
    for i, f in enumerate(failures):
        cls = f.get("cls")
        detect = f["t"] - f.get("time_of_fault", f["t"])
        after = [r["t"] for r in resumed if r["t"] > f["t"]]
        resume = (after[0] - f.get("time_of_fault", f["t"])) if after else None
        decision = next((d for d in decisions if d["t"] >= f["t"]), {})
        results[f"fault{i}_class"] = cls
        results[f"fault{i}_rank"] = f.get("rank")
        results[f"fault{i}_detect_s"] = round(detect, 2)
        results[f"fault{i}_resume_s"] = round(resume, 2) if resume is not None else "none"
        results[f"fault{i}_action"] = decision.get("action")
        print(f"  failure {i}: {cls} rank {f.get('rank')} ({f.get('node')}): detected {detect:.2f} s after "
              f"the fault, resumed {resume if resume is None else round(resume, 2)} s after; "
              f"decision {decision.get('action')}\n    evidence: {str(f.get('evidence'))[:300]}\n"
              f"    stack: {str(f.get('stack', ''))[:300]}", flush=True)
    fr_traces = 0
    for h in (e for e in events if e.get("event") == "hang_stacks"):
        for r in h.get("ranks", []):
            trace = r.get("trace") if isinstance(r.get("trace"), dict) else {}
            fr_traces += "enqueued" in trace
            print(f"  hang stacks {h.get('node')} rank {r.get('rank')}: place {r.get('place')}, "
                  f"source {r.get('source')}, where {str(r.get('where'))[:200]}; "
                  f"flight recorder {trace or 'none'}", flush=True)
    results["flight_recorder_traces"] = fr_traces  # the trainer's own JSON traces, any backend
    traces = sorted(glob.glob(os.path.join(run_dir or "/nonexistent", "nccl_trace", "*")))
    results["flight_recorder_dumps"] = len(traces)
    for t in traces:
        print(f"  flight recorder dump: {t} ({os.path.getsize(t)} bytes)", flush=True)
    nccl_lines = []
    for path in sorted(glob.glob(os.path.join(run_dir or "/nonexistent", "logs", "rank*.log"))):
        with open(path, encoding="utf-8", errors="replace") as f:
            nccl_lines += [f"{os.path.basename(path)}: {ln.rstrip()[:240]}" for ln in f
                           if "NCCL" in ln and ("WARN" in ln or "rror" in ln)]
    print("  rank log NCCL lines (first 12):\n    " + "\n    ".join(nccl_lines[:12]), flush=True)
    if not failures:
        print(tail(os.path.join(work, "nccl.log"), 30), flush=True)


def main(argv: list[str] | None = None) -> int:
    args_in = sys.argv[1:] if argv is None else argv
    if args_in[:1] == ["--probe"]:
        return probe()
    if args_in[:1] == ["--as-host"]:
        return as_host(args_in[1:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", default="/tmp/slurmkit-gpu-check", help="runs and logs go here")
    ap.add_argument("--rehearse", action="store_true", help="CPU only: gloo, the tiny model")
    ap.add_argument("--layers", type=int, default=4, help="transformer blocks of the llama8b shape")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--skip", type=int, default=3, help="first steps left out of the medians")
    ap.add_argument("--sections", default="node,pin,mfu,compiled,nccl")
    args = ap.parse_args(args_in)
    os.makedirs(args.work, exist_ok=True)
    gpu = not args.rehearse
    results: dict[str, Any] = {"gpu": int(gpu)}
    wanted = args.sections.split(",")
    t0 = time.monotonic()
    for name in wanted:
        started = time.monotonic()
        print(f"=== {name} ({started - t0:.0f} s)", flush=True)
        try:
            if name == "node":
                section_node(args.work, results)
                matmul_tflops(results)
            elif name == "pin":
                section_pin(args.work, gpu, results)
            elif name in ("mfu", "compiled"):
                section_mfu(args.work, gpu, args.layers, args.steps, args.skip, name == "compiled", results)
            elif name == "nccl":
                section_nccl(args.work, gpu, results)
        except Exception as exc:  # one section's failure must not hide the others' figures
            results[f"{name}_error"] = re.sub(r"\s+", "_", repr(exc))[:80]
            print(f"--- {name} failed: {exc!r}", flush=True)
        results[f"{name}_s"] = round(time.monotonic() - started, 1)
    print("RESULT " + " ".join(f"{k}={v}" for k, v in results.items()), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
