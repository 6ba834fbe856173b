"""What one check found: a verdict, its figures and a Detected/Requirement/Fix message."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class Verdict(str, Enum):
    OK = "ok"
    BAD_NODE = "bad_node"  # this node must not run the ranks: a spare takes its place
    WAIT = "wait"  # something outside the node (a shared file system) is not ready: not its fault
    SKIPPED = "skipped"  # nothing to check here (a CPU layout, no kernel log readable), with why


# Worst first: the node's verdict is the worst of its checks'.
_ORDER = (Verdict.BAD_NODE, Verdict.WAIT, Verdict.OK, Verdict.SKIPPED)

Figure = int | float | str | bool


@dataclass(frozen=True)
class CheckResult:
    name: str
    verdict: Verdict
    detected: str  # what was found (for ok: a one-line summary)
    requirement: str = ""
    fix: str = ""
    figures: dict[str, Figure] = field(default_factory=dict)
    duration_s: float = 0.0

    @property
    def message(self) -> str:
        if not self.requirement and not self.fix:
            return self.detected
        return f"Detected: {self.detected}. Requirement: {self.requirement}. Fix: {self.fix}."

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "verdict": self.verdict.value, "duration_s": round(self.duration_s, 4),
                "figures": dict(self.figures), "message": self.message[:1000]}


def ok(name: str, detected: str, **figures: Figure) -> CheckResult:
    return CheckResult(name, Verdict.OK, detected, figures=figures)


def skipped(name: str, why: str, **figures: Figure) -> CheckResult:
    return CheckResult(name, Verdict.SKIPPED, why, figures=figures)


def bad(name: str, detected: str, requirement: str, fix: str, **figures: Figure) -> CheckResult:
    return CheckResult(name, Verdict.BAD_NODE, detected, requirement, fix, figures)


def wait(name: str, detected: str, requirement: str, fix: str, **figures: Figure) -> CheckResult:
    return CheckResult(name, Verdict.WAIT, detected, requirement, fix, figures)


def overall(results: list[CheckResult]) -> Verdict:
    """The node's verdict: the worst of its checks' (ok when there is nothing to check)."""
    verdicts = {r.verdict for r in results}
    for v in _ORDER:
        if v in verdicts:
            return Verdict.OK if v == Verdict.SKIPPED else v
    return Verdict.OK


def printable(text: str, limit: int) -> str:
    """Untrusted text (a command's output, a kernel message) fit for a log line and the ledger:
    control characters replaced, at most ``limit`` characters (the end is kept: that is where
    a failing command says why)."""
    clean = "".join(c if c in "\n\t" or (ord(c) >= 32 and ord(c) != 127) else "?" for c in text)
    return clean[-limit:] if len(clean) > limit else clean
