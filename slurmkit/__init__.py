"""slurmkit: Hydra configs to fault-tolerant, topology-pinned training jobs on Slurm."""

__version__ = "0.1.0"

# Exit code contract: the supervisor decided not to restart; Slurm must not requeue.
EXIT_NO_REQUEUE = 93
