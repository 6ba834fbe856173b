"""Compose conf/ with Hydra into a typed, validated SlurmkitConfig, and freeze it to YAML."""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import logging
import os
import re
import types
import typing
from collections.abc import Mapping
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from slurmkit.config.envtext import keep_env_text
from slurmkit.config.schema import SlurmkitConfig, drop_removed_keys
from slurmkit.config.secrets import FIX, config_strings, secret_name
from slurmkit.errors import ConfigError
from slurmkit.resources import packaged

log = logging.getLogger(__name__)

_REGISTERED = False
ROOT = "slurmkit_root"
# ${resolver:argument}: a resolver call (a plain ${a.b} interpolation has no ':')
_RESOLVER = re.compile(r"\$\{\s*([A-Za-z_][\w.]*)\s*:([^}]*)\}")
_ENV_RESOLVERS = ("oc.env", "env")


def _one_line(text: str) -> str:
    """A library's message quoting the user's text: on one line, non-printable characters
    (U+2028, a bidi override) escaped as ``slurmkit logs`` shows them."""
    text = text.replace("\n", " ")
    return "".join(c if c.isprintable() else f"\\u{ord(c):04x}" for c in text)


def conf_dirs(env: Mapping[str, str] | None = None) -> list[str]:
    """The conf directories in search order: a site's own ($SLURMKIT_CONF_DIR) overlays the one
    shipped in the package. A file the site has wins; the packaged ones fill in the rest, so a
    site adds `cluster/<site>.yaml` without copying the whole tree."""
    env = os.environ if env is None else env
    shipped = str(packaged("conf"))
    site = env.get("SLURMKIT_CONF_DIR")
    if not site:
        return [shipped]
    site = os.path.abspath(site)
    if not os.path.isdir(site):
        raise ConfigError(f"SLURMKIT_CONF_DIR={site!r}, which is not a directory",
                          "a directory of config files laid out like conf/ (cluster/, exp/, ...)",
                          "create it, or unset SLURMKIT_CONF_DIR to use the packaged configs")
    if any(c in site for c in "'\\") or not site.isprintable():
        raise ConfigError(f"SLURMKIT_CONF_DIR={site!r} holds a quote, backslash or control "
                          "character", "a plain path", "move the conf directory to a plain path")
    return [site, shipped] if site != shipped else [shipped]


def conf_dir(env: Mapping[str, str] | None = None) -> str:
    """The first conf directory searched (where a site's file wins)."""
    return conf_dirs(env)[0]


def register_configs() -> None:
    """Register the schema in Hydra's ConfigStore (explicitly, never at import time)."""
    global _REGISTERED
    if _REGISTERED:
        return
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="slurmkit_schema", node=SlurmkitConfig)
    # Hydra takes the primary config from the primary directory alone, before it extends the
    # search path, so a site directory without its own config.yaml could not be the primary.
    # This root names `config` as an ordinary default instead: Hydra then looks it up, and
    # every group option, along the whole search path, site directory first.
    ConfigStore.instance().store(name=ROOT, node={"defaults": ["config", "_self_"]})
    _REGISTERED = True


def _dirs(directory: str | None) -> list[str]:
    return [directory] if directory else conf_dirs()


def available(group: str, directory: str | None = None) -> list[str]:
    """Options of a config group, over every conf directory searched (or only ``directory``)."""
    names: set[str] = set()
    for d in _dirs(directory):
        g = os.path.join(d, group)
        if os.path.isdir(g):
            names.update(f[:-5] for f in os.listdir(g) if f.endswith(".yaml"))
    return sorted(names)


def _check_group_choices(overrides: list[str], dirs: list[str]) -> None:
    for ov in overrides:
        key, sep, value = ov.lstrip("+~").partition("=")
        if not sep or "." in key or not any(os.path.isdir(os.path.join(d, key)) for d in dirs):
            continue
        choices: set[str] = set()
        for d in dirs:
            choices.update(available(key, d))
        if value not in choices:
            where = " or ".join(os.path.join(d, key) for d in dirs)
            # The packaged directory is no place for a site's file (a reinstall loses it)
            add = (f"add {os.path.join(dirs[0], key, value)}.yaml" if len(dirs) > 1 else
                   f"write {key}/{value}.yaml in a directory of your own and point SLURMKIT_CONF_DIR at it "
                   "(searched before the packaged configs; docs/config.md)")
            raise ConfigError(
                f"{key}={value!r}, which is not in {where}",
                f"one of: {', '.join(sorted(choices))}",
                f"pick one of those, or {add}",
            )


