"""``python -m slurmkit.runs ARGS``: the ``python -m`` spelling of :mod:`slurmkit.cli.runs`, the same
as ``slurmkit runs ARGS``.

Kept for the users, sbatch templates and docs that spell it; nothing else lives here (import
slurmkit.cli.runs itself).
"""

import sys

if __name__ == "__main__":
    from slurmkit.cli.runs import main

    sys.exit(main(sys.argv[1:]))
