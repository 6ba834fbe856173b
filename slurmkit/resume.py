"""``python -m slurmkit.resume ARGS``: the ``python -m`` spelling of :mod:`slurmkit.cli.resume`, the same
as ``slurmkit resume ARGS``; nothing else lives here."""

import sys

if __name__ == "__main__":
    from slurmkit.cli.resume import main

    sys.exit(main(sys.argv[1:]))
