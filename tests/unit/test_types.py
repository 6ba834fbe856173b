"""The package type-checks (mypy, settings in pyproject.toml): types are part of the contract."""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_mypy_is_clean() -> None:
    res = subprocess.run([sys.executable, "-m", "mypy", "slurmkit"], cwd=REPO, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-5000:] + res.stderr[-2000:]
