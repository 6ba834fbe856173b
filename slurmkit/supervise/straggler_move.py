"""What node 0 does about a node the straggler detector named (health.straggler_action).

``report``: the node is named in the ledger (``straggler``) and in `slurmkit status`.
``replace``: named the same way, then moved out at the next durable checkpoint: node 0 waits
until a checkpoint newer than the naming is committed (the step the checkpoint store's
``latest.json`` says, as the crash-loop rule reads it: slurmkit.supervise.ckpt_progress), then
stops the generation with a ``straggler`` failure; its decision (policy.decide) gives the slot
to a spare and the next generation resumes from that checkpoint. Only the steps after it are
lost, the same as any restart. With no spare at the naming, the node is reported only (the
ledger event says so): a slow node is never a reason to requeue.

A move belongs to the generation that named it: a generation that ends first (another failure,
the end of training) drops it, and the next generation's detector names the node again if it
is still slow.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from slurmkit.failures.classes import FailureClass
from slurmkit.failures.classify import Evidence, Failure
from slurmkit.supervise.stragglers import Named

log = logging.getLogger(__name__)


class Ledger(Protocol):
    def append(self, event: str, **fields: Any) -> Any: ...


@dataclass(frozen=True)
class Move:
    """A straggler node 0 stops a generation for, at checkpoint step ``ckpt_step``."""

    named: Named
    generation: int
    ckpt_step: int
    at: float  # epoch seconds when node 0 stopped the generation (its evidence's time)

    def evidence(self) -> Evidence:
        x = self.named
        return Evidence(self.at, x.node, -1, "agent", FailureClass.STRAGGLER,
                        f"straggler: score {x.score:.2f} (rank {x.rank}: {x.own_s:.4f} s of own work per step, "
                        f"job median {x.job_median_s:.4f} s) for {x.windows} windows, named at step {x.step}; "
                        f"the generation stopped after checkpoint step {self.ckpt_step} committed")

    def figures(self) -> dict[str, Any]:
        x = self.named
        return {"node": x.node, "score": x.score, "rank": x.rank, "own_s": x.own_s,
                "job_median_s": x.job_median_s, "windows": x.windows, "named_step": x.step,
                "ckpt_step": self.ckpt_step, "sections": dict(x.sections)}


@dataclass(frozen=True)
class _Pending:
    named: Named
    generation: int
    baseline: int | None  # the newest committed step node 0 had seen at the naming
    threshold: float


class StragglerActions:
    """Node 0's straggler actions across generations. ``committed`` returns the newest committed
    checkpoint step without blocking (CheckpointProgress.peek): it is called at most once per
    beat interval, and only while a move waits."""

    def __init__(self, action: str, ledger: Ledger, *, committed: Callable[[], int | None],
                 wall: Callable[[], float] = time.time) -> None:
        self.action, self.ledger = action, ledger
        self._committed, self._wall = committed, wall
        self._pending: list[_Pending] = []
        self._moves: dict[int, Move] = {}  # generation -> the move that stopped it
        self._decided: dict[int, Move] = {}  # generation -> its move, once it was the root cause

    def named(self, x: Named, generation: int, *, threshold: float, spares: int) -> None:
        """``x`` was just named: log it, write the ledger event, and plan its move."""
        log.warning("straggler: %s scores %.2f (rank %d: %.4f s of own work per step, job median "
                    "%.4f s) for %d windows in a row", x.node, x.score, x.rank, x.own_s, x.job_median_s, x.windows)
        plan: dict[str, str] = {}
        if self.action == "replace":
            if spares > 0:
                baseline = self._committed()
                self._pending.append(_Pending(x, generation, baseline, threshold))
                plan["plan"] = (f"moved onto a spare at the first checkpoint committed after step {x.step} "
                                f"(newest committed now: {baseline})")
            else:
                plan["plan"] = "reported only: no spare node left to move it onto"
        self._record(x, generation, threshold, **plan)

    def _record(self, x: Named, generation: int, threshold: float, **plan: str) -> None:
        self.ledger.append("straggler", node=x.node, score=x.score, generation=generation, rank=x.rank,
                           own_s=x.own_s, job_median_s=x.job_median_s, windows=x.windows, step=x.step,
                           sections=dict(x.sections), threshold=threshold, action=self.action, **plan)

    def due(self, generation: int, *, spares: int) -> Move | None:
        """The move to make now (node 0 stops ``generation`` for it), or None: no straggler waits,
        or its checkpoint is not committed yet. One at a time: a second straggler waits for the
        next checkpoint of the next generation."""
        self._pending = [p for p in self._pending if p.generation == generation]
        if not self._pending or generation in self._moves:
            return None
        step = self._committed()
        for p in self._pending:
            if step is None or step < p.named.step or (p.baseline is not None and step <= p.baseline):
                continue
            self._pending.remove(p)
            if spares <= 0:  # the spare was lost since the naming
                log.warning("straggler %s: no spare node left at checkpoint step %d: reported only",
                            p.named.node, step)
                self._record(p.named, generation, p.threshold,
                             plan=f"reported only: no spare node left at checkpoint step {step}")
                return None
            move = Move(p.named, generation, step, self._wall())
            self._moves[generation] = move
            log.warning("straggler %s: checkpoint step %d committed: stopping generation %d to move it "
                        "onto a spare", p.named.node, step, generation)
            return move
        return None

    def evidence(self, generation: int) -> list[Evidence]:
        """Node 0's own evidence for the decision about ``generation``: the move it stopped it for."""
        move = self._moves.get(generation)
        return [move.evidence()] if move is not None else []

    def decided(self, generation: int, root: Failure) -> None:
        """``root`` is the cause node 0 found for ``generation``'s end: when it is the move, the
        decision's ledger event carries the straggler's figures (``decision_fields``)."""
        move = self._moves.get(generation)
        if move is not None and root.cls == FailureClass.STRAGGLER and root.node == move.named.node:
            self._decided[generation] = move

    def decision_fields(self, generation: int) -> dict[str, Any]:
        """{"straggler": figures} for the decision about ``generation`` when a move ended it."""
        move = self._decided.get(generation)
        return {"straggler": move.figures()} if move is not None else {}
