"""What a job's command says about the program it runs: which adapter reads it
(:func:`detect`, :func:`resolve`), how many steps it will train (:func:`total_steps`) and where
it saves its checkpoints (:func:`checkpoint_dirs`). Pure functions of the command (and the
ranks' working directory): nothing is run, opened or imported.

Flags are read as the programs read them, from their own source:

- torchtitan 0.3.0 (PyPI; a tyro CLI over ``Trainer.Config``, which takes ``--dump-folder`` and
  ``--dump_folder`` alike): ``--dump-folder D`` (default ``./outputs``), ``--checkpoint.folder F``
  (default ``checkpoint``; relative to D, ``os.path.join`` so an absolute F stands alone),
  ``--training.steps N``. 0.1.0 to 0.2.2 (tyro over ``JobConfig``, usually with a TOML file
  given by ``--job.config_file``): ``--job.dump_folder D`` (default ``./torchtitan/outputs``
  until 0.2.1, ``./outputs`` in 0.2.2), the same ``--checkpoint.folder`` and
  ``--training.steps``. A value set only in the TOML file or in a Python config function is
  not read: the step total is then unknown, and the folders are the defaults' candidates.
- torchtitan's flight recorder (``init_distributed``): with ``--comm.trace_buf_size`` above 0
  (the default, 20000) it sets ``TORCH_FR_DUMP_TEMP_FILE`` itself, over what a launcher
  exported, to ``<dump folder>/<comm.save_traces_folder>/<comm.save_traces_file_prefix>``
  (defaults ``comm_traces`` and ``rank_`` from 0.2.0; 0.1.0 wrote ``<dump folder>/comm_trace/rank_``).
- Lightning (LightningCLI): ``--trainer.default_root_dir D`` (default: the working directory);
  ModelCheckpoint saves under ``D/checkpoints`` without a logger, ``D/<logger
  name>/version_K/checkpoints`` with one (``lightning_logs`` for the default loggers).
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Sequence

from slurmkit.errors import ConfigError

AUTO = "auto"
REFERENCE = "reference"
TORCHTITAN = "torchtitan"
LIGHTNING = "lightning"
TORCHRUN = "torchrun"
NONE = "none"
#: The choices of ``job.program``: ``auto`` (recognised from the command) or an adapter.
NAMES = (AUTO, REFERENCE, TORCHTITAN, LIGHTNING, TORCHRUN, NONE)

_MAX_STEPS = 2 ** 53
_TITAN_DUMP_FLAGS = ("--dump-folder", "--dump_folder", "--job.dump_folder", "--job.dump-folder")
#: torchtitan's default dump folders when no flag sets one: 0.2.2 and 0.3.0, then 0.1.0-0.2.1.
TITAN_DEFAULT_DUMPS = ("./outputs", "./torchtitan/outputs")
_LAUNCHER_MODULES = ("torch.distributed.run", "torch.distributed.launch")
#: torchtitan's flight-recorder folders when no flag sets one: 0.2.0 and later, then 0.1.0.
TITAN_DEFAULT_TRACE_FOLDERS = ("comm_traces", "comm_trace")


def _modules(args: Sequence[str]) -> list[str]:
    """The modules run with ``-m`` (an interpreter's or torchrun's: ``torchrun -m pkg.train``)."""
    return [b for a, b in zip(args, args[1:]) if a in ("-m", "--module")]


def _base(arg: str) -> str:
    return posixpath.basename(arg.replace("\\", "/"))


def _scripts(args: Sequence[str]) -> list[int]:
    """Indexes of the arguments that name a Python script (``train.py``, ``./torchtitan/train.py``)."""
    return [i for i, a in enumerate(args) if a.endswith(".py") and not a.startswith("-")
            and (i == 0 or args[i - 1] not in ("-m", "--module"))]


def _is_torchtitan(args: Sequence[str]) -> bool:
    for module in _modules(args):
        # python -m torchtitan.train, and its experiments' trainers (torchtitan.experiments.X.train)
        if module == "torchtitan.train" or module.startswith("torchtitan.") and module.endswith(".train"):
            return True
    if any(tuple(a.replace("\\", "/").split("/")[-2:]) == ("torchtitan", "train.py") for a in args):
        return True
    # before 2025-02 torchtitan's train.py sat at the repository's root: its TOML flag tells it
    return any(a.split("=", 1)[0] in ("--job.config_file", "--job.config-file") for a in args)


def _is_lightning(args: Sequence[str]) -> bool:
    if any(m == "lightning" or m.startswith(("lightning.", "pytorch_lightning")) for m in _modules(args)):
        return True
    scripts = _scripts(args)
    if not scripts:
        return False
    rest = args[scripts[0] + 1:]
    # LightningCLI: `script.py fit ...`, or its trainer's flags (`--trainer.max_epochs=3`)
    return (bool(rest) and rest[0] == "fit") or any(a.startswith("--trainer.") for a in rest)


def _is_torchrun(args: Sequence[str]) -> bool:
    starts = [i for i, a in enumerate(args) if _base(a) == "torchrun"]
    starts += [i + 1 for i, a in enumerate(args[:-1]) if a == "-m" and args[i + 1] in _LAUNCHER_MODULES]
    if not starts:
        return False
    after = args[min(starts) + 1:]
    # ... with something to run: a script, a module (-m) or a program (--no-python)
    return bool(_scripts(after)) or any(a in ("-m", "--module", "--no-python", "--no_python") for a in after)


def detect(command: Sequence[str], *, reference_trainer: bool) -> str:
    """The adapter for ``job.program=auto``: one of :data:`NAMES` but ``auto``.

    ``reference_trainer``: :func:`slurmkit.failures.programs.is_reference_trainer` of the same
    command, asked by the caller. That function is the one answer to "is it the reference
    trainer?" (submit, the agent and the standbys ask it); this package sits below
    ``failures`` and does not ask it a second way.

    torchtitan: ``-m torchtitan.train`` (or an experiment's ``torchtitan.X.train``), a
    ``torchtitan/train.py`` script, or 0.1-era ``--job.config_file``. Lightning: only when the
    command says so: ``-m lightning...`` / ``-m pytorch_lightning...``, or a script whose first
    argument is LightningCLI's ``fit`` or that takes ``--trainer.*`` flags (a plain ``python
    train.py`` that builds a Trainer inside is ``none``). torchrun: ``torchrun`` or ``-m
    torch.distributed.run`` (``.launch``) with a script or module. Anything else: ``none``.
    """
    if reference_trainer:
        return REFERENCE
    args = [str(a) for a in command]
    if _is_torchtitan(args):
        return TORCHTITAN
    if _is_lightning(args):
        return LIGHTNING
    if _is_torchrun(args):
        return TORCHRUN
    return NONE


def resolve(program: str, command: Sequence[str], *, reference_trainer: bool) -> str:
    """The adapter that ``job.program`` (``program``) names: :func:`detect` for ``auto``,
    ``program`` itself for another of :data:`NAMES`; ConfigError for anything else."""
    if program == AUTO:
        return detect(command, reference_trainer=reference_trainer)
    if program not in NAMES:
        raise ConfigError(f"job.program={program!r}", f"one of {', '.join(NAMES)}",
                          "set job.program=auto to have it recognised from job.command")
    return program


def _flag_values(args: Sequence[str], names: Sequence[str]) -> list[str]:
    """The values given to any of the flags ``names``, as ``--flag V`` or ``--flag=V``, in order."""
    values = []
    for i, a in enumerate(args):
        if a in names and i + 1 < len(args) and not args[i + 1].startswith("-"):
            values.append(args[i + 1])
        else:
            name, sep, value = a.partition("=")
            if sep and name in names:
                values.append(value)
    return values


def total_steps(adapter: str, command: Sequence[str]) -> int | None:
    """The number of steps the program will train, where its command says it: torchtitan's
    ``--training.steps N`` (the last one given, as its CLI takes it). None when unknown: no
    flag, another program, a value that is no count in 1..2**53. Never a default."""
    if adapter != TORCHTITAN:
        return None
    values = _flag_values([str(a) for a in command], ("--training.steps",))
    if not values or not values[-1].isascii() or not values[-1].isdigit() or len(values[-1]) > 16:
        return None
    steps = int(values[-1])
    return steps if 0 < steps < _MAX_STEPS else None


def _local(path: str) -> bool:
    return bool(path) and "://" not in path and "\0" not in path


def checkpoint_dirs(adapter: str, command: Sequence[str], cwd: str) -> list[str]:
    """The folders (absolute, normalised) where the program saves its checkpoints, for
    :func:`slurmkit.adapters.checkpoints.complete_checkpoints` with the same adapter; relative
    paths are taken from ``cwd``, the ranks' working directory. Empty when the command does not
    tell (a torchrun script saves where it likes: the user's glob says where), or the folder is
    remote (``s3://``).

    torchtitan: ``<dump folder>/<checkpoint.folder>``, one per default dump folder
    (:data:`TITAN_DEFAULT_DUMPS`) when no flag gives it. Lightning: ``<default_root_dir>/checkpoints``
    and ``<default_root_dir>/lightning_logs`` (whose ``version_K/checkpoints`` the scan reads).
    """
    args = [str(a) for a in command]
    if adapter == TORCHTITAN:
        dumps = _flag_values(args, _TITAN_DUMP_FLAGS)[-1:] or list(TITAN_DEFAULT_DUMPS)
        folder = (_flag_values(args, ("--checkpoint.folder",)) or ["checkpoint"])[-1]
        found = [os.path.join(cwd, dump, folder) for dump in dumps if _local(dump) and _local(folder)]
    elif adapter == LIGHTNING:
        root = (_flag_values(args, ("--trainer.default_root_dir", "--trainer.default-root-dir")) or ["."])[-1]
        found = ([os.path.join(cwd, root, "checkpoints"), os.path.join(cwd, root, "lightning_logs")]
                 if _local(root) else [])
    else:
        found = []
    out: list[str] = []
    for path in found:
        path = os.path.normpath(path)
        if path not in out:
            out.append(path)
    return out


def _either(*names: str) -> tuple[str, ...]:
    """A tyro flag as it is taken: with underscores and with hyphens."""
    return tuple(dict.fromkeys(n for name in names for n in (name, name.replace("_", "-"))))


def trace_stems(adapter: str, command: Sequence[str], cwd: str) -> list[str]:
    """Where the program has torch's flight recorder write its dumps, over the agent's
    ``TORCH_FR_DUMP_TEMP_FILE``: the stems (absolute; a rank's file is the stem and its rank)
    the agent waits on and names after a hang. Empty where the program leaves the agent's
    variable alone (any program but torchtitan, or torchtitan with ``--comm.trace_buf_size 0``)
    or the folder is not local.

    torchtitan: ``<dump folder>/<comm.save_traces_folder>/<comm.save_traces_file_prefix>``; one
    per default dump folder and trace folder when no flag gives them (the version is unknown)."""
    if adapter != TORCHTITAN:
        return []
    args = [str(a) for a in command]
    size = _flag_values(args, _either("--comm.trace_buf_size"))[-1:]
    if size and size[0].strip().lstrip("+").isdigit() and int(size[0]) == 0:
        return []
    dumps = _flag_values(args, _TITAN_DUMP_FLAGS)[-1:] or list(TITAN_DEFAULT_DUMPS)
    folders = _flag_values(args, _either("--comm.save_traces_folder"))[-1:] or list(TITAN_DEFAULT_TRACE_FOLDERS)
    prefix = (_flag_values(args, _either("--comm.save_traces_file_prefix")) or ["rank_"])[-1]
    if not _local(prefix) or "/" in prefix:
        return []
    out: list[str] = []
    for dump in dumps:
        for folder in folders:
            if _local(dump) and _local(folder):
                stem = os.path.join(os.path.normpath(os.path.join(cwd, dump, folder)), prefix)
                if stem not in out:
                    out.append(stem)
    return out
