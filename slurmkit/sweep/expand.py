"""Hydra's multirun syntax -> the list of variants, with the basic sweeper's semantics.

``train.lr=1e-3,3e-3 train.steps=range(20,60,20)`` is the cartesian product of every sweep
override, in command-line order (the last key varies fastest), exactly as Hydra's BasicSweeper
builds its jobs. Parsing is Hydra's own override grammar (hydra.core.override_parser); nothing
here reads the syntax itself. Overrides that do not sweep are passed on verbatim.
"""

from __future__ import annotations

import itertools
import re

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override, Transformer, ValueType
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from slurmkit.errors import ConfigError

MULTIRUN_FLAGS = ("-m", "--multirun")
MAX_VARIANTS = 1000  # Slurm's default MaxArraySize is 1001 (task ids 0-1000)
_ENV_KEY = re.compile(r"\+{0,2}(?:job|cluster)\.env\.\w+")


def split_multirun(argv: list[str]) -> tuple[bool, list[str]]:
    """(multirun?, the overrides without the flag). The flag may appear anywhere, as in Hydra."""
    return any(a in MULTIRUN_FLAGS for a in argv), [a for a in argv if a not in MULTIRUN_FLAGS]


def parse(overrides: list[str]) -> list[Override]:
    try:
        return OverridesParser.create().parse_overrides(list(overrides))
    except (HydraException, OmegaConfBaseException) as exc:
        raise ConfigError(f"an override Hydra cannot parse: {exc}".replace("\n", " "),
                          "key=value, +key=value, ~key; with -m also key=a,b, range(), choice()",
                          "check the override's spelling; quote a value that holds ',' "
                          "(key='a,b') unless it is meant as a sweep") from exc


def sweeping(overrides: list[str]) -> list[str]:
    """The overrides (as typed) that ask for a sweep; [] when there is none."""
    return [o.input_line or o.key_or_group for o in parse(overrides) if o.is_sweep_override()]


def _choices(o: Override) -> list[str]:
    if o.value_type == ValueType.GLOB_CHOICE_SWEEP or not o.is_discrete_sweep():
        kind = o.value_type.name.lower() if o.value_type else "sweep"
        raise ConfigError(f"{o.input_line!r} ({kind})",
                          "a list of values (a,b), range(start,stop[,step]) or choice(a,b): what "
                          "Hydra's basic sweeper supports",
                          f"list the values explicitly, e.g. {o.get_key_element()}=a,b")
    key = o.get_key_element()
    if _ENV_KEY.fullmatch(key):  # an env value is text: a swept bool is typed true/false, not True
        values = [f"{key}={str(v).lower() if isinstance(v, bool) else Transformer.str(v)}"
                  for v in o.sweep_iterator(transformer=Transformer.identity)]
    else:
        values = [f"{key}={v}" for v in o.sweep_string_iterator()]
    if not values:
        raise ConfigError(f"{o.input_line!r} sweeps over no value", "at least one value",
                          "check the range() bounds")
    return values


def expand(overrides: list[str], max_variants: int = MAX_VARIANTS) -> list[list[str]]:
    """Every variant's overrides. Without any sweep override: one variant, the overrides as given.

    As in Hydra, a later override of the same key replaces an earlier one.
    """
    axes: dict[str, list[str]] = {}
    for o in parse(overrides):
        if o.is_sweep_override():
            axes[o.get_key_element()] = _choices(o)
        else:
            # input_line is the override as typed (parse_overrides always sets it)
            axes[o.get_key_element()] = [o.input_line or f"{o.get_key_element()}={o.get_value_element_as_str()}"]
    count = 1
    for values in axes.values():
        count *= len(values)
    if count > max_variants:
        raise ConfigError(f"a sweep of {count} variants", f"at most {max_variants} (one job array)",
                          "sweep fewer values, or split the sweep into several submissions")
    return [list(v) for v in itertools.product(*axes.values())]
