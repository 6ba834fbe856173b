"""``python -m slurmkit.clean ARGS``: the ``python -m`` spelling of :mod:`slurmkit.cli.clean`, the same
as ``slurmkit clean ARGS``; nothing else lives here."""

import sys

if __name__ == "__main__":
    from slurmkit.cli.clean import main

    sys.exit(main(sys.argv[1:]))
