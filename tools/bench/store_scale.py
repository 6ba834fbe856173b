"""How the store's per-rank cost grows with the job size N: real gloo ranks on this machine.

    python tools/bench/store_scale.py --sizes 2,4,8,16 --saves 3 --dir /tmp/scalebench

At each world size N, N real processes join one gloo world (as a trainer's ranks do), one
rank per "node" by default (``--ranks-per-node``; the worst case for the per-node manifest
copy; each node its own NVMe directory, buddy copies on, one shared directory as the Lustre
tier),
with a small DTensor-sharded + replicated state. Each rank builds a CheckpointStore, saves a
few steps (each promoted to the shared tier) and restores. Measured per rank, from inside the
rank, with nothing of the store's own accounting trusted alone:

* bytes received: the kernel's ``bytes_received`` of every TCP socket this process owns
  (``ss -tie``, this process's sockets by inode), the delta over one save (the trainer's own group is idle meanwhile);
* collectives: calls of torch.distributed's tensor collectives (patched counters), plus the
  store coordinator's own operations where they do not go through a process group;
* files listed: directory entries returned by ``os.listdir``/``os.scandir`` (and their
  calls), plus ``os.stat``/``os.lstat`` calls; on restore, stat + list calls;
* sockets opened: socket file descriptors in ``/proc/self/fd`` the store added, counted
  after its construction and after every save (gloo keeps its connections open).

Ranks meet between phases on a multiprocessing barrier (shared-memory semaphores, no sockets,
so the meeting itself is not measured). The growth exponent of each figure in N is the
least-squares slope of log(figure + 1) on log(N) for the median rank other than rank 0;
the mean and the busiest of those ranks (the one per node that fetches the manifest for its
node's disk) and rank 0 (the coordinator: it hosts the rendezvous store and builds the
manifest) get their own exponents, as does the extrapolation to 16,384 ranks. ``--compare REF`` runs the same measurement on another
checkout of slurmkit (e.g. a git worktree of the previous commit) in the same run and prints
both side by side with ratios. The last line is ``RESULT ...``.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import math
import multiprocessing as mp
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TARGET_EXP = 0.2
EXTRAPOLATE_N = 16384
RANKS_PER_NODE = 1
METRICS = ("bytes", "collectives", "listed", "list_calls", "stats", "sockets")


# -- measuring inside one rank ---------------------------------------------------------------
class Probe:
    """Counters patched into os and torch.distributed for the lifetime of one rank."""

    def __init__(self) -> None:
        self.c = dict.fromkeys(("collectives", "listed", "list_calls", "stats"), 0)
        self._patch()

    def reset(self) -> dict[str, int]:
        old, self.c = self.c, dict.fromkeys(self.c, 0)
        return old

    def _patch(self) -> None:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        probe = self
        real_listdir, real_scandir = os.listdir, os.scandir
        real_stat, real_lstat = os.stat, os.lstat

        def listdir(*a: Any, **k: Any) -> list[Any]:
            out = real_listdir(*a, **k)
            probe.c["list_calls"] += 1
            probe.c["listed"] += len(out)
            return out

        class Scan:
            def __init__(self, *a: Any, **k: Any) -> None:
                with real_scandir(*a, **k) as it:
                    self.entries = list(it)
                probe.c["list_calls"] += 1
                probe.c["listed"] += len(self.entries)

            def __iter__(self) -> Any:
                return iter(self.entries)

            def __enter__(self) -> Scan:
                return self

            def __exit__(self, *exc: Any) -> None:
                return None

            def close(self) -> None:
                return None

        def stat(*a: Any, **k: Any) -> Any:
            probe.c["stats"] += 1
            return real_stat(*a, **k)

        def lstat(*a: Any, **k: Any) -> Any:
            probe.c["stats"] += 1
            return real_lstat(*a, **k)

        os.listdir, os.scandir, os.stat, os.lstat = listdir, Scan, stat, lstat  # type: ignore
        for name in ("all_gather", "all_gather_into_tensor", "gather", "broadcast", "scatter",
                     "all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor",
                     "barrier", "all_to_all", "send", "recv", "isend", "irecv"):
            for mod in (c10d, dist):
                real = getattr(mod, name, None)
                if real is None or getattr(real, "_probed", False):
                    continue

                def counted(*a: Any, _real: Any = real, **k: Any) -> Any:
                    probe.c["collectives"] += 1
                    return _real(*a, **k)

                counted._probed = True  # type: ignore[attr-defined]
                setattr(mod, name, counted)


def coordinator_ops() -> int:
    """The store coordinator's operations that bypass process groups (0 where it has none)."""
    try:
        from slurmkit.store import coord
    except ImportError:
        return 0
    counters = getattr(coord, "COUNTERS", None)
    return int(counters.get("store_ops", 0)) if counters else 0


