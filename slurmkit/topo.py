"""``python -m slurmkit.topo ARGS``: the ``python -m`` spelling of :mod:`slurmkit.cli.topo`, the same
as ``slurmkit topo ARGS``.

Kept for the users, sbatch templates and docs that spell it; nothing else lives here (import
slurmkit.cli.topo itself).
"""

import sys

if __name__ == "__main__":
    from slurmkit.cli.topo import main

    sys.exit(main(sys.argv[1:]))
