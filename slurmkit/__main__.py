"""``python -m slurmkit VERB ARGS``: the `slurmkit` command without its console script."""

import sys

from slurmkit.cli import run

sys.exit(run())
