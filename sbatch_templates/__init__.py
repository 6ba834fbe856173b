"""Marks sbatch_templates/ as the package ``slurmkit.sbatch_templates`` (see setup.py) so that
wheels ship the templates."""
