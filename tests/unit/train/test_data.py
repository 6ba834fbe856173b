"""Token sources addressed by global sample index and the per-rank sharded loader."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
import torch

from slurmkit.errors import ConfigError
from slurmkit.train.data import MemmapTokens, ShardedLoader, SyntheticTokens


def test_synthetic_is_a_pure_function_of_seed_and_index() -> None:
    src = SyntheticTokens(seed=7, vocab_size=100, seq_len=16)
    first = [src.sample(i) for i in range(5)]
    again = SyntheticTokens(seed=7, vocab_size=100, seq_len=16)
    assert all(np.array_equal(again.sample(i), first[i]) for i in reversed(range(5)))
    assert not np.array_equal(SyntheticTokens(seed=8, vocab_size=100, seq_len=16).sample(0),
                              first[0])
    assert first[0].shape == (17,) and first[0].max() < 100 and first[0].min() >= 0


def test_ranks_and_accumulation_slots_read_disjoint_slices() -> None:
    seen: list[int] = []

    class Indexer:
        def sample(self, index: int) -> np.ndarray:
            seen.append(index)
            return np.full(5, index, dtype=np.int64)

    loaders = [ShardedLoader(Indexer(), micro_batch=2, global_batch=8, dp_rank=r, dp_size=2)
               for r in range(2)]
    assert loaders[0].accum_steps == 2
    for _ in range(3):
        for loader in loaders:
            loader.next_step()
    assert sorted(seen) == list(range(24))  # every sample exactly once, none skipped
    assert loaders[0].state_dict() == {"position": 24}


def test_resume_from_position_regenerates_the_same_batches() -> None:
    src = SyntheticTokens(seed=1, vocab_size=50, seq_len=8)
    straight = ShardedLoader(src, micro_batch=2, global_batch=4, dp_rank=1, dp_size=2)
    batches = [straight.next_step() for _ in range(5)]
    resumed = ShardedLoader(src, micro_batch=2, global_batch=4, dp_rank=1, dp_size=2)
    resumed.load_state_dict({"position": 3 * 4})
    for expected in batches[3:]:
        got = resumed.next_step()
        for (xi, yi), (xe, ye) in zip(got, expected):
            assert torch.equal(xi, xe) and torch.equal(yi, ye)
    x, y = batches[0][0]
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are inputs shifted by one


def test_global_batch_must_divide() -> None:
    with pytest.raises(ConfigError, match="multiple of 4"):
        ShardedLoader(SyntheticTokens(seed=0, vocab_size=10, seq_len=4), micro_batch=2,
                      global_batch=6, dp_rank=0, dp_size=2)


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_memmap_windows_and_wraparound(tmp_path: Any, dtype: str) -> None:
    path = os.path.join(str(tmp_path), "tokens.bin")
    np.arange(41, dtype=dtype).tofile(path)
    src = MemmapTokens(path, dtype=dtype, seq_len=10, vocab_size=70000)
    assert src.num_samples == 4
    assert src.sample(1).tolist() == list(range(10, 21))
    assert src.sample(5).tolist() == src.sample(1).tolist()  # second epoch
    loader = ShardedLoader(src, micro_batch=1, global_batch=2, dp_rank=1, dp_size=2,
                           position=2)
    (x, y), = loader.next_step()
    assert x[0].tolist() == list(range(30, 40)) and y[0, -1].item() == 40


def test_memmap_rejects_missing_files_and_big_token_ids(tmp_path: Any) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        MemmapTokens(os.path.join(str(tmp_path), "nope.bin"), dtype="uint16", seq_len=4,
                     vocab_size=10)
    path = os.path.join(str(tmp_path), "t.bin")
    np.array([1, 2, 3, 400, 5, 6], dtype=np.uint16).tofile(path)
    with pytest.raises(ConfigError, match="vocab_size=100"):
        MemmapTokens(path, dtype="uint16", seq_len=4, vocab_size=100).sample(0)
