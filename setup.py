"""The one thing pyproject.toml cannot say: the top-level conf/ and sbatch_templates/ directories
are installed as the packages slurmkit.conf and slurmkit.sbatch_templates (read through
importlib.resources, slurmkit/resources.py). Everything else is in pyproject.toml."""

from setuptools import find_packages, setup

DATA = {"slurmkit.conf": "conf", "slurmkit.sbatch_templates": "sbatch_templates"}

setup(
    packages=find_packages(include=["slurmkit", "slurmkit.*"]) + list(DATA),
    package_dir=DATA,
    package_data={"slurmkit.conf": ["*.yaml", "*/*.yaml"], "slurmkit.sbatch_templates": ["*.j2"],
                  "slurmkit.report": ["templates/*.j2"]},
)
