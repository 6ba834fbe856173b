"""`python -m slurmkit.launch RUN_DIR`: the node agent, as the standalone sbatch script runs it."""

import sys

from slurmkit.launch.agent import agent_main

if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m slurmkit.launch RUN_DIR")
    sys.exit(agent_main(sys.argv[1]))
