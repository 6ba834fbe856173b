"""Progress from what a program prints: torchtitan's metric line, Lightning's progress bar, or a
user's pattern (:mod:`slurmkit.adapters.patterns`) for any other program.

Formats, from the programs' own source:

- torchtitan (``torchtitan/components/metrics.py``, ``MetricsProcessor.log``; before 2025-03
  ``train.py``), logged by rank 0 as ``[titan] <time> - root - INFO - `` and the fields below,
  each led by an ANSI colour code unless ``--metrics.disable_color_printing``:

  - 0.3.0 (PyPI) and 0.2.2: ``step: 5  loss:  5.19840  grad_norm:  2.4822  memory:  1.23GiB(3.10%)
    tps: 375  tflops: 0.01  mfu: 0.00%`` (loss ``%8.5f``; tps and tflops with thousands commas,
    ``tps: 12,345``); ``mfu: N/A`` when torchtitan cannot tell (0.3.0, under FP8/MX);
  - 0.2.0 and 0.2.1: the same with loss ``%7.4f`` (``grad_norm`` since 2025-06);
  - 0.1.0 (2025-06): no ``grad_norm``, memory in another colour;
  - before 2025-02 (no tflops yet): ``step:  5  loss:  7.6321  memory: ...  wps: 1,234  mfu: 3.21%``
    (``wps`` counted tokens already; named ``tps`` from 2024-11).

  ``validate step: 5  loss: ...`` (the validator, same step numbers) is not training progress.
- Lightning (``lightning/pytorch/callbacks/progress/tqdm_progress.py``, 2.x; captured from
  2.6.6 here): ``Epoch 0:  40%|████      | 4/10 [00:01<00:01,  3.21it/s, v_num=0,
  train_loss=2.310]``, each state written after a ``\\r`` on one terminal line. ``4/10`` is the
  batch within the epoch, not the global step (gradient accumulation, several optimizers and
  earlier epochs all make them differ): the step stays unknown, the loss is the bar's
  ``train_loss_step``, ``train_loss``, ``train/loss`` or (Lightning 1.x's own running mean)
  ``loss``. Since 2.6 Lightning shows a rich bar instead when ``rich`` is installed, and that
  prints nothing per step when its output is not a terminal (a rank's never is): such a run
  has no line to read, only its checkpoints.

torchtitan also announces its saves (``CheckpointManager.save``, 0.1.0 to 0.3.0): ``Saving the
checkpoint (or staging if async is enabled).`` (0.3.0: ``Saving the checkpoint.``), ``Saving a full
checkpoint at last step, step N.`` or ``Saving a model ... checkpoint``, then ``Finished saving the
checkpoint ...`` (0.3.0: ``Staging``/``Finished staging`` with async checkpointing, and ``Last step
checkpoint completed in ...`` after the last step's save) (:func:`save_phase`: the node agent does
not time a save as a gap between steps).

A line is untrusted text: bytes that are not UTF-8 are replaced, a line over
:data:`MAX_LINE_BYTES` is read only for its last ``\\r``/``\\n``-led states within that length
(a progress bar's line grows by a state per batch) or else dropped, and every figure is checked
(:func:`slurmkit.adapters.progress.progress_of`). Nothing here raises on a line.
"""

from __future__ import annotations

import re

from slurmkit.adapters.command import LIGHTNING, TORCHTITAN
from slurmkit.adapters.patterns import MAX_LINE_CHARS, match_pattern
from slurmkit.adapters.progress import Progress, progress_of

#: The longest line read whole: a torchtitan metric line is about 200 bytes, a bar state 150.
MAX_LINE_BYTES = MAX_LINE_CHARS

# A terminal colour or cursor sequence (CSI): torchtitan colours each field.
_CSI = re.compile(r"\x1b\[[0-9;]{0,32}[A-Za-z]")

# a figure's whole word (nan, N/A, 1_000 included: progress_of decides what is a number)
_NUMBER = r"\S{1,64}"
_TITAN_HEAD = re.compile(r"(?<!validate )\bstep:\s{1,20}(?P<step>\d{1,20})\s{1,20}"
                         r"loss:\s{1,20}(?P<loss>%s)" % _NUMBER, re.ASCII)
_TITAN_FIELDS = {
    "tokens_per_s": re.compile(r"\b(?:tps|wps):\s{1,20}(%s)" % _NUMBER, re.ASCII),
    "tflops": re.compile(r"\btflops:\s{1,20}(%s)" % _NUMBER, re.ASCII),
    "mfu_pct": re.compile(r"\bmfu:\s{1,20}([-+0-9.,eE]{1,40})%", re.ASCII),
}

