"""One sample of a program's progress, read from its own output, and the checks every figure of it
passes before anything believes it.

A figure comes from text a rank printed (a log line, a progress bar), which the program's user,
a dependency or a bug may have written: it is a number in range or it is unknown (None), never
0 and never an exception. :func:`progress_of` is the one place a sample is built from text.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

#: A step is a count below 2**53, the largest integer a JSON reader (and a float) holds exactly.
MAX_STEP = 2 ** 53
#: Digits of a figure worth reading: a step has at most 16, a loss printed with ``%8.5f`` 12.
MAX_DIGITS = 40

# A number as programs print it: an optional sign, digits with optional thousands separators
# (torchtitan prints ``tps: 12,345`` and ``tflops: 1,234.56``), a fraction, an exponent (tqdm's
# ``1.23e+03``). Python's float() alone would also take ``1_000``, ``infinity`` and `` nan ``.
_REAL = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?(?:[eE][-+]?\d{1,3})?"
                   r"|[-+]?\.\d+(?:[eE][-+]?\d{1,3})?", re.ASCII)
_COUNT = re.compile(r"\d{1,3}(?:,\d{3})+|\d+", re.ASCII)  # ASCII: int() would also take "٣" or "５"


@dataclass(frozen=True)
class Progress:
    """What a program said about its training at one moment; None is "not said" (unknown).

    ``step``: the program's own count of optimizer steps done, ``0 <= step < 2**53``.
    ``loss``: the training loss it printed (finite). ``tokens_per_s``: tokens per second (per
    device, as torchtitan counts them; finite, >= 0). ``mfu``: model FLOPs utilisation as a
    fraction, 0 to 1 (torchtitan prints a percent: divided by 100 here). ``tflops``: achieved
    TFLOP/s per device (finite, >= 0).
    """

    step: int | None = None
    loss: float | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    tflops: float | None = None

    def is_empty(self) -> bool:
        return all(v is None for v in (self.step, self.loss, self.tokens_per_s, self.mfu, self.tflops))


def parse_count(text: str | None) -> int | None:
    """A step printed as text (``"12"``, ``"12,345"``): None when it is not a plain count below
    :data:`MAX_STEP`."""
    if text is None:
        return None
    text = text.strip()
    if len(text) > MAX_DIGITS or _COUNT.fullmatch(text) is None:
        return None
    value = int(text.replace(",", ""))
    return value if value < MAX_STEP else None


def parse_real(text: str | None) -> float | None:
    """A figure printed as text: None when it is not a finite number in :data:`_REAL`'s form
    (``nan``, ``inf``, ``N/A`` and anything longer than :data:`MAX_DIGITS` characters included)."""
    if text is None:
        return None
    text = text.strip()
    if len(text) > MAX_DIGITS or _REAL.fullmatch(text) is None:
        return None
    value = float(text.replace(",", ""))
    return value if math.isfinite(value) else None


def _non_negative(value: float | None) -> float | None:
    return value if value is not None and value >= 0 else None


def _fraction(value: float | None) -> float | None:
    return value if value is not None and 0 <= value <= 1 else None


#: The figures a sample may carry, by the name a user's pattern gives its group. ``mfu`` is a
#: fraction (0 to 1), ``mfu_pct`` a percent (0 to 100): the name says which the program prints.
FIELDS = ("step", "loss", "tokens_per_s", "mfu", "mfu_pct", "tflops")


def progress_of(values: Mapping[str, str | None]) -> Progress | None:
    """The sample that the texts ``values`` (by :data:`FIELDS` name) give, each checked on its
    own: a figure out of range is unknown, the others stand. None when nothing is left.

    A ``step`` key that is present but not a valid count makes the whole sample None: a line
    that names its step and gets it wrong says nothing that can be placed in time.
    """
    step = None
    if "step" in values:
        step = parse_count(values["step"])
        if step is None:
            return None
    mfu = _fraction(parse_real(values.get("mfu")))
    if mfu is None and values.get("mfu_pct") is not None:
        pct = parse_real(values.get("mfu_pct"))
        mfu = _fraction(pct / 100 if pct is not None else None)
    sample = Progress(step=step, loss=parse_real(values.get("loss")),
                      tokens_per_s=_non_negative(parse_real(values.get("tokens_per_s"))),
                      mfu=mfu, tflops=_non_negative(parse_real(values.get("tflops"))))
    return None if sample.is_empty() else sample
