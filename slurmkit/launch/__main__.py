"""`python -m slurmkit.launch RUN_DIR|SWEEP_DIR`: the node agent, as the standalone sbatch script
runs it (a sweep's array task finds its variant's run directory in the sweep directory)."""

import os
import sys

from slurmkit.launch.agent import agent_main
from slurmkit.launch.context import task_run_dir

if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m slurmkit.launch RUN_DIR|SWEEP_DIR")
    sys.exit(agent_main(task_run_dir(sys.argv[1], os.environ)))
