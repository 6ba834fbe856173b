"""``python -m slurmkit.submit ARGS``: the ``python -m`` spelling of :mod:`slurmkit.cli.submit`, the same
as ``slurmkit submit ARGS``.

Kept for the users, sbatch templates and docs that spell it; nothing else lives here (import
slurmkit.cli.submit itself).
"""

import sys

if __name__ == "__main__":
    from slurmkit.cli.submit import main

    sys.exit(main(sys.argv[1:]))
