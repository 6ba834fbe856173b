"""The one place where slurmkit runs a Slurm command.

Every call goes through a :class:`CommandRunner`: list arguments, no shell, a timeout, and the
command's output in the raised error. :class:`SubprocessRunner` runs the real binaries;
:class:`testkit.fakeslurm.FakeSlurm` stands in for them in unit tests and
:class:`slurmkit.slurm.retry.RetryingRunner` adds retries on top of either.

Contract shared by every runner: a command that exits 0 returns a :class:`CommandResult`; any
other outcome raises :class:`SlurmCommandError` (or a subclass), so callers never have to check
``returncode`` themselves.
"""

from __future__ import annotations

import logging
import os
import shlex
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from slurmkit.slurm.errors import SlurmCommandError, SlurmCommandTimeout, SlurmNotInstalled

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CommandResult:
    """What a finished command printed. ``returncode`` is always 0 for a returned result."""

    args: list[str]
    returncode: int
    stdout: str
    stderr: str


@runtime_checkable
class CommandRunner(Protocol):
    """Runs one Slurm command; raises SlurmCommandError unless it exits 0."""

    def run(
        self,
        args: list[str],
        *,
        timeout_s: float = 30,
        input: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> CommandResult:
        """Run ``args`` (no shell) within ``timeout_s`` seconds, feeding ``input`` on stdin.

        ``env`` adds to (and overrides) the runner's base environment for this call only.
        """
        ...


def _text(value: str | bytes | None) -> str:
    # TimeoutExpired carries bytes even in text mode on some Python versions.
    if value is None:
        return ""
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return value


class SubprocessRunner:
    """Runs the real Slurm binaries with :func:`subprocess.run`.

    Args:
        env: the complete base environment of every child (e.g. ``os.environ | cluster_env``);
            None inherits this process's environment. Read at the entry point and passed in so
            no helper reads ``os.environ`` on its own.
    """

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        self._env = dict(env) if env is not None else None

    def _child_env(self, extra: Mapping[str, str] | None) -> dict[str, str] | None:
        if extra is None:
            return self._env
        if self._env is None:
            # No base environment was given: the caller chose to inherit this process's.
            return {**os.environ, **extra}
        return {**self._env, **extra}

    def run(
        self,
        args: list[str],
        *,
        timeout_s: float = 30,
        input: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> CommandResult:
        """See :meth:`CommandRunner.run`."""
        if not args:
            raise ValueError("empty command")
        argv = [str(a) for a in args]
        log.debug("running %s (timeout %.0f s)", shlex.join(argv), timeout_s)
        try:
            proc = subprocess.run(
                argv, input=input, capture_output=True, text=True, timeout=timeout_s,
                env=self._child_env(env), check=True,
            )
        except FileNotFoundError as exc:
            raise SlurmNotInstalled(argv[0]) from exc
        except subprocess.TimeoutExpired as exc:
            raise SlurmCommandTimeout(
                argv, timeout_s, _text(exc.stderr), _text(exc.stdout)) from exc
        except subprocess.CalledProcessError as exc:
            raise SlurmCommandError(
                argv, exc.returncode, _text(exc.stderr), _text(exc.stdout)) from exc
        return CommandResult(argv, proc.returncode, proc.stdout, proc.stderr)
