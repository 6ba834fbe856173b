"""GPUs present and counted as planned, none with uncorrected ECC errors (nvidia-smi).

nvidia-smi, not NVML bindings: it is on every GPU node, needs no Python package, and a GPU that
fell off the bus makes it fail or hang, both of which are verdicts here. The query is parsed by
a pure function tested from captured output.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

from slurmkit.health.result import CheckResult, bad, ok, printable, skipped, wait

NAME = "gpus"
QUERY = "index,pci.bus_id,ecc.errors.uncorrected.volatile.total"


@dataclass(frozen=True)
class Gpu:
    index: int
    bus_id: str
    ecc_uncorrected: int | None  # None: not reported ([N/A], a GPU without ECC)


class SmiParseError(ValueError):
    pass


def parse_query(text: str) -> list[Gpu]:
    """``nvidia-smi --query-gpu=QUERY --format=csv,noheader,nounits`` output -> GPUs."""
    gpus = []
    for line in text.splitlines():
        if not line.strip():
            continue
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3 or not parts[0].isdigit():
            raise SmiParseError(f"unexpected nvidia-smi line {printable(line, 200)!r}")
        ecc = int(parts[2]) if parts[2].isdigit() else None
        gpus.append(Gpu(int(parts[0]), parts[1], ecc))
    return gpus


def visible_indices(env: Mapping[str, str]) -> list[int] | None:
    """The GPU indices CUDA_VISIBLE_DEVICES names (Slurm sets it), None when it names none or
    names them by UUID (then only the count is checked)."""
    raw = env.get("CUDA_VISIBLE_DEVICES", "").strip()
    if not raw:
        return None
    items = [x.strip() for x in raw.split(",")]
    return [int(x) for x in items] if all(x.isdigit() for x in items) else None


def check_gpus(planned: int, smi: str, env: Mapping[str, str], timeout_s: float) -> CheckResult:
    if planned == 0:
        return skipped(NAME, "a CPU layout (job.gpus_per_node=0): no GPU to check", gpus_planned=0)
    exe = shutil.which(smi, path=env.get("PATH"))
    if exe is None:
        return skipped(NAME, f"{smi} not found on this node: GPUs not checked", gpus_planned=planned)
    fix = "drain the node (scontrol update nodename=<node> state=drain reason=gpu) and have its GPUs checked"
    try:
        res = subprocess.run([exe, f"--query-gpu={QUERY}", "--format=csv,noheader,nounits"], env=dict(env),
                             stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:  # a GPU that fell off the bus hangs it, but so can a loaded node
        return wait(NAME, f"{smi} did not answer within {timeout_s:g} s",
                    "the GPU query answers (re-checked with a longer deadline)", fix, gpus_planned=planned)
    if res.returncode != 0:
        return bad(NAME, f"{smi} exited {res.returncode}: {printable(res.stderr or res.stdout, 300).strip()}",
                   "the GPU query succeeds on every GPU", fix, gpus_planned=planned)
    try:
        gpus = parse_query(res.stdout)
    except SmiParseError as exc:
        return bad(NAME, str(exc), "nvidia-smi lists every GPU", fix, gpus_planned=planned)
    found = {g.index for g in gpus}
    wanted = visible_indices(env)
    missing = sorted(set(wanted) - found) if wanted is not None else []
    ecc = {g.index: g.ecc_uncorrected for g in gpus if g.ecc_uncorrected}
    figures = {"gpus_found": len(gpus), "gpus_planned": planned, "ecc_uncorrected": sum(ecc.values())}
    if len(gpus) < planned or missing:
        what = f"GPU(s) {missing} of CUDA_VISIBLE_DEVICES missing" if missing else f"{len(gpus)} GPU(s) found"
        return bad(NAME, f"{what}, {planned} planned per node", f"{planned} working GPUs on every node",
                   fix, **figures)
    if ecc:
        detail = ", ".join(f"GPU {i}: {n}" for i, n in sorted(ecc.items()))
        return bad(NAME, f"uncorrected ECC errors since the driver loaded ({detail})",
                   "no uncorrected ECC error", fix + " (a GPU reset clears the volatile count)", **figures)
    return ok(NAME, f"{len(gpus)} GPU(s), {planned} planned, no uncorrected ECC error", **figures)
