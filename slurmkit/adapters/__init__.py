"""Program adapters: what slurmkit learns from a third-party trainer without changing it (issue 36).

An adapter is chosen by ``job.program`` (``auto``: recognised from ``job.command``) and reads
only what the program already emits: its log lines (step, loss, tokens/s, MFU, TFLOP/s), its
checkpoint folder (the saves it has finished) and its own arguments (its total steps). What
cannot be known is None, never 0.

- :mod:`~slurmkit.adapters.command`: the adapter's name (:func:`detect`, :func:`resolve`), the
  total steps and the checkpoint folders a command gives;
- :mod:`~slurmkit.adapters.progress`: the :class:`Progress` sample and its figures' checks;
- :mod:`~slurmkit.adapters.lines`: :func:`parse_line`, torchtitan's and Lightning's formats, and
  :func:`save_phase`, torchtitan's announced saves;
- :mod:`~slurmkit.adapters.patterns`: a user's regex for any other program (:func:`compile_pattern`);
- :mod:`~slurmkit.adapters.checkpoints`: :func:`complete_checkpoints` in a program's folder.

A low package: pure functions (the checkpoint scan reads one folder, bounded) over the standard
library and slurmkit's leaf modules, for the node agent to call; it imports no torch, no config
and nothing of launch, supervise or the command line.
"""

from __future__ import annotations

from slurmkit.adapters.checkpoints import MAX_ENTRIES, CheckpointGlob, compile_glob, complete_checkpoints, split_glob
from slurmkit.adapters.command import NAMES, checkpoint_dirs, detect, resolve, total_steps, trace_stems
from slurmkit.adapters.lines import MAX_LINE_BYTES, parse_line, save_phase
from slurmkit.adapters.patterns import compile_pattern
from slurmkit.adapters.progress import Progress

__all__ = ["MAX_ENTRIES", "MAX_LINE_BYTES", "NAMES", "CheckpointGlob", "Progress", "checkpoint_dirs",
           "compile_glob", "compile_pattern", "complete_checkpoints", "detect", "parse_line", "resolve",
           "save_phase", "split_glob", "total_steps", "trace_stems"]