# tqdm's bar as Lightning formats it: "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining},
# {rate_noinv_fmt}{postfix}]", its description "Epoch N". The closing bracket must be there: a
# state cut short by a partial write is not read.
_BAR = re.compile(r"\bEpoch \d{1,9}:[^|\r\n]{0,16}\|[^|\r\n]{0,400}\|\s{0,4}(?:\d{1,20}|\?)/(?:\d{1,20}|\?)"
                  r"\s{0,4}\[(?P<inside>[^\[\]\r\n]{0,2000})\]\s*$", re.ASCII)
_BREAK = re.compile(r"[\r\n]")
#: The bar's keys taken as the training loss, first found first.
LIGHTNING_LOSS_KEYS = ("train_loss_step", "train_loss", "train/loss", "loss")


def _text(line: str | bytes) -> str | None:
    """``line`` as text of at most :data:`MAX_LINE_BYTES`: a longer one keeps only what follows
    its first ``\\r`` or ``\\n`` within its last :data:`MAX_LINE_BYTES` (whole states), or is
    dropped (None)."""
    long = len(line) > MAX_LINE_BYTES
    if long:
        line = line[-MAX_LINE_BYTES:]
    text = line.decode("utf-8", errors="replace") if isinstance(line, bytes) else line
    if long:
        cut = _BREAK.search(text)
        return text[cut.end():] if cut else None
    return text


def _torchtitan(state: str) -> Progress | None:
    head = _TITAN_HEAD.search(state)
    if head is None:
        return None
    values: dict[str, str | None] = {"step": head.group("step"), "loss": head.group("loss")}
    rest = state[head.end():]
    for name, field in _TITAN_FIELDS.items():
        found = field.search(rest)
        values[name] = found.group(1) if found else None
    return progress_of(values)


def _lightning(state: str) -> Progress | None:
    bar = _BAR.search(state)
    if bar is None:
        return None
    postfix: dict[str, str] = {}
    for item in bar.group("inside").split(","):
        key, sep, value = item.strip().partition("=")
        if sep:
            postfix.setdefault(key, value)
    loss = next((postfix[k] for k in LIGHTNING_LOSS_KEYS if k in postfix), None)
    return progress_of({"loss": loss})


_READERS = {TORCHTITAN: _torchtitan, LIGHTNING: _lightning}
_TITAN_SAVE = re.compile(r"- INFO - (?:\x1b\[[0-9;]{0,32}m)?(?P<what>(?:Saving|Staging) (?:the|a full|a model)\b"
                         r"|Finished (?:saving|staging) the checkpoint\b|Last step checkpoint completed\b)")


def save_phase(adapter: str, line: str | bytes) -> bool | None:
    """Whether ``line`` of the program read by ``adapter`` starts a save (True) or ends one
    (False); None when it says neither. torchtitan only: its logger's ``- INFO -`` line."""
    if adapter != TORCHTITAN:
        return None
    text = _text(line)
    if text is None or not ("aving" in text or "taging" in text or "checkpoint completed" in text):
        return None
    found = _TITAN_SAVE.search(_CSI.sub("", text))
    if found is None:
        return None
    return not found.group("what").startswith(("Finished", "Last step"))


def parse_line(adapter: str, line: str | bytes, pattern: re.Pattern[str] | None = None) -> Progress | None:
    """The progress that ``line`` (one line, or a chunk of ``\\r``-separated terminal states) of
    the program read by ``adapter`` tells, None when it tells none.

    The last state that tells something wins. ``pattern`` (from
    :func:`slurmkit.adapters.patterns.compile_pattern`) is tried first, for any adapter: the
    user knows their program's words; without it only torchtitan and Lightning are read
    (``torchrun``, ``none`` and ``reference``, whose progress comes through ``userapi``, read
    nothing). Never raises on the line's content.
    """
    reader = _READERS.get(adapter)
    if pattern is None and reader is None:
        return None
    text = _text(line)
    if text is None:
        return None
    for state in reversed(_BREAK.split(text)):
        if not state.strip():
            continue
        plain = _CSI.sub("", state) if "\x1b" in state else state
        found = match_pattern(pattern, plain) if pattern is not None else None
        if found is None and reader is not None:
            found = reader(plain)
        if found is not None:
            return found
    return None
