"""Token sources that are pure functions of a global sample index, and the per-rank loader.

Every sample is addressed by its global index, so the loader's whole state is one integer
(the next global sample of the run) and any position can be regenerated exactly after a
restart. Optimizer step ``s`` consumes samples ``[s*G, (s+1)*G)`` (G = global batch); inside
it, data-parallel rank ``r`` takes the ``micro_batch`` samples of each accumulation slot
``a`` at offset ``(a*dp + r)*micro_batch``: disjoint slices, no coordination needed.
"""

from __future__ import annotations

import os
from typing import Protocol

import numpy as np
import torch

from slurmkit.errors import ConfigError

# Longest stride of the synthetic arithmetic sequences; small so a tiny model can learn them.
_MAX_STRIDE = 8


class TokenSource(Protocol):
    """A dataset addressed by global sample index: ``sample(i)`` has ``seq_len + 1`` tokens."""

    def sample(self, index: int) -> np.ndarray: ...


class SyntheticTokens:
    """Seeded arithmetic sequences mod vocab: random start and stride per sample, 5% noise.

    Learnable (the loss falls), yet a pure function of ``(seed, index)``: numpy's PCG64 seeded
    with the pair, so regenerating sample ``i`` never needs samples ``0..i-1``.
    """

    def __init__(self, *, seed: int, vocab_size: int, seq_len: int) -> None:
        self.seed = seed
        self.vocab_size = vocab_size
        self.seq_len = seq_len

    def sample(self, index: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, index])
        start = int(rng.integers(0, self.vocab_size))
        stride = int(rng.integers(1, _MAX_STRIDE + 1))
        tokens = (start + stride * np.arange(self.seq_len + 1, dtype=np.int64)) % self.vocab_size
        noise = rng.random(self.seq_len + 1) < 0.05
        tokens[noise] = rng.integers(0, self.vocab_size, int(noise.sum()))
        return tokens


class MemmapTokens:
    """A flat file of token ids (uint16/uint32 ``.bin``), read through numpy memmap.

    Sample ``i`` is the window starting at ``(i mod n) * seq_len`` with ``seq_len + 1`` tokens
    (the last token of one window is the first of the next, as targets need); the index wraps
    around, so a run longer than one epoch replays the file in order.
    """

    def __init__(self, path: str, *, dtype: str, seq_len: int, vocab_size: int) -> None:
        if not os.path.exists(path):
            raise ConfigError(
                detected=f"train.data_path={path!r} does not exist",
                requirement="the memory-mapped token file exists on every node",
                fix="point train.data_path at a .bin token file or use train.data=synthetic",
            )
        self.tokens = np.memmap(path, dtype=np.dtype(dtype), mode="r")
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self.num_samples = (len(self.tokens) - 1) // seq_len
        if self.num_samples < 1:
            raise ConfigError(
                detected=f"{path} holds {len(self.tokens)} tokens",
                requirement=f"at least seq_len + 1 = {seq_len + 1} tokens",
                fix="use a larger token file or a shorter train.seq_len",
            )

    def sample(self, index: int) -> np.ndarray:
        start = (index % self.num_samples) * self.seq_len
        window = np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int64)
        if window.size and int(window.max()) >= self.vocab_size:
            raise ConfigError(
                detected=f"token id {int(window.max())} in the data file",
                requirement=f"token ids below model.vocab_size={self.vocab_size}",
                fix="use the model whose vocabulary matches the tokenizer of the data",
            )
        return window


class ShardedLoader:
    """Yields this data-parallel rank's micro-batches; state is the next global sample index."""

    def __init__(self, source: TokenSource, *, micro_batch: int, global_batch: int,
                 dp_rank: int, dp_size: int, position: int = 0) -> None:
        per_slot = micro_batch * dp_size
        if global_batch % per_slot:
            raise ConfigError(
                detected=f"global batch {global_batch} with micro_batch={micro_batch} on "
                         f"{dp_size} data-parallel ranks",
                requirement="the global batch is a multiple of micro_batch x data-parallel size",
                fix=f"set train.global_batch to a multiple of {per_slot}",
            )
        self.source = source
        self.micro_batch = micro_batch
        self.global_batch = global_batch
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.accum_steps = global_batch // per_slot
        self.position = position

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(inputs, targets) for each accumulation slot of the next optimizer step."""
        batches = []
        for slot in range(self.accum_steps):
            first = self.position + (slot * self.dp_size + self.dp_rank) * self.micro_batch
            rows = [self.source.sample(first + i) for i in range(self.micro_batch)]
            block = torch.from_numpy(np.stack(rows))
            batches.append((block[:, :-1].contiguous(), block[:, 1:].contiguous()))
        self.position += self.global_batch
        return batches

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = int(state["position"])
