"""Marks conf/ as the package ``slurmkit.conf`` (see setup.py) so that wheels ship the configs."""
