"""A sweep before anything exists: every variant composed, validated and reduced to one JobSpec.

All variants are checked first, so a bad value in the last one refuses the whole sweep before a
directory is created or a job submitted. One job array has one resource request, so every
variant must ask Slurm for the same thing; what differs between variants (learning rate, steps,
model) lives only in each variant's frozen config.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from slurmkit.config import SlurmkitConfig, compose
from slurmkit.errors import ActionableError, ConfigError
from slurmkit.render.jobspec import JobSpec, array_spec, build_jobspec
from slurmkit.sweep.expand import expand

PLACEHOLDER_DIR = "/SWEEP_DIR"  # stands for the sweep directory until it is created


@dataclass
class PlannedVariant:
    index: int
    overrides: list[str]  # all of this variant's overrides
    distinct: list[str]  # the ones that set it apart from the other variants
    cfg: SlurmkitConfig


@dataclass
class SweepPlan:
    variants: list[PlannedVariant]
    common: list[str]  # overrides every variant shares
    spec: JobSpec  # of the whole array; run_dir is PLACEHOLDER_DIR until placed

    @property
    def cfg(self) -> SlurmkitConfig:
        return self.variants[0].cfg

    def placed(self, sweep_dir: str) -> JobSpec:
        return dataclasses.replace(self.spec, run_dir=sweep_dir)


def _in_variant(index: int, overrides: list[str], exc: ActionableError) -> ConfigError:
    where = f"variant {index} ({' '.join(overrides)})"
    if not exc.requirement and not exc.fix:
        return ConfigError(f"{where}: {exc.detected}", "every variant of a sweep is valid",
                           "fix or drop that value; nothing was submitted")
    return ConfigError(f"{where}: {exc.detected}", exc.requirement, exc.fix)


def _differences(a: JobSpec, b: JobSpec) -> list[str]:
    return [f.name for f in dataclasses.fields(JobSpec) if getattr(a, f.name) != getattr(b, f.name)]


def plan_sweep(overrides: list[str], env: Mapping[str, str],
               resolve: Callable[[SlurmkitConfig, Mapping[str, str]], SlurmkitConfig],
               validate: Callable[[SlurmkitConfig], None],
               srun_args: Callable[[SlurmkitConfig], list[str]], *,
               resolve_command: Callable[[SlurmkitConfig], SlurmkitConfig] | None = None) -> SweepPlan:
    """Expand ``overrides`` (Hydra multirun syntax) and check every variant. Raises ConfigError.

    ``resolve`` picks the cluster kind (auto -> slurm/local), ``validate`` runs submit's
    cross-component checks and ``srun_args`` gives the topology binding flags (Slurm only).
    ``resolve_command`` checks the files job.command names and makes them absolute, once the
    variant's JobSpec passed its secret checks; None leaves job.command as composed.
    """
    all_overrides = expand(overrides)
    common = [o for o in all_overrides[0] if all(o in v for v in all_overrides)]
    kinds: dict[str, str] = {}
    planned: list[PlannedVariant] = []
    specs: list[JobSpec] = []
    for i, ovs in enumerate(all_overrides):
        try:
            cfg = compose(ovs)
            if cfg.cluster.kind == "auto" and "auto" in kinds:
                cfg = dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, kind=kinds["auto"]))
            else:
                kind = cfg.cluster.kind
                cfg = resolve(cfg, env)  # asks the controller once, not once per variant
                kinds.setdefault(kind, cfg.cluster.kind)
            validate(cfg)
            spec = build_jobspec(cfg, PLACEHOLDER_DIR, srun_args(cfg) if cfg.cluster.kind == "slurm" else [],
                                 array=array_spec(len(all_overrides), cfg.submit.array_parallelism))
            if resolve_command is not None:
                cfg = resolve_command(cfg)
        except ActionableError as exc:
            raise _in_variant(i, ovs, exc) from exc
        planned.append(PlannedVariant(i, ovs, [o for o in ovs if o not in common], cfg))
        specs.append(spec)
    for i, spec in enumerate(specs[1:], start=1):
        diff = _differences(specs[0], spec)
        if diff:
            raise ConfigError(
                f"variant {i} ({' '.join(planned[i].distinct)}) asks Slurm for other resources than "
                f"variant 0 ({' '.join(planned[0].distinct)}): {', '.join(diff)} differ",
                "one job array has one resource request (nodes, GPUs, time, partition, ...)",
                "sweep such values in separate submissions, one sweep per resource shape")
    kinds_used = {v.cfg.cluster.kind for v in planned}
    if len(kinds_used) > 1:
        raise ConfigError(f"a sweep that runs on {' and '.join(sorted(kinds_used))} at once",
                          "one executor per sweep", "sweep cluster=... in separate submissions")
    return SweepPlan(planned, common, specs[0])
