"""Node 0's open-file limit (slurmkit.launch.fdlimit): raised for the store before agents connect."""

from __future__ import annotations

import resource
import subprocess
import sys

from slurmkit.launch.fdlimit import CONNECTIONS_PER_AGENT, raise_fd_limit, store_fds_needed

NOFILE = resource.RLIMIT_NOFILE


class Limits:
    def __init__(self, soft: int, hard: int, refuse: bool = False) -> None:
        self.soft, self.hard, self.refuse = soft, hard, refuse

    def get(self, which: int) -> tuple[int, int]:
        assert which == NOFILE
        return self.soft, self.hard

    def set(self, which: int, limits: tuple[int, int]) -> None:
        if self.refuse:
            raise ValueError("not allowed")
        self.soft, self.hard = limits


def test_the_need_grows_with_the_job() -> None:
    assert store_fds_needed(2048) - store_fds_needed(1024) == CONNECTIONS_PER_AGENT * 1024
    assert store_fds_needed(2048) > 10_000  # a login shell's 1,024 would not do


def test_a_low_soft_limit_is_raised_to_the_need() -> None:
    lim = Limits(1024, 65536)
    assert raise_fd_limit(11_000, getrlimit=lim.get, setrlimit=lim.set) is None
    assert (lim.soft, lim.hard) == (11_000, 65536)


def test_enough_already_changes_nothing() -> None:
    lim = Limits(20_000, 20_000, refuse=True)
    assert raise_fd_limit(11_000, getrlimit=lim.get, setrlimit=lim.set) is None
    lim = Limits(resource.RLIM_INFINITY, resource.RLIM_INFINITY, refuse=True)
    assert raise_fd_limit(11_000, getrlimit=lim.get, setrlimit=lim.set) is None


def test_a_low_hard_limit_is_used_and_said_with_the_fix() -> None:
    lim = Limits(1024, 4096)
    msg = raise_fd_limit(11_000, getrlimit=lim.get, setrlimit=lim.set)
    assert lim.soft == 4096
    assert msg is not None and "Detected:" in msg and "Requirement: 11000" in msg and "Fix:" in msg
    assert "4096" in msg


def test_a_refused_raise_is_said() -> None:
    lim = Limits(1024, 65536, refuse=True)
    msg = raise_fd_limit(11_000, getrlimit=lim.get, setrlimit=lim.set)
    assert msg is not None and "could not be raised" in msg and "ulimit -n" in msg


def test_the_real_limit_of_a_process_started_with_a_low_one() -> None:
    """A real process whose soft limit starts at 256 (as a job inherits a shell's) raises it."""
    code = (
        "import resource\n"
        "from slurmkit.launch.fdlimit import raise_fd_limit\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "assert soft == 256, soft\n"
        "need = min(hard, 2000) if hard != resource.RLIM_INFINITY else 2000\n"
        "print(raise_fd_limit(need))\n"
        "print(resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= need)\n"
    )
    hard = resource.getrlimit(NOFILE)[1]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         preexec_fn=lambda: resource.setrlimit(NOFILE, (256, hard)))
    assert out.stdout.split() == ["None", "True"], out.stderr
