"""Schemas of the model, parallel layout and training loop. Owned by the train package."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ModelConfig:
    name: str = "tiny"


@dataclass
class ParallelConfig:
    tensor: int = 1


@dataclass
class TrainConfig:
    steps: int = 20