def compose_dict(overrides: list[str], directory: str | None = None) -> Any:
    """Hydra-compose config.yaml with ``overrides`` over the conf directories (or only
    ``directory``); returns the raw DictConfig."""
    # Hydra only here: a node agent loads its frozen config with OmegaConf alone (load_frozen)
    # and so never pays Hydra's import (0.1 s of CPU per agent and allocation).
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException, MissingConfigException

    dirs = _dirs(directory)
    register_configs()
    _check_group_choices(overrides, dirs)
    overrides = keep_env_text(overrides)  # job.env.X=false stays "false", not "False"
    # The first directory is Hydra's primary config dir; the rest follow it on the search path.
    searchpath = [f"hydra.searchpath=[{','.join(repr('file://' + d) for d in dirs[1:])}]"] if dirs[1:] else []
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=dirs[0], version_base="1.3", job_name="slurmkit"):
            return hydra_compose(config_name=ROOT, overrides=[*searchpath, *overrides])
    except MissingConfigException as exc:
        raise ConfigError(str(exc).splitlines()[0], "an existing config option",
                          f"see the files under {' and '.join(dirs)}") from exc
    except (HydraException, OmegaConfBaseException) as exc:
        typed = type_error(exc, overrides) or unknown_override(exc, overrides)
        if typed is not None:
            raise typed from exc
        raise ConfigError(f"invalid configuration or override: {_one_line(str(exc))}",
                          "keys and values that the schema in slurmkit/config/schema.py defines",
                          "check the spelling of the override (key=value, +key=value to add)") from exc
    finally:
        GlobalHydra.instance().clear()


def to_typed(raw: Any) -> SlurmkitConfig:
    """DictConfig -> SlurmkitConfig, running every component's validation."""
    try:
        obj = OmegaConf.to_object(raw)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"invalid configuration: {_one_line(str(exc))}",
                          "values of the types the schema defines",
                          "fix the value named above") from exc
    if not isinstance(obj, SlurmkitConfig):
        raise ConfigError(f"config composed to {type(obj).__name__}", "a SlurmkitConfig",
                          "keep `slurmkit_schema` first in conf/config.yaml's defaults")
    return obj


def check_resolvers(raw: Any) -> None:
    """Refuse what OmegaConf would resolve into a secret before it is resolved.

    ``${oc.env:AWS_SECRET_ACCESS_KEY}`` anywhere is resolved by to_typed and then frozen into
    config.yaml (and, in job.env, written into the batch script) in clear; the value then
    looks like any random string, so the variable's name is checked here, on the unresolved
    text. job.env / cluster.env values are text for the script: no other resolver there."""
    try:
        tree = OmegaConf.to_container(raw, resolve=False)
    except OmegaConfBaseException:
        return  # to_typed reports it
    for path, text in config_strings(tree):
        for m in _RESOLVER.finditer(text):
            resolver, var = m.group(1), m.group(2).split(",", 1)[0].strip()
            if resolver in _ENV_RESOLVERS:
                why = secret_name(var) or ("a name made by another interpolation" if "$" in var else None)
                if why:
                    raise ConfigError(f"{path} reads the environment variable {var} through "
                                      f"${{{resolver}:...}}: {why}, so its value would be written "
                                      "in clear into config.yaml (and the batch script)",
                                      "no secrets in the config, not even resolved from the "
                                      "environment", FIX)
            elif path.startswith(("job.env.", "cluster.env.")):
                raise ConfigError(f"{path} holds the resolver ${{{resolver}:...}}",
                                  "job.env / cluster.env values are text written into the batch "
                                  "script; the only resolver there is ${oc.env:NAME} of a "
                                  "non-secret NAME", f"write the value itself in {path}")


def _dataclass_of(hint: Any) -> type | None:
    """The dataclass a field holds (``X`` or ``X | None``), else None."""
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        return hint
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        found = [a for a in typing.get_args(hint) if dataclasses.is_dataclass(a) and isinstance(a, type)]
        return found[0] if len(found) == 1 else None
    return None


def field_type(path: str, schema: type = SlurmkitConfig) -> str | None:
    """The schema's type of a dotted key, as written there (``int``, ``list[str]``), else None."""
    section: type | None = schema
    head, _, rest = path.partition(".")
    while section is not None:
        hints = typing.get_type_hints(section)
        if head not in hints:
            return None
        if not rest:
            hint = hints[head]
            return getattr(hint, "__name__", None) if isinstance(hint, type) else str(hint).replace("typing.", "")
        section = _dataclass_of(hints[head])
        head, _, rest = rest.partition(".")
    return None


#: How to write a value of a type on Hydra's command line ({k}: the key).
_WRITE = {"list": "a list in brackets: {k}=[a,b] (job.command=[python,train.py])",
          "dict": "a mapping in braces, {k}={{a:1}}, or one entry: +{k}.a=1",
          "int": "a whole number: {k}=20", "float": "a number: {k}=3e-4", "bool": "true or false: {k}=true"}


def type_error(exc: BaseException, overrides: list[str]) -> ConfigError | None:
    """A value of the wrong type (``train.steps=abc``, ``job.command=python train.py``) as a
    message that keeps OmegaConf's own words and says the type the schema expects."""
    cause: BaseException | None = exc
    while cause is not None and not (isinstance(cause, OmegaConfBaseException) and getattr(cause, "full_key", None)):
        cause = cause.__cause__ or cause.__context__
    if cause is None:
        return None
    key = str(getattr(cause, "full_key"))
    said = _one_line(str(cause).splitlines()[0]).rstrip(".")
    given = next((ov for ov in overrides if ov.lstrip("+~").partition("=")[0] == key), None)
    expected = field_type(key)
    if expected is None:
        return None
    how = next((w for t, w in _WRITE.items() if expected.startswith(t)), f"a value of type {expected}")
    return ConfigError(f"{given or key}: {said}", f"{key} is {expected} in the schema "
                       "(slurmkit/config/schema.py, docs/config.md)", f"give {key} {how.format(k=key)}")


