"""``python -m slurmkit.logs RUN_DIR [--rank N | --agent NODE | --batch] [-n LINES] [-f]``

Prints (``-f``: follows) one log of a run. Where each log lives:

- rank N: ``RUN_DIR/logs/rank<N>.log``, teed line by line by the node agent (every
  generation and requeue appends to it).
- the node agent of node NODE (a node rank, or a node name of the newest allocation): one
  file per node and job id, ``RUN_DIR/submitit/<job>_node<i>_log.out`` (submitit's script) or
  ``RUN_DIR/logs/<job>_node<i>_log.out`` (``submit.emit=sbatch``); locally submitit's
  ``RUN_DIR/submitit/<pid>_<i>_log.out``. The newest file wins (a requeue keeps the job id
  and appends).
- ``--batch``: the batch script's own output (``<job>_0_log.out``, ``<job>_batch.out``).

Log lines come from the job: every character that is not printable (``str.isprintable()``:
C0 and C1 controls, bidi overrides, line separators, ...; tabs aside) is shown escaped, as
``\\x9b`` or ``\\u202e``, so a line cannot drive the terminal nor read otherwise than it is.
Lines are cut at "\\n", "\\r\\n" and "\\r" only. Following survives the file being replaced or
truncated.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import sys
import time
from collections.abc import Callable
from typing import BinaryIO, TextIO

from slurmkit.errors import ConfigError
from slurmkit.ledger.names import ALLOCATION_START
from slurmkit.runfiles import LOGS_DIR, SUBMITIT_DIR
from slurmkit.runview import RunWatcher, is_run_dir
from slurmkit.untrusted import safe_line

_LINE_BREAK = re.compile(r"\r\n|\r|\n")


def rank_log(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, LOGS_DIR, f"rank{rank}.log")


def _newest(paths: list[str]) -> str | None:
    existing = [p for p in paths if os.path.isfile(p)]
    return max(existing, key=os.path.getmtime) if existing else None


def node_index(run_dir: str, node: str) -> int:
    """A node rank from ``--agent``: a number, or a name in the newest allocation's node list."""
    if node.isdigit():
        return int(node)
    w = RunWatcher(run_dir)
    w.refresh()
    allocs = [e for e in w.tail.events if e.get("event") == ALLOCATION_START]
    nodes = allocs[-1].get("nodes") if allocs else None
    if isinstance(nodes, list) and node in nodes:
        return nodes.index(node)
    raise ConfigError(f"node {node!r} is not in the run's newest allocation ({nodes or 'none yet'})",
                      "a node rank (0, 1, ...) or a node name of the allocation",
                      "pass --agent 0 for node 0's agent")


def agent_log(run_dir: str, index: int) -> str | None:
    pats = [os.path.join(run_dir, d, f"*_node{index}_log.out") for d in (SUBMITIT_DIR, LOGS_DIR)]
    found = [p for pat in pats for p in glob.glob(pat)]
    if not found:  # submitit's local executor: <pid>_<task>_log.out, one task per node
        found = [p for p in glob.glob(os.path.join(run_dir, SUBMITIT_DIR, f"*_{index}_log.out"))
                 if re.fullmatch(rf"\d+_{index}_log\.out", os.path.basename(p))]
    return _newest(found)


def batch_log(run_dir: str) -> str | None:
    return _newest(glob.glob(os.path.join(run_dir, SUBMITIT_DIR, "*_0_log.out"))
                   + glob.glob(os.path.join(run_dir, LOGS_DIR, "*_batch.out")))


def last_lines(f: BinaryIO, n: int, block: int = 65536) -> bytes:
    """The last ``n`` lines from the file's end, reading backwards block by block."""
    f.seek(0, os.SEEK_END)
    end = pos = f.tell()
    data = b""
    while pos > 0 and data.count(b"\n") <= n:
        step = min(block, pos)
        pos -= step
        f.seek(pos)
        data = f.read(step) + data
    lines = data.splitlines(keepends=True)
    f.seek(end)
    return b"".join(lines[-n:]) if n > 0 else b""


def _write(out: TextIO, data: bytes) -> None:
    # Not splitlines(): it also breaks at U+2028, U+0085, \x0b, ... which are shown escaped.
    parts = _LINE_BREAK.split(data.decode("utf-8", errors="replace"))
    for i, body in enumerate(parts):
        last = i == len(parts) - 1
        if not (last and body == ""):
            out.write(safe_line(body) + ("" if last else "\n"))
    out.flush()


