"""The sweep directory: ``<run_root>/<job.name>/<stamp>-sweep/`` with ``sweep.json`` and one
ordinary run directory per variant, ``<sweep_dir>/<index>/``.

Variant directories are named by their array index so that Slurm can place each task's batch
log itself (``--output=<sweep_dir>/%a/logs/...``) and every task finds its own directory from
SLURM_ARRAY_TASK_ID. ``sweep.json`` is the one record of which overrides each index runs; it is
written whole to a temporary name and renamed, so a reader never sees half of it.

sweep.json: {"kind": "sweep", "name": str, "job_id": str|null, "array": "0-3",
"executor": "slurm"|"local", "common_overrides": [...], "runner_pid": int (local only),
"variants": [{"index": 0, "overrides": ["train.lr=1e-3", ...], "run_dir": "<abs path>"}, ...]}
(``overrides`` holds what tells the variant apart; ``common_overrides`` what all share.)

A leaf module (it was slurmkit.sweep.layout): a node agent finds its variant's run directory
here (slurmkit.launch.context.task_run_dir) while the sweep package starts local variants
through slurmkit.launch, and the report reads sweep.json without the sweep package.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from slurmkit.atomic import atomic_write
from slurmkit.errors import ConfigError
from slurmkit.rundir import RUN_DIR_MODE
from slurmkit.runfiles import SWEEP_NAME
from slurmkit.untrusted import UntrustedDataError, parse_object, read_regular

SUFFIX = "-sweep"
MAX_SWEEP_BYTES = 64 * 1024 * 1024  # ~100 bytes per override: far beyond Slurm's MaxArraySize


@dataclass
class Variant:
    index: int
    overrides: list[str]  # what sets this variant apart (the swept values)
    run_dir: str  # absolute


@dataclass
class Sweep:
    sweep_dir: str  # absolute
    name: str
    array: str  # Slurm's --array range, without the throttle, e.g. "0-3"
    executor: str
    common_overrides: list[str]
    variants: list[Variant]
    job_id: str | None = None  # the Slurm array's job id; None before submission and for local
    runner_pid: int | None = None  # the local executor's runner (slurmkit/sweep/local.py)

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "kind": "sweep", "name": self.name, "job_id": self.job_id, "array": self.array,
            "executor": self.executor, "common_overrides": list(self.common_overrides),
            "variants": [{"index": v.index, "overrides": list(v.overrides), "run_dir": v.run_dir}
                         for v in self.variants]}
        if self.runner_pid is not None:
            doc["runner_pid"] = self.runner_pid
        return doc


def variant_dir(sweep_dir: str, index: int) -> str:
    return os.path.join(sweep_dir, str(index))


def new_sweep_dir(run_root: str, name: str, clock: Callable[[], float] = time.time) -> str:
    """Create ``<run_root>/<name>/<stamp>-sweep`` (a second sweep within the same second gets a
    random tag before the suffix); the directory is new, never shared with another submission."""
    parent = os.path.abspath(os.path.join(run_root, name))
    os.makedirs(parent, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(clock()))
    for tag in ["", *(f"-{secrets.token_hex(2)}" for _ in range(8))]:
        path = os.path.join(parent, f"{stamp}{tag}{SUFFIX}")
        try:
            os.mkdir(path)
        except FileExistsError:
            continue
        os.chmod(path, RUN_DIR_MODE)  # private, like a run directory (slurmkit/rundir.py)
        return path
    raise ConfigError(f"no free sweep directory name under {parent}", "a new directory per sweep",
                      "remove stale directories there or wait a second")


def write_sweep(sweep: Sweep) -> str:
    path = os.path.join(sweep.sweep_dir, SWEEP_NAME)
    atomic_write(path, json.dumps(sweep.to_json(), indent=1) + "\n", mode=None)
    return path


def _bad(path: str, what: str) -> ConfigError:
    return ConfigError(f"{path}: {what}", "the sweep.json that `slurmkit submit -m` wrote",
                       "resubmit the sweep; do not edit sweep.json by hand")


def load_sweep(sweep_dir: str) -> Sweep:
    """Read and check ``sweep.json`` (it lives on a shared file system: trust nothing in it).

    Every variant's run directory must be ``<sweep_dir>/<index>``, so a tampered file cannot send
    a task to write into some other directory.
    """
    sweep_dir = os.path.abspath(sweep_dir)
    path = os.path.join(sweep_dir, SWEEP_NAME)
    try:  # never a FIFO waited on or a link followed; within size, depth and number limits
        doc = parse_object(read_regular(path, MAX_SWEEP_BYTES), max_bytes=MAX_SWEEP_BYTES)
    except (OSError, UntrustedDataError) as exc:
        raise _bad(path, f"cannot be read ({exc})") from None
    if doc.get("kind") != "sweep" or not isinstance(doc.get("variants"), list):
        raise _bad(path, "not a sweep record (kind/variants missing)")
    for key in ("name", "array", "executor"):
        if not isinstance(doc.get(key, ""), str):
            raise _bad(path, f"{key} is a {type(doc[key]).__name__}, not a string")
    common, job_id, pid = doc.get("common_overrides", []), doc.get("job_id"), doc.get("runner_pid")
    if not _strings(common):
        raise _bad(path, "common_overrides is not a list of strings")
    if not isinstance(job_id, (str, int, type(None))) or isinstance(job_id, bool):
        raise _bad(path, f"job_id is a {type(job_id).__name__}, not a string")
    return Sweep(sweep_dir=sweep_dir, name=doc.get("name", ""), array=doc.get("array", ""),
                 executor=doc.get("executor", "slurm"), common_overrides=list(common),
                 variants=_variants(doc["variants"], sweep_dir, path),
                 job_id=None if job_id is None else str(job_id),
                 runner_pid=pid if isinstance(pid, int) and not isinstance(pid, bool) else None)


def _strings(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(o, str) for o in value)


def _variants(raw: list[Any], sweep_dir: str, path: str) -> list[Variant]:
    variants = []
    for i, v in enumerate(raw):
        if not isinstance(v, dict) or v.get("index") != i or isinstance(v.get("index"), bool):
            raise _bad(path, f"variant {i} is malformed or out of order")
        if not _strings(v.get("overrides")):
            raise _bad(path, f"variant {i} has no list of overrides")
        if v.get("run_dir") != variant_dir(sweep_dir, i):
            raise _bad(path, f"variant {i} names run directory {str(v.get('run_dir'))[:200]!r}, "
                             f"not {variant_dir(sweep_dir, i)!r}")
        variants.append(Variant(i, list(v["overrides"]), variant_dir(sweep_dir, i)))
    return variants


def is_sweep_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, SWEEP_NAME))