def sockets() -> set[str]:
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:"):
            out.add(target)
    return out


def _own_ports() -> tuple[set[str], set[int]]:
    """(socket inodes, local TCP ports) of this process, from /proc (no scan of others)."""
    inodes = {t[len("socket:["):-1] for t in sockets()}
    ports: set[int] = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as f:
                next(f, None)
                for line in f:
                    cols = line.split()
                    if len(cols) > 9 and cols[9] in inodes:
                        ports.add(int(cols[1].rsplit(":", 1)[1], 16))
        except OSError:
            continue
    return inodes, ports


def bytes_received(pid: int) -> int:
    """Sum of the kernel's per-socket received-byte counters over this process's TCP sockets.

    Asks ``ss`` only for this process's local ports (a kernel-side filter) and keeps the
    sockets whose inode is this process's: on a busy host ``ss -p`` over every socket of
    every process takes seconds per call."""
    del pid  # the inodes identify this process's sockets
    inodes, ports = _own_ports()
    if not ports:
        return 0
    total = 0
    for chunk in range(0, len(ports), 64):  # ss's filter grows with the ports named
        some = sorted(ports)[chunk:chunk + 64]
        expr = " or ".join(f"sport = :{p}" for p in some)
        res = subprocess.run(["ss", "-tineH", f"( {expr} )"], capture_output=True, text=True,
                             check=True)
        mine = False
        for line in res.stdout.splitlines():
            if not line.startswith(("\t", " ")):
                m = re.search(r"\bino:(\d+)", line)
                mine = bool(m and m.group(1) in inodes)
                continue
            if mine:
                m = re.search(r"bytes_received:(\d+)", line)
                total += int(m.group(1)) if m else 0
    return total


def rank_state(rank: int, world: int, step: int) -> dict[str, Any]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(world * 64, dtype=torch.float32).reshape(world * 8, 8) + step
    return {"model": {"w": distribute_tensor(full, mesh, [Shard(0)]),
                      "bias": torch.full((16,), float(step))}, "step": step}


def worker(rank: int, world: int, port: int, root: str, saves: int, repo: str,
           barrier: Any, out: str, per_node: int) -> None:
    sys.path.insert(0, repo)
    warnings.filterwarnings("ignore")
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a hung rank's stacks (run_world)
    import torch
    import torch.distributed as dist

    from slurmkit.store import CheckpointStore, StoreConfig

    pid = os.getpid()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    state = rank_state(rank, world, 0)
    probe = Probe()
    node = f"node{rank // per_node}"
    cfg = StoreConfig(nvme_uri=f"{root}/nvme", lustre_uri=f"{root}/shared", keep_nvme=2,
                      keep_lustre=2, lustre_every_saves=1, write_threads=1)
    # LOCAL_WORLD_SIZE as the node agent sets it: buddy copies on (store.replicas=1)
    env = {"SLURMKIT_RUN_DIR": f"{root}/run", "SLURM_JOB_ID": "1",
           "LOCAL_WORLD_SIZE": str(per_node)}
    barrier.wait()
    socks0 = sockets()
    b0, ops0 = bytes_received(pid), coordinator_ops()
    probe.reset()
    store = CheckpointStore.from_config(cfg, rank=rank, world_size=world, node=node, env=env)
    barrier.wait()
    init = {"bytes": bytes_received(pid) - b0, "collectives": probe.c["collectives"]
            + coordinator_ops() - ops0, "sockets": len(sockets() - socks0)}
    per_save: list[dict[str, int]] = []
    for i in range(saves):
        step = i + 1
        for t in state["model"].values():
            t.to_local().add_(1.0) if hasattr(t, "to_local") else t.add_(1.0)
        state["step"] = step
        barrier.wait()
        b0, ops0 = bytes_received(pid), coordinator_ops()
        probe.reset()
        store.save(step, state)
        store.wait()
        barrier.wait()  # every rank finished this save: nothing of it is still in flight
        c = probe.reset()
        per_save.append({"bytes": bytes_received(pid) - b0,
                         "collectives": c["collectives"] + coordinator_ops() - ops0,
                         "listed": c["listed"], "list_calls": c["list_calls"],
                         "stats": c["stats"], "sockets": len(sockets() - socks0)})
    tmpl = rank_state(rank, world, -1)
    barrier.wait()
    b0, ops0 = bytes_received(pid), coordinator_ops()
    probe.reset()
    res = store.restore(tmpl)
    barrier.wait()
    c = probe.reset()
    restore = {"bytes": bytes_received(pid) - b0,
               "collectives": c["collectives"] + coordinator_ops() - ops0,
               "listed": c["listed"], "list_calls": c["list_calls"], "stats": c["stats"],
               "sockets": len(sockets() - socks0)}
    exact = bool(res is not None and res.step == saves and tmpl["step"] == saves
                 and torch.equal(tmpl["model"]["w"].to_local(), state["model"]["w"].to_local())
                 and torch.equal(tmpl["model"]["bias"], state["model"]["bias"]))
    store.close()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"init": init, "saves": per_save, "restore": restore, "exact": exact}, f)
    barrier.wait()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_world(world: int, saves: int, work: str, repo: str, timeout_s: float,
              per_node: int) -> list[dict[str, Any]]:
    root = tempfile.mkdtemp(prefix=f"n{world}-", dir=work)
    out = os.path.join(root, "out")
    os.makedirs(out)
    # Forked from one server that imported torch and DCP once (not slurmkit: --compare runs
    # another checkout's): the per-save figures are what is measured, not each rank's import.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch.distributed.checkpoint", "torch._dynamo"])
    barrier = ctx.Barrier(world, timeout=timeout_s)
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, world, port, root, saves, repo, barrier, out, per_node))
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(1.0, deadline - time.monotonic()))
    failed = [r for r, p in enumerate(procs) if p.exitcode != 0]
    for p in procs:
        if p.is_alive() and p.pid is not None:
            os.kill(p.pid, signal.SIGUSR1)  # print where it hangs before it goes
    for p in procs:
        if p.is_alive():
            p.join(5.0)
            p.kill()
    if failed:
        raise SystemExit(f"world {world}: ranks {failed} failed (exit codes "
                         f"{[procs[r].exitcode for r in failed]})")
    rows = []
    for r in range(world):
        with open(os.path.join(out, f"rank{r}.json")) as f:
            rows.append(json.load(f))
    shutil.rmtree(root, ignore_errors=True)
    return rows


