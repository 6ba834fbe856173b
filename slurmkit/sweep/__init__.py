"""Sweeps: Hydra's multirun syntax -> one Slurm job array, one run directory per variant."""

from slurmkit.sweep.expand import MULTIRUN_FLAGS, expand, split_multirun, sweeping
from slurmkit.sweepdir import (
    SWEEP_NAME,
    Sweep,
    Variant,
    is_sweep_dir,
    load_sweep,
    new_sweep_dir,
    variant_dir,
    write_sweep,
)

__all__ = ["MULTIRUN_FLAGS", "SWEEP_NAME", "Sweep", "Variant", "expand", "is_sweep_dir",
           "load_sweep", "new_sweep_dir", "split_multirun", "sweeping", "variant_dir", "write_sweep"]
