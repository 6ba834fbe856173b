"""Entry point of ``python -m slurmkit.store``."""

import sys

from slurmkit.store.cli import main

sys.exit(main())