# -- summarizing ------------------------------------------------------------------------------
def per_save(row: dict[str, Any], key: str) -> float:
    """Median over the saves after the first (the first may set things up), else the first."""
    xs = [s[key] for s in row["saves"]]
    return float(statistics.median(xs[1:] if len(xs) > 1 else xs))


def summarize(rows: list[dict[str, Any]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for key in METRICS:
        vals = [per_save(r, key) for r in rows]
        out[f"save_{key}"] = statistics.median(vals[1:]) if len(vals) > 1 else vals[0]
        out[f"save_{key}_rank0"] = vals[0]
        out[f"save_{key}_max"] = max(vals[1:]) if len(vals) > 1 else vals[0]
        out[f"save_{key}_mean"] = statistics.fmean(vals[1:]) if len(vals) > 1 else vals[0]
        rvals = [float(r["restore"][key]) for r in rows]
        out[f"restore_{key}"] = statistics.median(rvals[1:]) if len(rvals) > 1 else rvals[0]
    out["init_sockets"] = statistics.median(float(r["init"]["sockets"]) for r in rows[1:])
    out["init_bytes"] = statistics.median(float(r["init"]["bytes"]) for r in rows[1:])
    out["exact"] = float(all(r["exact"] for r in rows))
    return out


def slope(ns: list[int], ys: list[float]) -> float:
    """Least-squares slope of log(y) on log(N); a figure that is 0 everywhere is flat."""
    xs = [math.log(n) for n in ns]
    ls = [math.log(max(y, 0.0) + 1.0) for y in ys]  # +1: a zero count stays finite
    mx, my = statistics.fmean(xs), statistics.fmean(ls)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ls)) / den if den else 0.0


def extrapolate(ns: list[int], ys: list[float], n: int) -> float:
    k = slope(ns, ys)
    return (ys[-1] + 1.0) * (n / ns[-1]) ** k - 1.0


def measure(repo: str, sizes: list[int], saves: int, work: str, timeout_s: float,
            per_node: int) -> dict[int, dict[str, float]]:
    out = {}
    for n in sizes:
        t0 = time.perf_counter()
        out[n] = summarize(run_world(n, saves, work, repo, timeout_s, per_node))
        print(f"  [{os.path.basename(repo) or repo}] N={n}: {time.perf_counter() - t0:.1f} s",
              flush=True)
    return out


