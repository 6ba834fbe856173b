"""store.adopt against what a torchtitan user scripts otherwise, side by side in one run.

One DCP save as torchtitan lays it out (``step-N/.metadata`` and one ``__R_0.distcp`` per rank:
``--ranks`` files of ``--mib`` MiB) in a program folder; two destinations: a shared directory
(the "Lustre" tier) and a real S3 bucket (SeaweedFS: the one in $SLURMKIT_S3_ENDPOINT, else one
started here).

* Copy. A, slurmkit: the save adopted as the agents do it: each of ``--nodes`` nodes (a thread
  each) hashes its ranks' files once and copies them to the shared tier, then to S3, each copy
  checked on the tier; then rank 0's agent commits both tiers (manifest last).
  B, baseline: ``cp -r step-N SHARED/`` and then s3fs ``put(recursive=True)`` of the step: what
  a user's post-save script does (``aws s3 cp --recursive``), with no checksum anywhere.
* Repair: one shard of the program's copy damaged (a flipped byte, size unchanged).
  A, slurmkit: each node's put-back (its files checked against the manifest, the damaged one
  fetched from the first tier whose bytes verify). B, baseline: the user cannot tell which file
  is bad (DCP keeps no checksum), so the whole step is fetched again from S3 (s3fs ``get``).
  Both end with the program's folder holding the saved bytes (checked).

Runs alternate A B, B A, ...; the S3 prefixes are written once before timing; medians are reported.

    python tools/bench/adopt.py [--ranks 8] [--nodes 4] [--mib 64] [--runs 3]

Ends with exactly one line
``RESULT adopt_s=... copy_s=... adopt_ratio=... putback_s=... refetch_s=... repair_speedup=...``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # the repository (testkit/)
sys.path.insert(0, HERE)

from ckpt import s3_env  # noqa: E402  (the S3 server the checkpoint bench uses)

from slurmkit.store import adopt  # noqa: E402
from tests.unit.store.rank_threads import run_ranks  # noqa: E402
from slurmkit.store.manifest import METADATA  # noqa: E402
from slurmkit.store.tier import FsspecTier, make_tier  # noqa: E402


def write_save(folder: str, step: int, ranks: int, mib: int) -> str:
    d = os.path.join(folder, f"step-{step}")
    os.makedirs(d)
    block = os.urandom(1 << 20)
    for r in range(ranks):
        with open(os.path.join(d, f"__{r}_0.distcp"), "wb") as f:
            for i in range(mib):
                f.write(block[i % 7:] + block[: i % 7])
    with open(os.path.join(d, METADATA), "wb") as f:
        f.write(os.urandom(64 << 10))
    return d


def adopt_save(path: str, step: int, ranks: int, nodes: int, tiers: dict[str, FsspecTier]) -> None:
    """What the agents do for one save: every node its part, in parallel; rank 0's commits."""
    per = ranks // nodes
    notice = adopt.Notice(step=step, sid=uuid.uuid4().hex[:16], created=time.time(), tiers=list(tiers),
                          world_size=ranks, slots=nodes, algo="crc32", origin="program:torchtitan")
    def node(slot: int) -> None:
        names = adopt.own(adopt.step_files(path), {slot * per + i for i in range(per)}, metadata=slot == 0)
        entries = adopt.hash_entries(path, names, "crc32")
        for t in tiers.values():
            adopt.offer(t, path, notice, entries, slot)
    run_ranks(nodes, node)  # one thread per node, at once; the first error raised here
    for t in tiers.values():
        adopt.commit(t, notice, adopt.wait_acks(t, notice, 60, poll_s=0.05))


def copy_save(path: str, shared: str, s3: FsspecTier) -> None:
    subprocess.run(["cp", "-r", path, shared], check=True)
    s3.fs.put(path, f"{s3.root}/{os.path.basename(path)}", recursive=True)


