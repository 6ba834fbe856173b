"""Helpers for tests and tools: real local services (S3 server) and a fake Slurm controller
(:mod:`slurmkit.testing.fakeslurm`). Nothing in the product imports from here."""
