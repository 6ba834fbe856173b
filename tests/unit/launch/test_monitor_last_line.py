"""RankMonitor keeps each rank's last lines and puts the telling one on the rank's exit, also
when the pipe's last lines are read after the exit was seen (they usually are)."""

from __future__ import annotations

from slurmkit.failures.classes import FailureClass
from slurmkit.launch.monitor import TAIL_LINES, RankMonitor


def _monitor() -> RankMonitor:
    return RankMonitor("node1", 0, heartbeat_timeout_s=60, startup_timeout_s=60, require_heartbeat=False,
                       wall=lambda: 1000.0, mono=lambda: 0.0, proc_state=lambda pid: "S")


def test_the_exit_carries_the_line_printed_before_it() -> None:
    mon = _monitor()
    mon.on_line(1, "python: can't open file '/w/train.py': [Errno 2] No such file or directory")
    mon.on_exit(1, 2)
    (ev,) = mon.evidence
    assert (ev.kind, ev.cls, ev.detail) == ("exit", FailureClass.USER_ERROR, "returncode 2")
    assert ev.last_line == "python: can't open file '/w/train.py': [Errno 2] No such file or directory"
    assert mon.triggered is ev


def test_lines_read_after_the_exit_update_it() -> None:
    mon = _monitor()
    mon.on_line(0, "step 3")
    mon.on_exit(0, 1)
    assert mon.evidence[0].last_line == "step 3"
    for line in ("Traceback (most recent call last):", '  File "t.py", line 1', "KeyError: 'lr'",
                 "[W ProcessGroupGloo.cpp:1] Warning: destroyed late"):
        mon.on_line(0, line)
    exits = [e for e in mon.evidence if e.kind == "exit"]
    assert len(exits) == 1 and exits[0].last_line == "KeyError: 'lr'"
    assert mon.triggered is exits[0]  # what the loop posts is the updated record
    assert [e.kind for e in mon.evidence] == ["exit", "line"]  # the traceback line as before


def test_other_ranks_lines_stay_their_own() -> None:
    mon = _monitor()
    mon.on_line(0, "RuntimeError: rank 0's")
    mon.on_line(1, "step 9")
    mon.on_exit(1, -9)
    assert mon.evidence[0].last_line == "step 9"


def test_only_the_last_lines_are_kept_each_bounded() -> None:
    mon = _monitor()
    mon.on_line(2, "ValueError: long ago")
    for i in range(TAIL_LINES):
        mon.on_line(2, f"step {i} " + "z" * 100_000)
    mon.on_exit(2, 1)
    said = mon.evidence[0].last_line
    assert said.startswith(f"step {TAIL_LINES - 1} ") and len(said) == 500  # the old error fell out
    assert all(len(line) <= 500 for line in mon._tails[2]) and len(mon._tails[2]) == TAIL_LINES


def test_a_clean_exit_records_nothing() -> None:
    mon = _monitor()
    mon.on_line(0, "RuntimeError: caught and handled")
    mon.on_exit(0, 0)
    mon.on_line(0, "bye")
    assert [e.kind for e in mon.evidence] == []
