"""``python -m slurmkit.plan ARGS``: the ``python -m`` spelling of :mod:`slurmkit.cli.plan`, the same
as ``slurmkit plan ARGS``.

Kept for the users, sbatch templates and docs that spell it; nothing else lives here (import
slurmkit.cli.plan itself).
"""

import sys

if __name__ == "__main__":
    from slurmkit.cli.plan import main

    sys.exit(main(sys.argv[1:]))
