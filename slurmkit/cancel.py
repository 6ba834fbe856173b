"""``python -m slurmkit.cancel ARGS``: the ``python -m`` spelling of :mod:`slurmkit.cli.cancel`, the same
as ``slurmkit cancel ARGS``.

Kept for the users, sbatch templates and docs that spell it; nothing else lives here (import
slurmkit.cli.cancel itself).
"""

import sys

if __name__ == "__main__":
    from slurmkit.cli.cancel import main

    sys.exit(main(sys.argv[1:]))