def table(label: str, sizes: list[int], res: dict[int, dict[str, float]]) -> dict[str, float]:
    print(f"\n{label}: median rank (rank 0, the coordinator, in brackets)")
    print(f"{'N':>5} {'bytes/save':>18} {'collectives':>14} {'listed':>12} {'stat':>12} "
          f"{'sockets':>12} {'restore stat+list':>18}")
    for n in sizes:
        r = res[n]
        print(f"{n:>5} {r['save_bytes']:>9.0f} [{r['save_bytes_rank0']:>6.0f}] "
              f"{r['save_collectives']:>6.0f} [{r['save_collectives_rank0']:>5.0f}] "
              f"{r['save_listed']:>5.0f} [{r['save_listed_rank0']:>4.0f}] "
              f"{r['save_stats']:>5.0f} [{r['save_stats_rank0']:>4.0f}] "
              f"{r['save_sockets']:>5.0f} [{r['save_sockets_rank0']:>4.0f}] "
              f"{r['restore_stats'] + r['restore_list_calls']:>18.0f}")
    exps = {}
    for key, name in (("save_bytes", "bytes_per_rank"), ("save_listed", "listings_per_rank"),
                      ("save_sockets", "sockets_per_rank"),
                      ("save_collectives", "collectives_per_rank"),
                      ("save_stats", "stats_per_rank"),
                      ("restore_stats", "restore_stats_per_rank"),
                      ("restore_list_calls", "restore_lists_per_rank"),
                      ("save_bytes_rank0", "bytes_rank0"),
                      ("save_bytes_mean", "bytes_mean_rank"),
                      ("save_bytes_max", "bytes_busiest_rank")):
        ys = [res[n][key] for n in sizes]
        exps[name] = slope(sizes, ys)
        print(f"  {name:<24} exponent {exps[name]:+.2f}   at N={EXTRAPOLATE_N}: "
              f"{extrapolate(sizes, ys, EXTRAPOLATE_N):,.0f}")
    return exps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="2,4,8,16")
    ap.add_argument("--saves", type=int, default=3)
    ap.add_argument("--dir", default="")
    ap.add_argument("--compare", default="", help="another slurmkit checkout to measure too")
    ap.add_argument("--timeout-s", type=float, default=600.0)
    ap.add_argument("--ranks-per-node", type=int, default=RANKS_PER_NODE)
    args = ap.parse_args(argv)
    sizes = sorted({int(s) for s in args.sizes.split(",")})
    if len(sizes) < 2 or sizes[0] < 2:
        ap.error("--sizes needs at least two world sizes >= 2")
    work = args.dir or tempfile.mkdtemp(prefix="store-scale-")
    os.makedirs(work, exist_ok=True)
    load0 = os.getloadavg()[0]
    per_node = max(1, args.ranks_per_node)
    res = measure(REPO, sizes, args.saves, work, args.timeout_s, per_node)
    ref = measure(os.path.abspath(args.compare), sizes, args.saves, work, args.timeout_s,
                  per_node) if args.compare else None
    exps = table("this checkout", sizes, res)
    if ref is not None:
        ref_exps = table(f"reference ({args.compare})", sizes, ref)
        n = sizes[-1]
        print(f"\nratios at N={n} (reference / this checkout, median rank):")
        for key in ("save_bytes", "save_collectives", "save_listed", "save_stats",
                    "save_sockets", "restore_stats", "restore_list_calls"):
            a, b = ref[n][key], res[n][key]
            print(f"  {key:<20} {a:>10.0f} / {b:>10.0f} = "
                  f"{(a / b) if b else float('inf'):.1f}x")
        for key in ("bytes_per_rank", "listings_per_rank", "sockets_per_rank"):
            print(f"  {key}_exp: reference {ref_exps[key]:+.2f}, this {exps[key]:+.2f}")
    if not args.dir:
        shutil.rmtree(work, ignore_errors=True)
    exact = int(all(res[n]["exact"] for n in sizes))
    ok = all(exps[k] <= TARGET_EXP for k in ("bytes_per_rank", "listings_per_rank",
                                              "sockets_per_rank"))
    print(f"RESULT bytes_per_rank_exp={exps['bytes_per_rank']:.2f} "
          f"listings_per_rank_exp={exps['listings_per_rank']:.2f} "
          f"sockets_per_rank_exp={exps['sockets_per_rank']:.2f} "
          f"collectives_per_rank_exp={exps['collectives_per_rank']:.2f} "
          f"restore_stats_exp={exps['restore_stats_per_rank']:.2f} "
          f"bytes_mean_exp={exps['bytes_mean_rank']:.2f} "
          f"bytes_busiest_exp={exps['bytes_busiest_rank']:.2f} "
          f"bytes_rank0_exp={exps['bytes_rank0']:.2f} "
          f"sizes={'/'.join(map(str, sizes))} bit_exact={exact} target={TARGET_EXP} "
          f"within_target={int(ok)} load1={load0:.1f}/{os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
