"""A site's own health commands (``health.extra_commands``): argv lists run without a shell.

Exit 0 is a healthy node; any other exit is a bad node, with the end of its output as the
evidence. No exit within the deadline (the command's whole process group is killed then) is
``wait``: re-checked with a longer deadline, as a slow node is not a bad one. The
output is read as it comes and only its last ``max_bytes`` kept, so a command that floods its
output cannot fill the agent's memory.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from collections import deque
from collections.abc import Mapping, Sequence

from slurmkit.health.result import CheckResult, Figure, bad, ok, printable, wait


def check_name(argv: Sequence[str]) -> str:
    return "site:" + os.path.basename(argv[0])


def _drain(stream: object, keep: deque[bytes], max_bytes: int) -> None:
    held = 0
    read = getattr(stream, "read1")
    while True:
        chunk = read(65536)
        if not chunk:
            return
        keep.append(chunk)
        held += len(chunk)
        while held - len(keep[0]) >= max_bytes:
            held -= len(keep.popleft())


def run_site_command(argv: Sequence[str], env: Mapping[str, str], timeout_s: float,
                     max_bytes: int) -> CheckResult:
    name = check_name(argv)
    fix = f"run `{' '.join(argv)}` on the node to see why; drain the node if the site check is right"
    try:
        proc = subprocess.Popen(list(argv), env=dict(env), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
    except OSError as exc:
        return bad(name, f"cannot run {argv[0]!r}: {exc.strerror or exc}",
                   "every site health command of health.extra_commands runs on every node", fix)
    keep: deque[bytes] = deque()
    reader = threading.Thread(target=_drain, args=(proc.stdout, keep, max_bytes), daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        proc.wait()
        code = None
    reader.join(1.0)
    output = printable(b"".join(keep)[-max_bytes:].decode(errors="replace"), max_bytes).strip()
    figures: dict[str, Figure] = {"exit_code": -1 if code is None else code, "output": output}
    if code is None:  # slow is not unhealthy (a loaded node): re-checked with a longer deadline
        return wait(name, f"{argv[0]} did not finish within {timeout_s:g} s (killed); output: {output[-300:]!r}",
                    "each site health command finishes within health.timeout_s", fix, **figures)
    if code != 0:
        return bad(name, f"{argv[0]} exited {code}: {output[-300:]!r}",
                   "every site health command exits 0", fix, **figures)
    return ok(name, f"{argv[0]} exited 0", **figures)
