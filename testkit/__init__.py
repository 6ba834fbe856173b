"""Helpers for tests and tools: real local services (S3 server), a fake Slurm controller
(:mod:`testkit.fakeslurm`), the local cluster's state, Slurm build and node loss, and the chaos
campaign. A top-level package of the repository, not of slurmkit: the wheel does not ship it
(setup.py packages only ``slurmkit``), and nothing in the product imports from here. Tests and
tools import it with the repository root on ``sys.path`` (pytest's rootdir; the tool scripts
insert it)."""