def damage(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(12345)
        b = f.read(1)
        f.seek(12345)
        f.write(bytes([b[0] ^ 0xFF]))


def same(a: str, b: str) -> bool:
    return subprocess.run(["cmp", "-s", a, b]).returncode == 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--mib", type=int, default=64, help="MiB per rank's file")
    p.add_argument("--runs", type=int, default=3)
    a = p.parse_args()
    if a.ranks % a.nodes:
        raise SystemExit("--ranks must be a multiple of --nodes")
    work = tempfile.mkdtemp(prefix="slurmkit-bench-adopt-")
    env, pid = s3_env(work)
    total = a.ranks * a.mib
    res: dict[str, list[float]] = {"adopt": [], "copy": [], "putback": [], "refetch": []}
    try:
        folder = os.path.join(work, "titan", "checkpoint")
        reference = os.path.join(work, "reference")
        for run in range(a.runs):
            step = 10 * (run + 1)
            path = write_save(folder, step, a.ranks, a.mib)
            shutil.copytree(path, os.path.join(reference, str(step)))
            bucket = f"s3://{env.get('SLURMKIT_S3_BUCKET', 'checkpoints')}/bench-adopt-{uuid.uuid4().hex[:8]}"
            tiers = {"lustre": make_tier("lustre", os.path.join(work, f"shared-a{run}"), env),
                     "object": make_tier("object", f"{bucket}/a", env)}
            s3b = make_tier("object", f"{bucket}/b", env)
            shared_b = os.path.join(work, f"shared-b{run}")
            os.makedirs(shared_b)
            for t in (tiers["object"], s3b):  # the server's first write to a prefix is slow: not counted
                t.write_atomic("warm", b"x")
            order = ["adopt", "copy"] if run % 2 == 0 else ["copy", "adopt"]
            for which in order:
                t0 = time.perf_counter()
                if which == "adopt":
                    adopt_save(path, step, a.ranks, a.nodes, tiers)
                else:
                    copy_save(path, shared_b, s3b)
                res[which].append(time.perf_counter() - t0)

            shard = os.path.join(path, f"__{a.ranks - 1}_0.distcp")
            damage(shard)
            t0 = time.perf_counter()
            fetched = []
            per = a.ranks // a.nodes
            for slot in range(a.nodes):  # (the nodes do this at once; summed here: an upper bound)
                got = adopt.put_back(list(tiers.values()), folder, lambda s: f"step-{s}", step,
                                     {slot * per + i for i in range(per)}, metadata=slot == 0, verified={})
                fetched += got.fetched
            res["putback"].append(time.perf_counter() - t0)
            assert fetched == [os.path.basename(shard)], fetched
            assert same(shard, os.path.join(reference, str(step), os.path.basename(shard)))
            damage(shard)
            t0 = time.perf_counter()
            s3b.fs.get(f"{s3b.root}/step-{step}", folder + "/", recursive=True)
            res["refetch"].append(time.perf_counter() - t0)
            assert same(shard, os.path.join(reference, str(step), os.path.basename(shard)))
            shutil.rmtree(path)
            print(f"run {run + 1}: adopt {res['adopt'][-1]:.2f} s vs cp + s3fs put {res['copy'][-1]:.2f} s; "
                  f"put-back {res['putback'][-1]:.2f} s vs whole-step re-fetch {res['refetch'][-1]:.2f} s",
                  flush=True)
    finally:
        if pid is not None:
            from testkit.s3server import stop_pid

            stop_pid(pid)
        shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in res.items()}
    print(f"{total} MiB in {a.ranks} files on {a.nodes} nodes: adopting costs {med['adopt'] / med['copy']:.2f}x "
          f"a plain copy to both places (it also checksums every file once and checks every copy); "
          f"repairing one damaged shard is {med['refetch'] / med['putback']:.1f}x faster than re-fetching the step")
    print(f"RESULT adopt_s={med['adopt']:.3f} copy_s={med['copy']:.3f} adopt_ratio={med['adopt'] / med['copy']:.2f} "
          f"putback_s={med['putback']:.3f} refetch_s={med['refetch']:.3f} "
          f"repair_speedup={med['refetch'] / med['putback']:.2f} total_mib={total}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
