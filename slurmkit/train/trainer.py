"""The reference training loop: restore, step, heartbeat, checkpoint, stop on signal, finish.

One optimizer step: fault hook -> forward/backward over the accumulation slots -> clip ->
AdamW -> one all-reduce carrying (loss, stop flag) so every rank agrees on the step to stop at
-> heartbeat -> checkpoint (async through the store) -> metrics. A stop request ends the run
at that step boundary with a durable checkpoint and ``EXIT_CHECKPOINTED_ON_SIGNAL``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from slurmkit.atomic import atomic_write
from slurmkit.errors import SlurmkitError
from slurmkit.runfiles import FINAL_NAME, METRICS_NAME
from slurmkit.train.config import ModelConfig, ParallelConfig, TrainConfig
from slurmkit.train.data import MemmapTokens, ShardedLoader, SyntheticTokens, TokenSource
from slurmkit.train.faults import FaultInjector
from slurmkit.train.flops import flops_per_token
from slurmkit.train.heartbeat import Heartbeat
from slurmkit.train.metrics import MetricsWriter, step_line, step_metrics
from slurmkit.train.model import Transformer, compile_blocks, loss_fn
from slurmkit.train.parallel import Runtime, param_digest, require_supported, unwrap, wrap
from slurmkit.train.reduce import CommClock
from slurmkit.train.schedule import WarmupCosine
from slurmkit.train.signals import EXIT_CHECKPOINTED_ON_SIGNAL, StopRequest
from slurmkit.train.state import apply_state, capture_state

log = logging.getLogger(__name__)
# metrics.jsonl is written from a thread this often, never from inside a step (status and
# report read it; they lag by at most this much).
METRICS_FLUSH_INTERVAL_S = 5.0



def wait_for_device(total: torch.Tensor) -> float:
    """The step's loss on the host, once everything queued on the device has run. On a GPU
    that includes the gradient all-reduces (NCCL runs them on the device, DDP and FSDP launch
    them without waiting), so a rank whose peer stopped blocks here, not in a collective call.
    Its own function so that a hung rank's stack names it: slurmkit.failures.stacks reads this
    frame as a wait for the peers (seen on an H200: the peer of a rank stalled in data loading
    showed only this line of ``train_step``)."""
    return float(total)

class SaveHandle(Protocol):
    blocking_s: float

    def wait(self) -> bool: ...


class Store(Protocol):
    """The part of slurmkit.store.CheckpointStore the trainer uses."""

    def save(self, step: int, state: dict[str, Any], *, shared: bool = False,
             final: bool = False) -> SaveHandle: ...
    def wait_shared(self, step: int) -> bool: ...
    def restore(self, template: dict[str, Any]) -> Any: ...
    def wait(self) -> Any: ...
    def close(self) -> Any: ...


class EventSink(Protocol):
    def append(self, event: str, **fields: Any) -> Any: ...


@dataclass
class RankContext:
    """Who this rank is and where its run lives (read from the environment at the entry)."""

    rank: int
    world_size: int
    generation: int = 0
    run_dir: str | None = None
    peak_tflops: float = 0.5  # per device, for MFU
    step_delay_s: float = 0.0  # SLURMKIT_STEP_DELAY_S: sleep before every step


class Trainer:
    """Runs the loop for one process; ``run()`` returns the process exit code."""

    def __init__(self, model_cfg: ModelConfig, parallel_cfg: ParallelConfig,
                 train_cfg: TrainConfig, *, ctx: RankContext, runtime: Runtime, strategy: str,
                 store: Store | None, stop: StopRequest, ledger: EventSink | None = None,
                 heartbeat: Heartbeat | None = None, faults: FaultInjector | None = None,
                 clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        require_supported(parallel_cfg)
        self.m, self.p, self.t = model_cfg, parallel_cfg, train_cfg
        self.ctx, self.runtime, self.strategy = ctx, runtime, strategy
        self.store, self.stop, self.ledger = store, stop, ledger
        self.heartbeat, self.faults = heartbeat, faults
        self._clock, self._sleep = clock, sleep
        self.dp = ctx.world_size  # data parallel only (tensor = pipeline = 1)
        self.global_batch = train_cfg.global_batch or train_cfg.micro_batch * self.dp
        self.flops_token = flops_per_token(model_cfg, train_cfg.seq_len)
        # Step-time sections for straggler scores, beaten with the heartbeat (node-local):
        # seconds of the last step's data wait, compute and communication, and the blocking
        # part of the last save (slurmkit.supervise.stragglers).
        self.comm_clock = CommClock()
        self.sections: dict[str, float] = {"data": 0.0, "compute": 0.0, "comm": 0.0, "ckpt": 0.0}
        self._first_step = 1  # the first step of this generation (logged whatever the interval)
        self._build()

    # ---- construction -------------------------------------------------------------------
    def _build(self) -> None:
        torch.manual_seed(self.t.seed)  # identical init on every rank before sharding
        base = Transformer(self.m, activation_checkpointing=self.p.activation_checkpointing)
        if self.t.compile:
            compile_blocks(base)
        self.model: nn.Module = wrap(base.to(self.runtime.device), self.strategy, self.runtime,
                                     self.p, rank_order=self.t.deterministic, comm_clock=self.comm_clock)
        self.optimizer = self._new_optimizer()
        self.scheduler = WarmupCosine(self.optimizer, lr=self.t.lr,
                                      warmup_steps=self.t.warmup_steps,
                                      total_steps=self.t.steps, min_lr_ratio=self.t.min_lr_ratio)
        self.loader = ShardedLoader(self._source(), micro_batch=self.t.micro_batch,
                                    global_batch=self.global_batch, dp_rank=self.ctx.rank,
                                    dp_size=self.dp)

    def _new_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.model.parameters(), lr=self.t.lr,
                                 betas=(self.t.beta1, self.t.beta2), eps=self.t.eps,
                                 weight_decay=self.t.weight_decay)

    def _source(self) -> TokenSource:
        if self.t.data == "memmap":
            return MemmapTokens(self.t.data_path, dtype=self.t.data_dtype,
                                seq_len=self.t.seq_len, vocab_size=self.m.vocab_size)
        return SyntheticTokens(seed=self.t.seed, vocab_size=self.m.vocab_size,
                               seq_len=self.t.seq_len)

    # ---- checkpoints --------------------------------------------------------------------
    def restore(self) -> int:
        """Load the newest verified checkpoint; returns the step to continue after."""
        if self.store is None:
            return 0
        template = capture_state(self.model, self.optimizer, self.scheduler, self.loader,
                                 step=0, device=self.runtime.device)
        result = self.store.restore(template)
        if result is None:
            # Building the template ran one zero-lr step to materialise AdamW's state;
            # a fresh optimizer keeps a fresh run identical to one that never looked.
            self.optimizer.zero_grad(set_to_none=True)
            self.optimizer = self._new_optimizer()
            self.scheduler.optimizer = self.optimizer
            return 0
        step = apply_state(template, self.model, self.optimizer, self.scheduler, self.loader,
                           rank=self.ctx.rank)
        self._event("train_resumed", step=step, tier=getattr(result, "tier", None),
                    generation=self.ctx.generation)
        log.info("rank %d resumed from step %d (tier %s)", self.ctx.rank, step,
                 getattr(result, "tier", None))
        return step

    def _save(self, step: int, shared: bool = False,
              final: bool = False) -> tuple[float, SaveHandle | None]:
        """Hand the state to the store; returns (seconds training was blocked, handle).
        ``shared``: the save must reach the shared tier (the stop checkpoint); ``final``: the
        last step's save, promoted to every slower tier (the run's result)."""
        if self.store is None:
            return 0.0, None
        start = self._clock()
        state = capture_state(self.model, self.optimizer, self.scheduler, self.loader,
                              step=step, device=self.runtime.device)
        handle = self.store.save(step, state, shared=shared, final=final)
        return self._clock() - start, handle

    # ---- one step -----------------------------------------------------------------------
    @contextlib.contextmanager
    def _grad_sync(self, enabled: bool) -> Iterator[None]:
        """Skip the gradient all-reduce on all but the last accumulation slot."""
        if isinstance(self.model, DistributedDataParallel) and not enabled:
            with self.model.no_sync():
                yield
            return
        setter = getattr(self.model, "set_requires_gradient_sync", None)  # FSDP2
        if setter is not None:
            setter(enabled)
        yield

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        # FSDP2 casts parameters itself; DDP on a GPU needs autocast for bf16 compute.
        if self.strategy == "ddp" and self.runtime.compute_dtype != torch.float32:
            return torch.autocast(self.runtime.device.type, dtype=self.runtime.compute_dtype)
        return contextlib.nullcontext()

    def train_step(self) -> tuple[float, float]:
        """One optimizer step on this rank; returns (local mean loss, lr)."""
        began, comm_before = self._clock(), self.comm_clock.seconds
        lr = self.scheduler.apply()
        slots = self.loader.next_step()
        data = self._clock() - began
        total = torch.zeros((), device=self.runtime.device)
        for i, (inputs, targets) in enumerate(slots):
            t = self._clock()
            inputs = inputs.to(self.runtime.device, non_blocking=True)
            targets = targets.to(self.runtime.device, non_blocking=True)
            data += self._clock() - t
            with self._grad_sync(i == len(slots) - 1), self._autocast():
                loss = loss_fn(self.model(inputs), targets) / len(slots)
                loss.backward()
            total += loss.detach()
        if self.t.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.t.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.advance()
        local = wait_for_device(total)  # the compute (and on a GPU its all-reduces) ends here
        comm = self.comm_clock.seconds - comm_before
        self.sections.update(data=data, comm=comm, compute=max(0.0, self._clock() - began - data - comm))
        return local, lr

    def _agree(self, loss: float) -> tuple[float, bool]:
        """All ranks: (mean loss, whether any rank was asked to stop) in one all-reduce."""
        buf = torch.tensor([loss, 1.0 if self.stop.requested else 0.0],
                           dtype=torch.float64, device=self.runtime.device)
        if dist.is_initialized():
            dist.all_reduce(buf)
        return float(buf[0]) / self.ctx.world_size, bool(buf[1] > 0)

    # ---- the run ------------------------------------------------------------------------
    def run(self) -> int:
        """Restore, train to ``train.steps`` or a stop request; returns the exit code."""
        start = self.restore()
        if self.heartbeat is not None:
            self.heartbeat.beat(start)  # alive (restored) before the first step's compile/warm-up
        self._event("train_started", step=start, generation=self.ctx.generation,
                    world_size=self.ctx.world_size, strategy=self.strategy)
        writer = self._metrics_writer()
        handle: SaveHandle | None = None
        try:
            self._first_step = start + 1
            for step in range(start + 1, self.t.steps + 1):
                stopped, handle = self._one_step(step, writer, handle)
                if stopped:
                    return self._stop(step, handle)
            if handle is not None:
                handle.wait()
            if self.store is not None:
                self.store.wait()
            self._finish(self.t.steps)
            return 0
        finally:
            if writer is not None:
                writer.close()

    def _one_step(self, step: int, writer: MetricsWriter | None,
                  handle: SaveHandle | None) -> tuple[bool, SaveHandle | None]:
        if self.faults is not None:
            self.faults.before_step(step)
        if self.ctx.step_delay_s > 0:
            self._sleep(self.ctx.step_delay_s)
        began = self._clock()
        local_loss, lr = self.train_step()
        agree_began = self._clock()
        loss, stop_requested = self._agree(local_loss)
        self.sections["comm"] += self._clock() - agree_began
        if self.heartbeat is not None:
            # ckpt: the previous save's blocking (this step's save comes after the beat)
            self.heartbeat.beat(step, sections={k: round(v, 6) for k, v in self.sections.items()})
        stop = (stop_requested or step == self.t.stop_at_step) and step < self.t.steps
        interval = self.t.ckpt_interval_steps
        due = (stop or (interval > 0 and step % interval == 0)
               or (step == self.t.steps and self.t.ckpt_at_end))
        blocking = 0.0
        if due:
            # a requeue may land on other nodes: the stop checkpoint goes to the shared tier
            blocking, new_handle = self._save(step, shared=stop, final=step == self.t.steps)
            handle = new_handle or handle
        self.sections["ckpt"] = blocking
        if writer is not None:
            m = step_metrics(
                step=step, loss=loss, lr=lr, step_time_s=self._clock() - began,
                tokens=self.global_batch * self.t.seq_len, world_size=self.ctx.world_size,
                flops_per_token=self.flops_token, peak_tflops=self.ctx.peak_tflops,
                ckpt_blocking_s=blocking, generation=self.ctx.generation)
            writer.write(m)
            every = self.t.log_interval_steps
            if every > 0 and (step % every == 0 or step == self.t.steps or step == self._first_step):
                log.info("%s", step_line(m, self.t.steps))
        return stop, handle

    def _stop(self, step: int, handle: SaveHandle | None) -> int:
        """Wait until the stop checkpoint is on the shared tier (a requeue onto other nodes
        resumes from it), record it, return exit code 95."""
        if handle is not None and not handle.wait():
            raise SlurmkitError(
                f"the stop checkpoint of step {step} was not committed (see the ckpt_failed "
                "event); exiting without claiming a resumable state")
        if self.store is not None and not self.store.wait_shared(step):
            raise SlurmkitError(
                f"the stop checkpoint of step {step} did not reach the shared tier (see the "
                "promotion events); exiting without claiming a resumable state")
        self._event("train_stopped", step=step, signal=self.stop.signum,
                    generation=self.ctx.generation)
        log.info("rank %d stopped at step %d with a durable checkpoint", self.ctx.rank, step)
        return EXIT_CHECKPOINTED_ON_SIGNAL

    def _finish(self, step: int) -> None:
        digest = param_digest(unwrap(self.model))  # collective under FSDP
        if self.ctx.rank != 0:
            return
        if self.ctx.run_dir:
            record = {"step": step, "param_sha256": digest, "world_size": self.ctx.world_size}
            atomic_write(os.path.join(self.ctx.run_dir, FINAL_NAME), json.dumps(record), mode=None)
        self._event("train_finished", step=step, param_sha256=digest,
                    generation=self.ctx.generation)

    def _metrics_writer(self) -> MetricsWriter | None:
        if self.ctx.rank != 0 or not self.ctx.run_dir:
            return None
        return MetricsWriter(os.path.join(self.ctx.run_dir, METRICS_NAME),
                             flush_interval_s=METRICS_FLUSH_INTERVAL_S)

    def _event(self, event: str, **fields: Any) -> None:
        if self.ledger is not None and self.ctx.rank == 0:
            self.ledger.append(event, **fields)
