"""Submitting must stay fast: composing and rendering a job imports no torch."""

import subprocess
import sys


def test_submit_imports_no_torch() -> None:
    code = ("import sys, slurmkit.cli.submit, slurmkit.launch.entry; "
            "from slurmkit.store import StoreConfig; "
            "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')); "
            "assert not bad, bad[:5]")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
