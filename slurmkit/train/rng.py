"""Capture and restore the RNG states of a rank (torch CPU, python ``random``, numpy) as tensors.

States are fixed-size int64/uint8 tensors so that every rank's states can be all-gathered into
one replicated tensor per generator: the checkpoint then has the same keys on every rank (as
torch.distributed.checkpoint wants) and each rank restores its own row.
"""

from __future__ import annotations

import random
import struct

import numpy as np
import torch

# python random: (version, 624 MT words + position, gauss_next) -> 1 + 625 + 2 int64 values.
_PY_WORDS = 625
# numpy legacy MT19937: 624 words, pos, has_gauss, cached_gaussian (as float64 bits).
_NP_WORDS = 624


def _float_bits(value: float) -> int:
    return int(struct.unpack("<q", struct.pack("<d", value))[0])


def _bits_float(bits: int) -> float:
    return float(struct.unpack("<d", struct.pack("<q", bits))[0])


def capture() -> dict[str, torch.Tensor]:
    """This process's RNG states as tensors."""
    version, words, gauss = random.getstate()
    py = [version, *words, 0 if gauss is None else 1, 0 if gauss is None else _float_bits(gauss)]
    _, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)  # type: ignore[misc]
    npy = [*(int(k) for k in keys), int(pos), int(has_gauss), _float_bits(float(cached))]
    return {
        "torch": torch.get_rng_state().clone(),
        "python": torch.tensor(py, dtype=torch.int64),
        "numpy": torch.tensor(npy, dtype=torch.int64),
    }


def restore(state: dict[str, torch.Tensor]) -> None:
    """Set this process's RNG states from ``capture()``'s tensors."""
    torch.set_rng_state(state["torch"].to(torch.uint8).cpu())
    py = [int(v) for v in state["python"].tolist()]
    gauss = _bits_float(py[-1]) if py[-2] else None
    random.setstate((py[0], tuple(py[1 : 1 + _PY_WORDS]), gauss))
    npy = [int(v) for v in state["numpy"].tolist()]
    keys = np.array(npy[:_NP_WORDS], dtype=np.uint32)
    np.random.set_state(("MT19937", keys, npy[_NP_WORDS], npy[_NP_WORDS + 1],
                         _bits_float(npy[_NP_WORDS + 2])))