def follow(path: str, out: TextIO, *, lines: int, follow_file: bool,
           sleep: Callable[[float], None] = time.sleep, poll_s: float = 0.5,
           stop: Callable[[], bool] = lambda: False) -> None:
    """Print the last ``lines`` of ``path``; with ``follow_file`` keep printing what is appended
    until ``stop()`` (or Ctrl-C). A replaced (new inode) or truncated file is read from its start."""
    f = open(path, "rb")
    try:
        _write(out, last_lines(f, lines))
        while follow_file and not stop():
            chunk = f.read()
            if chunk:
                _write(out, chunk)
                continue
            try:
                st = os.stat(path)
            except FileNotFoundError:
                sleep(poll_s)
                continue
            if st.st_ino != os.fstat(f.fileno()).st_ino or st.st_size < f.tell():
                f.close()
                f = open(path, "rb")
                continue
            sleep(poll_s)
        if follow_file:  # stopped: what was written before the end, too
            _write(out, f.read())
    finally:
        f.close()


#: How a run's ledger ends for good; ``signalled`` hands the run to a requeued or successor job.
FINAL_ENDS = frozenset({"completed", "stopped", "failed", "cancelled"})


class RunEnd:
    """``stop()`` for ``-f``: true once the run's ledger ended for good. Following asks once per
    poll (0.5 s); the ledger is read at every ``every``-th question (2 s), only what it gained,
    so following ends with the job. ``follow`` prints what the log gained up to then first."""

    def __init__(self, run_dir: str, every: int = 4) -> None:
        self.watcher, self.every = RunWatcher(run_dir), max(1, every)
        self.status = ""
        self._asked = 0

    def __call__(self) -> bool:
        if not self.status and self._asked % self.every == 0:
            self.watcher.refresh()
            v = self.watcher.view
            if v is not None and v.ended and v.phase in FINAL_ENDS:
                self.status = v.phase
        self._asked += 1
        return bool(self.status)


def pick(run_dir: str, args: argparse.Namespace) -> str:
    if args.batch:
        path = batch_log(run_dir)
        what = "the batch script's log"
    elif args.agent is not None:
        path = agent_log(run_dir, node_index(run_dir, args.agent))
        what = f"node {args.agent}'s agent log"
    else:
        path = rank_log(run_dir, args.rank)
        what = f"rank {args.rank}'s log"
        if not os.path.isfile(path) and args.follow:
            return path  # follow waits for it to appear
    if path is None or not os.path.isfile(path):
        raise ConfigError(f"{what} is not in {run_dir} (yet)",
                          "a run whose job has started (logs appear when the agents start)",
                          f"check the job with: slurmkit status {run_dir}")
    return path


def main(argv: list[str], out: TextIO | None = None,
         sleep: Callable[[float], None] = time.sleep) -> int:
    p = argparse.ArgumentParser(prog="slurmkit logs", description="Print or follow a run's log.")
    p.add_argument("run_dir")
    who = p.add_mutually_exclusive_group()
    who.add_argument("--rank", type=int, default=0, help="a rank's log (default: rank 0)")
    who.add_argument("--agent", metavar="NODE", help="a node agent's log: node rank or node name")
    who.add_argument("--batch", action="store_true", help="the batch script's output")
    p.add_argument("-n", "--lines", type=int, default=40, help="lines to print first (default 40)")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing what is appended")
    args = p.parse_args(argv)
    out = out or sys.stdout
    try:
        if not is_run_dir(args.run_dir):
            raise ConfigError(f"{args.run_dir} is not a run directory",
                              "a directory holding config.yaml and ledger.jsonl",
                              "pass the run directory printed at submit (slurmkit runs lists them)")
        run_dir = os.path.abspath(args.run_dir)
        path = pick(run_dir, args)
        over = RunEnd(run_dir)
        while not os.path.isfile(path):  # -f on a rank log not written yet
            if over():
                print(f"the run ended ({over.status}) before {path} was written", file=sys.stderr)
                return 0
            sleep(0.5)
        follow(path, out, lines=args.lines, follow_file=args.follow, sleep=sleep, stop=over)
        if args.follow and over.status:
            print(f"-- the run ended: {over.status}", file=sys.stderr)
    except ConfigError as exc:  # may quote a node name read from the ledger
        print(f"error: {safe_line(str(exc))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
