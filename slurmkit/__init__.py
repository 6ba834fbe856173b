"""slurmkit: Hydra configs to fault-tolerant, topology-pinned training jobs on Slurm."""

__version__ = "0.1.0"

# Exit code contract (slurmkit/contract.py): the supervisor decided not to restart; Slurm must
# not requeue. Re-exported here because it is the one code users configure their site around.
from slurmkit.contract import EXIT_NO_REQUEUE

__all__ = ["EXIT_NO_REQUEUE", "__version__"]
