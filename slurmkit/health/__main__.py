"""Entry point of ``python -m slurmkit.health``."""

import sys

from slurmkit.health.cli import main

sys.exit(main())