def unknown_keys(tree: Mapping[str, Any], schema: type = SlurmkitConfig,
                 prefix: str = "") -> list[tuple[str, list[str]]]:
    """Every key of ``tree`` the schema does not define, as (its dotted path, the known names
    of its section). A section that is a dataclass is walked; a mapping field (``job.env``)
    holds any key."""
    hints = typing.get_type_hints(schema)
    names = [f.name for f in dataclasses.fields(schema)]  # type: ignore[arg-type]
    out: list[tuple[str, list[str]]] = []
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if key not in names:
            out.append((path, names))
            continue
        section = _dataclass_of(hints.get(key))
        if section is not None and isinstance(value, Mapping):
            out += unknown_keys(value, section, f"{path}.")
    return out


_COULD_NOT_OVERRIDE = re.compile(r"Could not override '([^']+)'")


def unknown_override(exc: BaseException, overrides: list[str]) -> ConfigError | None:
    """``train.lrr=1e-3`` (no ``+``): Hydra's own advice was to add it with ``+``, which the
    schema then refused; say at once what the schema has instead."""
    cause: BaseException | None = exc
    while cause is not None:
        m = _COULD_NOT_OVERRIDE.search(str(cause))
        if m:
            break
        cause = cause.__cause__ or cause.__context__
    if cause is None or m is None:
        return None
    path = m.group(1)
    section, _, _key = path.rpartition(".")
    names = _section_names(section)
    if names is None:
        return None
    return unknown_key_error(path, names, overrides)


def _section_names(section: str, schema: type = SlurmkitConfig) -> list[str] | None:
    """The field names of a dotted section of the schema ("" for the top), None if no section."""
    cls: type | None = schema
    for part in [p for p in section.split(".") if p]:
        hints = typing.get_type_hints(cls) if cls is not None else {}
        cls = _dataclass_of(hints.get(part))
        if cls is None:
            return None
    return [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]


def unknown_key_error(path: str, names: list[str], overrides: list[str]) -> ConfigError:
    section = path.rpartition(".")[0]
    known = [f"{section}.{n}" if section else n for n in names]
    close = difflib.get_close_matches(path, known, n=3, cutoff=0.6)
    given = next((ov for ov in overrides if ov.lstrip("+~").partition("=")[0] == path), None)
    where = f" (from the override {given})" if given else ""
    return ConfigError(
        f"{path}{where}, a key the schema does not define" + (f" (did you mean {' or '.join(close)}?)" if close else ""),
        f"a key of {section or 'the top level'}: {', '.join(names)}",
        f"write {close[0]}=..." if close else
        "fix the name (docs/config.md lists every key); a `+` adds only what the schema defines")


def check_known_keys(raw: Any, overrides: list[str]) -> None:
    """Refuse a key the schema does not define (``+train.stpes=20``, ``+optimizer=adamw``):
    Hydra adds it with ``+``, and the typed config would drop it without a word."""
    try:
        tree = OmegaConf.to_container(raw, resolve=False)
    except OmegaConfBaseException:
        return  # to_typed reports it
    if not isinstance(tree, Mapping):
        return
    found = unknown_keys(typing.cast(Mapping[str, Any], tree))
    if not found:
        return
    path, names = found[0]
    raise unknown_key_error(path, names, overrides)


def compose(overrides: list[str], directory: str | None = None) -> SlurmkitConfig:
    """Compose and validate: the one way to get a config from conf/ and command-line overrides."""
    raw = compose_dict(overrides, directory)
    check_resolvers(raw)
    check_known_keys(raw, overrides)
    return to_typed(raw)


def to_yaml(cfg: SlurmkitConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def config_hash(cfg: SlurmkitConfig) -> str:
    return hashlib.sha256(to_yaml(cfg).encode()).hexdigest()[:16]


def load_frozen(path: str) -> SlurmkitConfig:
    """Load a config frozen into a run directory (a requeued job runs exactly this)."""
    try:
        frozen = OmegaConf.load(path)
        if OmegaConf.select(frozen, "supervisor.enabled") is False:
            # Frozen before the key was retired: that run has always run supervised (nothing
            # read the key), so its requeue must not fail on it now.
            log.warning("%s sets the retired supervisor.enabled=false; ignored, as it always was", path)
            frozen.supervisor.enabled = None
        drop_removed_keys(frozen)  # e.g. topology.nccl_topo_file: never read, now gone
        raw = OmegaConf.merge(OmegaConf.structured(SlurmkitConfig), frozen)
    except (OSError, OmegaConfBaseException) as exc:
        raise ConfigError(f"cannot load the frozen config {path}: {exc}",
                          "the config.yaml that submit wrote into the run directory",
                          "resubmit the experiment") from exc
    return to_typed(raw)
