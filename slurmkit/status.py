"""``python -m slurmkit.status ARGS``: the ``python -m`` spelling of :mod:`slurmkit.cli.status`, the same
as ``slurmkit status ARGS``.

Kept for the users, sbatch templates and docs that spell it; nothing else lives here (import
slurmkit.cli.status itself).
"""

import sys

if __name__ == "__main__":
    from slurmkit.cli.status import main

    sys.exit(main(sys.argv[1:]))
