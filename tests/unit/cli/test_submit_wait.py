"""submit.wait: sacct is polled with backoff (1 s doubling to 30 s), not every second.

The real SubprocessRunner runs a stand-in ``sacct`` found first on the PATH the caller passes,
so the test covers the command line wait_job builds, with an injected clock and sleep.
"""

from __future__ import annotations

import os
from pathlib import Path

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
