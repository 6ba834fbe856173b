"""The agent's process ends without interpreter finalization once its job is decided."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))

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


# The real agent.submitit_entry, its agent_main replaced: what happens after a success.
AFTER_SUCCESS = textwrap.dedent("""
    import sys
    from slurmkit.launch import agent
    agent.agent_main = lambda run_dir: 0
    agent.submitit_entry("/nonexistent")
    print("result written", flush=True)  # what submitit does next: write <job>_0_result.pkl
""")


def _after_success(node_rank: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SLURM_JOB_ID": "7", "SLURM_NODEID": "0", "SLURMKIT_NODES": "n1,n2",
           "SLURMKIT_NODE_RANK": node_rank, "SLURMD_NODENAME": f"n{int(node_rank) + 1}"}
    return subprocess.run([sys.executable, "-c", AFTER_SUCCESS], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def test_on_slurm_only_node0s_agent_leaves_its_success_to_submitit() -> None:
    """Each agent is a one-task step, so submitit names every one of them task 0 and they would
    all write one result file (two finishing together collided: a traceback in a completed
    job's log). Node 0 returns to submitit; the others end with 0 and write nothing."""
    first, other = _after_success("0"), _after_success("1")
    assert first.returncode == 0 and first.stdout.splitlines() == ["result written"], first.stderr
    assert other.returncode == 0 and other.stdout == "", other.stderr
