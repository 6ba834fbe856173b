"""submit.wait: sacct is polled with backoff (1 s doubling to 30 s), not every second.

The real SubprocessRunner runs a stand-in ``sacct`` found first on the PATH the caller passes,
so the test covers the command line wait_job builds, with an injected clock and sleep.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

from rich.console import Console

from slurmkit.cli.submit import Submitted, wait_job
from tests.unit.slurm.test_client import FakeTime

# Prints PENDING for the first 9 calls, then COMPLETED (SACCT_FIELDS order, --parsable2).
FAKE_SACCT = """#!/bin/sh
n=$(cat "$0.count" 2>/dev/null || echo 0)
n=$((n + 1))
echo "$n" > "$0.count"
if [ "$n" -le 9 ]; then state=PENDING; else state=COMPLETED; fi
echo "4242|unit|$state|0:0|||00:00:00||"
"""




def test_wait_job_polls_sacct_with_backoff(tmp_path: Path) -> None:
    sacct = tmp_path / "sacct"
    sacct.write_text(FAKE_SACCT)
    sacct.chmod(0o755)
    env = dict(os.environ, PATH=f"{tmp_path}:{os.environ.get('PATH', '')}")
    t = FakeTime()
    job = Submitted(job_id="4242", run_dir=str(tmp_path), executor="slurm", job=None)
    assert wait_job(job, env, 0, clock=t.clock, sleep=t.sleep) == 0
    assert t.sleeps == [1, 2, 4, 8, 16, 30, 30, 30, 30]
    assert (tmp_path / "sacct.count").read_text().strip() == "10"


def _detached(tmp_path):  # type: ignore[no-untyped-def]
    from slurmkit.cli.submit import Submitted

    return Submitted("4242", str(tmp_path / "run"), "slurm", None)


def _raise_interrupt(_s: float) -> None:
    raise KeyboardInterrupt


def test_off_a_terminal_ctrl_c_only_detaches(tmp_path) -> None:
    from slurmkit.cli.submit import DETACHED_EXIT, after_detach

    cancelled: list[list[str]] = []
    code = after_detach(Console(file=io.StringIO()), _detached(tmp_path), interactive=False,
                        wait=_raise_interrupt, ask=lambda q: "n", cancel=lambda a: cancelled.append(a) or 0)
    assert code == DETACHED_EXIT and cancelled == []


def test_a_second_ctrl_c_asks_before_cancelling(tmp_path) -> None:
    from slurmkit.cli.submit import DETACHED_EXIT, after_detach

    s = _detached(tmp_path)
    for answer, expected in (("c", [[s.run_dir, "--checkpoint"]]), ("now", [[s.run_dir]]), ("", []), ("no", [])):
        cancelled: list[list[str]] = []
        out = io.StringIO()
        code = after_detach(Console(file=out), s, interactive=True, wait=_raise_interrupt,
                            ask=lambda q, a=answer: a, cancel=lambda argv: cancelled.append(argv) or 0)
        assert cancelled == expected, answer
        assert code == (0 if expected else DETACHED_EXIT)
    # no second Ctrl-C within the wait: detached, nothing asked
    asked: list[str] = []
    assert after_detach(Console(file=io.StringIO()), s, interactive=True, wait=lambda t: None,
                        ask=lambda q: asked.append(q) or "c", cancel=lambda a: 1) == DETACHED_EXIT
    assert asked == []
