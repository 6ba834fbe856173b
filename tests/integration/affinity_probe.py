"""A rank program that records what the kernel says about its own pinning.

Run by the node agent as ``job.command=[python,<this file>]``; writes
``$SLURMKIT_RUN_DIR/affinity/rank<RANK>.json`` with the kernel's view (``/proc/self/status``
and the task memory policy from ``/proc/self/numa_maps``) next to the plan the agent handed
over in the environment. It checks nothing itself: the test compares the two.
"""

from __future__ import annotations

import json
import os
import socket


def status_fields(path: str = "/proc/self/status") -> dict[str, str]:
    """``Name: value`` lines of a procfs status file."""
    out: dict[str, str] = {}
    with open(path) as f:
        for line in f:
            key, _, value = line.partition(":")
            out[key.strip()] = value.strip()
    return out


def task_mempolicy(path: str = "/proc/self/numa_maps") -> str:
    """The policy column of the first mapping, e.g. ``prefer:0`` or ``default``.

    A mapping without its own policy shows the task's policy (set by the pin wrapper before
    exec), so the first line tells what the rank runs under.
    """
    with open(path) as f:
        first = f.readline().split()
    return first[1] if len(first) > 1 else ""


def main() -> None:
    status = status_fields()
    record = {
        "rank": int(os.environ["RANK"]),
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "node": os.environ.get("SLURMKIT_NODE", ""),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "cpus_allowed_list": status.get("Cpus_allowed_list", ""),
        "mems_allowed_list": status.get("Mems_allowed_list", ""),
        "sched_getaffinity": sorted(os.sched_getaffinity(0)),
        "mempolicy": task_mempolicy(),
        "SLURMKIT_CPUS": os.environ.get("SLURMKIT_CPUS"),
        "SLURMKIT_MEM_NODES": os.environ.get("SLURMKIT_MEM_NODES"),
        "SLURMKIT_MEM_POLICY": os.environ.get("SLURMKIT_MEM_POLICY"),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
    }
    out_dir = os.path.join(os.environ["SLURMKIT_RUN_DIR"], "affinity")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"rank{record['rank']}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(record, f, indent=1)
    os.replace(path + ".tmp", path)
    print(f"rank {record['rank']}: cpus {record['cpus_allowed_list']} plan {record['SLURMKIT_CPUS']}",
          flush=True)


if __name__ == "__main__":
    main()
