"""One exception tree for the whole project.

Messages follow one shape so a user can act on them without reading code:
``Detected: <what was found>. Requirement: <what is needed>. Fix: <how>.``
"""

from __future__ import annotations

from typing import Any


class SlurmkitError(Exception):
    """Root of every error slurmkit raises on purpose."""


class ActionableError(SlurmkitError):
    """An error that says what was found, what is needed and how to fix it."""

    def __init__(self, detected: str, requirement: str | None = None, fix: str | None = None) -> None:
        self.detected = detected
        self.requirement = requirement or ""
        self.fix = fix or ""
        if requirement is None and fix is None:
            # Re-raised by a library (OmegaConf rebuilds exceptions from their message alone).
            super().__init__(detected)
        else:
            super().__init__(f"Detected: {detected}. Requirement: {requirement}. Fix: {fix}.")


class ConfigError(ActionableError):
    """The composed configuration cannot work (bad resources, layout, values)."""


class SubmissionError(SlurmkitError):
    """Submitting the job failed; nothing was left half-submitted."""


def print_error(console: Any, exc: BaseException | str, label: str = "error") -> None:
    """Print ``label: exc`` on a rich Console, the message taken literally.

    Messages quote user input, and a Fix hint often holds brackets (``job.command=[python,-m,
    slurmkit.train]``) that rich would read as markup tags and drop; only the label is styled.
    """
    from rich.text import Text  # rich only where something is printed: ranks import this module

    console.print(Text.assemble((label, "bold red"), ": ", printable(str(exc))), highlight=False)


def printable(text: str) -> str:
    """``text`` with every character that is not printable escaped (tab and newline kept).

    Messages quote what the user or a file gave: a bidi override, a C1 control or a line
    separator in it must reach the terminal as ``\u202e``, never act there.
    """
    return "".join(c if c.isprintable() or c in "\t\n" else c.encode("unicode_escape").decode("ascii")
                   for c in text)
