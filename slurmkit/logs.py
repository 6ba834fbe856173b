"""``python -m slurmkit.logs ARGS``: the ``python -m`` spelling of :mod:`slurmkit.cli.logs`, the same
as ``slurmkit logs ARGS``.

Kept for the users, sbatch templates and docs that spell it; nothing else lives here (import
slurmkit.cli.logs itself).
"""

import sys

if __name__ == "__main__":
    from slurmkit.cli.logs import main

    sys.exit(main(sys.argv[1:]))
