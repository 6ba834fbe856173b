"""An in-memory Slurm controller for fast tests: :class:`FakeSlurm` plays sbatch, squeue, sacct,
scancel and scontrol behind the :class:`slurmkit.slurm.runner.CommandRunner` interface.

It lives in the repository's :mod:`testkit` (not shipped in the wheel), not in
:mod:`slurmkit.slurm`, because nothing in the product may ever run on it: production code takes a
:class:`slurmkit.slurm.client.SlurmClient` (built on :class:`slurmkit.slurm.runner.SubprocessRunner`
at the entry points), and tests hand the same code a client on this fake instead.
"""

from testkit.fakeslurm.cluster import SOCKET_TIMEOUT, FakeSlurm
from testkit.fakeslurm.jobs import REQUEUE_DELAY_S, FakeJob, FakeNode

__all__ = ["REQUEUE_DELAY_S", "SOCKET_TIMEOUT", "FakeJob", "FakeNode", "FakeSlurm"]
