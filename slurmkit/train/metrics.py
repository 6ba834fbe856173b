"""Per-step training metrics as JSON lines ($SLURMKIT_RUN_DIR/metrics.jsonl, rank 0)."""

from __future__ import annotations

import json
import os
import sys
import threading
from dataclasses import asdict, dataclass

from slurmkit.train.flops import mfu


@dataclass(frozen=True)
class StepMetrics:
    step: int
    loss: float  # mean next-token cross-entropy over all ranks
    lr: float
    step_time_s: float  # wall time of the step, checkpoint blocking included
    tokens_per_s: float  # all ranks together
    mfu: float  # model FLOPs utilisation of one device, 0..1
    ckpt_blocking_s: float  # time the step spent handing a checkpoint to the store
    generation: int


def step_metrics(*, step: int, loss: float, lr: float, step_time_s: float, tokens: int,
                 world_size: int, flops_per_token: float, peak_tflops: float,
                 ckpt_blocking_s: float, generation: int) -> StepMetrics:
    """Derive throughput and MFU from one step's tokens (global) and wall time."""
    tps = tokens / step_time_s if step_time_s > 0 else 0.0
    return StepMetrics(step=step, loss=loss, lr=lr, step_time_s=step_time_s, tokens_per_s=tps,
                       mfu=mfu(tps / world_size, flops_per_token, peak_tflops),
                       ckpt_blocking_s=ckpt_blocking_s, generation=generation)


def step_line(m: StepMetrics, total: int) -> str:
    """The step as one line a person reads in the rank log (``slurmkit logs -f``), e.g.
    ``step 20/60 loss 4.1234 lr 3.0e-04 0.25 s/step 12,345 tok/s mfu 1.2% ckpt 0.031 s``."""
    line = (f"step {m.step}/{total} loss {m.loss:.4f} lr {m.lr:.1e} {m.step_time_s:.3g} s/step "
            f"{m.tokens_per_s:,.0f} tok/s mfu {m.mfu:.1%}")
    return line + (f" ckpt {m.ckpt_blocking_s:.3f} s" if m.ckpt_blocking_s > 0 else "")


class MetricsWriter:
    """Appends one JSON object per step.

    ``flush_interval_s=0``: line-buffered, a reader sees every step at once. A positive interval
    (the trainer's): lines are held in memory and a daemon thread writes them every interval
    and at ``close``, so the training step itself never writes to the run directory (on a
    shared file system a slow server would stall rank 0's step, and every rank with it)."""

    def __init__(self, path: str, *, flush_interval_s: float = 0.0) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path = path
        self._file = open(path, "a", encoding="utf-8", buffering=1 if flush_interval_s <= 0 else -1)
        self._interval = flush_interval_s
        self._held: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if flush_interval_s > 0:
            self._thread = threading.Thread(target=self._flusher, name="metrics-flush", daemon=True)
            self._thread.start()

    def write(self, metrics: StepMetrics) -> None:
        line = json.dumps(asdict(metrics)) + "\n"
        if self._thread is None:
            self._file.write(line)
            return
        with self._lock:
            self._held.append(line)

    def flush(self) -> None:
        with self._lock:
            lines, self._held = self._held, []
        if lines:
            try:
                self._file.write("".join(lines))
                self._file.flush()
            except OSError as exc:  # metrics are for people: a full disk must not end training
                print(f"slurmkit: cannot write {self.path}: {exc}", file=sys.stderr, flush=True)

    def _flusher(self) -> None:
        while not self._stop.wait(self._interval):
            self.flush()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10.0)
        self.flush()
        self._file.close()
