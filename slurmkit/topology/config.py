"""Schema of the per-rank pinning policy. Owned by the topology package."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TopologyConfig:
    enabled: bool = True
