"""The batch script's word that an agents' srun step ended before node 0's.

The batch script (sbatch_templates/launch_agents.sh.j2) starts the agents in srun steps. A step
of other nodes that ends while node 0's agent runs (it failed to start: "Unable to create step";
srun ended it on a node's loss; its agent was killed) leaves agents that will never beat again.
Liveness would find them only after two deadlines of silence (for an agent that never beat,
2 x supervisor.startup_timeout_s: ten minutes by default, the whole job idle). So the script
says it at once: one line ``<first node rank> <node count> <exit code>`` per ended step in a
node-local file (``SLURMKIT_STEPS_ENDED``, made with mktemp on the batch host, which is node 0's
host), and node 0's agent reads the lines it has not read yet on each liveness look: one stat
of a local file per poll, whatever N; a read only when the file grew.

Only a non-zero exit counts (an agent that left with 0 saw the end of the run). Node 0 then
treats the step's agents as lost (slurmkit.supervise.deciding), and its usual decision follows:
a node whose slurmd answers is kept and its agent relaunched, a dead one takes a spare or is
excluded from the requeue. A line that does not parse is said once and skipped.
"""

from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass

log = logging.getLogger(__name__)

#: The batch script exports the file's path to every agent under this name.
STEPS_ENDED_ENV = "SLURMKIT_STEPS_ENDED"
_MAX_READ = 64 * 1024  # a line per step: at most a few thousand bytes at 2,048 nodes


@dataclass(frozen=True)
class StepEnded:
    first: int  # node rank of the step's first node
    count: int  # its nodes
    code: int  # srun's exit code

    @property
    def node_ranks(self) -> range:
        return range(self.first, self.first + self.count)


class StepsEnded:
    """Node 0: the steps the batch script says ended, each returned once."""

    def __init__(self, path: str | None, nodes: int) -> None:
        self.path, self.nodes = path or None, nodes
        self._offset = 0
        self._said_bad = False

    def new(self) -> list[StepEnded]:
        """Steps that ended with a non-zero code since the last call ([] when none, when the
        file is missing or not this user's plain file)."""
        if self.path is None:
            return []
        try:
            st = os.stat(self.path, follow_symlinks=False)
        except OSError:
            return []
        if st.st_size <= self._offset:
            return []
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            self._bad(f"{self.path} is not a plain file of this user")
            self.path = None
            return []
        try:
            # O_NONBLOCK: a FIFO put there after the stat above must not hang node 0's agent
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            with os.fdopen(fd, "rb") as f:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    return []
                f.seek(self._offset)
                data = f.read(_MAX_READ)
        except OSError:
            return []
        complete = data[:data.rfind(b"\n") + 1]  # a line still being written waits for the next look
        self._offset += len(complete)
        out = []
        for line in complete.decode("ascii", "replace").splitlines():
            got = self._parse(line)
            if got is not None and got.code != 0:
                out.append(got)
        return out

    def _parse(self, line: str) -> StepEnded | None:
        parts = line.split()
        if len(parts) == 3 and all(p.isdigit() for p in parts):
            first, count, code = (int(p) for p in parts)
            if first >= 1 and count >= 1 and first + count <= self.nodes:
                return StepEnded(first, count, code)
        self._bad(f"{self.path}: {line[:80]!r} is not '<first node rank> <count> <exit code>' for "
                  f"{self.nodes} nodes")
        return None

    def _bad(self, why: str) -> None:
        if not self._said_bad:
            log.warning("ignoring the batch script's ended steps: %s", why)
            self._said_bad = True
