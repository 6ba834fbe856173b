"""Learning-rate schedule: linear warm-up, then cosine decay to ``min_lr_ratio * lr``.

The schedule is a pure function of the step, so its checkpointed state is a single counter
and a resumed run sets exactly the learning rate the uninterrupted run would have.
"""

from __future__ import annotations

import math

import torch


def lr_at(step: int, *, lr: float, warmup_steps: int, total_steps: int,
          min_lr_ratio: float) -> float:
    """Learning rate of optimizer step ``step`` (1-based)."""
    if warmup_steps and step <= warmup_steps:
        return lr * step / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    floor = lr * min_lr_ratio
    return floor + (lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


class WarmupCosine:
    """Sets the optimizer's lr before each step; state is the number of steps taken."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, lr: float, warmup_steps: int,
                 total_steps: int, min_lr_ratio: float) -> None:
        self.optimizer = optimizer
        self.lr = lr
        self.warmup_steps = warmup_steps
        self.total_steps = total_steps
        self.min_lr_ratio = min_lr_ratio
        self.steps_taken = 0

    def apply(self) -> float:
        """Set the lr of the next step (``steps_taken + 1``) on every param group."""
        value = lr_at(self.steps_taken + 1, lr=self.lr, warmup_steps=self.warmup_steps,
                      total_steps=self.total_steps, min_lr_ratio=self.min_lr_ratio)
        for group in self.optimizer.param_groups:
            group["lr"] = value
        return value

    def advance(self) -> None:
        self.steps_taken += 1

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"steps_taken": torch.tensor(self.steps_taken, dtype=torch.int64)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.steps_taken = int(state["steps_taken"])
