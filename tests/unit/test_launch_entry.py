"""The agent's process ends without interpreter finalization once its job is decided."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Stands in for submitit's _submit: the callable, then the result pickle, then a normal exit.
SCRIPT = textwrap.dedent("""
    import sys, types
    marker = sys.argv[1]
    agent = types.ModuleType("slurmkit.launch.agent")
    agent.submitit_entry = lambda run_dir: print("agent done", flush=True)
    sys.modules["slurmkit.launch.agent"] = agent
    from slurmkit.launch import entry

    import atexit

    class TornDownAtFinalization:  # like torch's TCPStore server: a C++ object with a thread
        def __del__(self, _open=open):
            _open(marker + ".finalized", "w").close()

    kept = TornDownAtFinalization()
    atexit.register(lambda: open(marker + ".atexit", "w").close())  # e.g. a library's cleanup
    entry.submitit_entry("/nonexistent")
    open(marker + ".result", "w").close()
    print("result written")
""")


def test_a_completed_agent_skips_finalization_after_submitit_records_success(tmp_path) -> None:
    marker = str(tmp_path / "m")
    res = subprocess.run([sys.executable, "-c", SCRIPT, marker], cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == ["agent done", "result written"], res.stdout  # flushed
    assert os.path.exists(marker + ".result")  # submitit's own work after the callable still runs
    assert not os.path.exists(marker + ".finalized")  # but no C++ teardown at interpreter exit
    assert not os.path.exists(marker + ".atexit")  # and no other exit handler
