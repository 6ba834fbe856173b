"""Rendering: config -> JobSpec -> submitit parameters / sbatch scripts (pure, golden-tested)."""

from slurmkit.render.jobspec import JobSpec, build_jobspec
from slurmkit.render.sbatch import (
    executor_parameters,
    make_executor,
    render_standalone,
    render_submitit_script,
)

__all__ = ["JobSpec", "build_jobspec", "executor_parameters", "make_executor", "render_standalone",
           "render_submitit_script"]
