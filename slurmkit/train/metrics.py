"""Per-step training metrics as JSON lines ($SLURMKIT_RUN_DIR/metrics.jsonl, rank 0)."""

from __future__ import annotations

import json
import os
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


class MetricsWriter:
    """Appends one JSON object per step; line-buffered so a reader sees whole steps."""

    def __init__(self, path: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path = path
        self._file = open(path, "a", encoding="utf-8", buffering=1)

    def write(self, metrics: StepMetrics) -> None:
        self._file.write(json.dumps(asdict(metrics)) + "\n")

    def close(self) -> None:
        self._file.close()
