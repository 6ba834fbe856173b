"""A DDP gradient all-reduce whose result does not depend on the bucket layout.

Why: a ring all-reduce (gloo, and NCCL likewise) adds the ranks' values of one element in an
order set by which chunk of the buffer the element falls into, i.e. by the element's offset
in its bucket and by the bucket's size. With more than two ranks, float addition is not
associative, so the same gradients reduced in a different layout differ in the last bits.
DDP's layout does change: its first iteration reduces all gradients in one bucket in reverse
parameter order, then it rebuilds the buckets in the order gradients became ready. A run
resumed at step k builds a new DDP, so its step k+1 is reduced in the first-iteration layout
while the uninterrupted run used the rebuilt one: the resume was not bit-exact.

This hook sums every element in rank order 0, 1, ..., W-1 wherever it sits: an all-to-all
gives rank r chunk r of every rank's bucket, rank r adds the W rows in rank order, and an
all-gather returns the sums. Same traffic as a ring (reduce-scatter + all-gather), but it
runs synchronously in the hook (no nested collectives issued from a future's callback, whose
order could differ between ranks), so backward no longer overlaps with the reduction.
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations at runtime
# (``bucket`` must be annotated with the class dist.GradBucket, not with a string).
import time

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup


def rank_order_mean(flat: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """Replace ``flat`` (1-D, same length on every rank) by its mean over ranks, in place.

    Every element is ``((x_0 + x_1) + ... + x_{W-1}) / W`` with ``x_r`` rank r's value,
    independent of the element's offset and of the buffer's length (a collective).
    """
    world = dist.get_world_size(group)
    if world == 1:
        return flat
    n = flat.numel()
    chunk = -(-n // world)  # ceil: the last rank's chunk is padded with zeros
    send = flat if n == chunk * world else torch.cat([flat, flat.new_zeros(chunk * world - n)])
    rows = torch.empty_like(send)
    dist.all_to_all_single(rows, send, group=group)  # row s of ``rows``: chunk `rank` of rank s
    rows = rows.view(world, chunk)
    acc = rows[0].clone()
    for source in range(1, world):
        acc.add_(rows[source])  # element-wise, in rank order: the same bits in any layout
    acc.div_(world)
    gathered = torch.empty_like(send)
    dist.all_gather_single(gathered, acc, group=group)
    flat.copy_(gathered[:n])
    return flat


def rank_order_hook(group: ProcessGroup | None,
                    bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook (``ddp.register_comm_hook(group, rank_order_hook)``): mean gradients."""
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(rank_order_mean(bucket.buffer(), group))
    return fut


class CommClock:
    """State of :func:`timed_rank_order_hook`: the group, and the seconds this rank has spent in
    the gradient reduction (waiting for its peers included) since it was made. The trainer
    reads it once per step: that is the step's gradient communication, kept out of its compute
    (slurmkit.supervise.stragglers scores a rank by the work it does not spend waiting)."""

    def __init__(self, group: ProcessGroup | None = None) -> None:
        self.group = group
        self.seconds = 0.0


def timed_rank_order_hook(state: CommClock,
                          bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """``rank_order_hook`` that adds its time to ``state.seconds`` (two clock reads a bucket)."""
    began = time.perf_counter()
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(rank_order_mean(bucket.buffer(), state.group))
    state.seconds += time.perf_counter() - began
    return fut
