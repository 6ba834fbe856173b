"""Errors raised while talking to Slurm.

All of them descend from :class:`slurmkit.errors.SlurmkitError` so an entry point can catch one
type. A failed command keeps the exact argument list and what the command printed, because the
stderr of ``sbatch``/``scontrol`` is usually the only useful diagnosis.
"""

from __future__ import annotations

import shlex

from slurmkit.errors import SlurmkitError


class SlurmError(SlurmkitError):
    """Root of the errors of ``slurmkit.slurm``."""


class SlurmCommandError(SlurmError):
    """A Slurm command exited non-zero (or did not finish, see :class:`SlurmCommandTimeout`).

    Attributes:
        cmd: the argument list that was run.
        returncode: exit status, or None when the command was killed for running too long.
        stderr: what the command wrote to stderr (stripped).
        stdout: what the command wrote to stdout (stripped).
    """

    def __init__(self, cmd: list[str], returncode: int | None, stderr: str,
                 stdout: str = "") -> None:
        self.cmd = list(cmd)
        self.returncode = returncode
        self.stderr = stderr.strip()
        self.stdout = stdout.strip()
        super().__init__(self._message())

    def _message(self) -> str:
        printed = self.stderr or self.stdout or "(nothing printed)"
        return f"`{shlex.join(self.cmd)}` exited with status {self.returncode}: {printed}"

    @property
    def output(self) -> str:
        """stderr and stdout together: where the classifier looks for known messages."""
        return f"{self.stderr}\n{self.stdout}".strip()


class SlurmCommandTimeout(SlurmCommandError):
    """A Slurm command ran past its timeout and was killed."""

    def __init__(self, cmd: list[str], timeout_s: float, stderr: str, stdout: str = "") -> None:
        self.timeout_s = timeout_s
        super().__init__(cmd, None, stderr, stdout)

    def _message(self) -> str:
        printed = self.stderr or self.stdout or "(nothing printed)"
        return (f"`{shlex.join(self.cmd)}` did not finish within {self.timeout_s:g} s and was "
                f"killed; it had printed: {printed}")


class SlurmNotInstalled(SlurmError):
    """A Slurm client binary is not on PATH."""

    def __init__(self, binary: str) -> None:
        self.binary = binary
        super().__init__(
            f"Detected: `{binary}` was not found on PATH. Requirement: the Slurm client commands "
            f"(sbatch, squeue, sacct, scontrol, scancel) on the machine that runs slurmkit. "
            f"Fix: run from a cluster login node, install the Slurm client "
            f"(Debian: apt-get install slurm-client), or add its bin directory to PATH"
        )


class SlurmParseError(SlurmError):
    """Slurm printed something the parsers do not understand."""

    def __init__(self, what: str, text: str) -> None:
        self.what = what
        self.text = text
        excerpt = text if len(text) <= 300 else text[:300] + "..."
        super().__init__(f"cannot parse {what} from Slurm output: {excerpt!r}")


class SlurmJobStateError(SlurmError):
    """A job reached a state that makes the awaited state impossible, or vanished."""


class SlurmWaitTimeout(SlurmError):
    """A job did not reach the awaited state in time."""
