"""Hydra's own command-line flags on the verbs that compose a config (``submit``, ``plan``).

slurmkit composes its config with Hydra's compose API and never runs a Hydra application, so
Hydra's flags reached the override parser and failed there with a lexer error
(``LexerNoViableAltException: --cfg``). Here each one is either done the way a Hydra user
expects or refused with the reason and what to write instead:

- ``--cfg job|all`` (``-c``): print the composed config, as it would be frozen into the run
  directory, and submit nothing. ``--cfg hydra`` is refused: there is no Hydra job config.
- ``--info``: where configs are looked for, every group with its options, and what the
  defaults pick.
- ``--hydra-help``: what of Hydra applies (this text, in short).
- ``--config-dir/-cd``, ``--config-path/-cp``, ``--config-name/-cn``, ``--package/-p``,
  ``--run/-r``, ``--shell-completion/-sc``, ``--resolve``, ``--version``: refused, each with its
  slurmkit counterpart where there is one.
"""

from __future__ import annotations

import os

from rich.console import Console

from slurmkit.errors import ConfigError

#: The flags done here, by the name they are known as.
DONE = {"--cfg": "cfg", "-c": "cfg", "--info": "info", "--hydra-help": "hydra-help"}
#: Hydra's optional word after --info (all of them print the one page here).
INFO_WORDS = ("all", "config", "defaults", "defaults-tree", "plugins", "searchpath")
#: Hydra flags refused: what to do instead.
REFUSED = {
    "--config-dir": "set SLURMKIT_CONF_DIR=DIR: a site's conf directory overlays the packaged one",
    "-cd": "set SLURMKIT_CONF_DIR=DIR: a site's conf directory overlays the packaged one",
    "--config-path": "set SLURMKIT_CONF_DIR=DIR: a site's conf directory overlays the packaged one",
    "-cp": "set SLURMKIT_CONF_DIR=DIR: a site's conf directory overlays the packaged one",
    "--config-name": "pick an experiment with +exp=NAME (a file exp/NAME.yaml in a conf directory)",
    "-cn": "pick an experiment with +exp=NAME (a file exp/NAME.yaml in a conf directory)",
    "--package": "write the keys with their section (train.steps=20); --cfg job prints them all",
    "-p": "write the keys with their section (train.steps=20); --cfg job prints them all",
    "--run": "the verb itself runs (or submits) the job; drop the flag",
    "-r": "the verb itself runs (or submits) the job; drop the flag",
    "--shell-completion": "no shell completion yet: --info lists the groups and options",
    "-sc": "no shell completion yet: --info lists the groups and options",
    "--resolve": "--cfg job prints the config as it is frozen; interpolations are resolved at submit",
    "--version": "pip show slurmkit",
}
#: ``hydra.*`` overrides: slurmkit's key for the same wish, where there is one.
HYDRA_KEYS = {
    "hydra.run.dir": "submit.run_root=DIR (a run is DIR/<job.name>/<time stamp>)",
    "hydra.sweep.dir": "submit.run_root=DIR (a sweep is DIR/<job.name>/<time stamp>-sweep)",
    "hydra.job.name": "job.name=NAME",
    "hydra.searchpath": "SLURMKIT_CONF_DIR=DIR in the environment",
    "hydra.launcher": "-m with key=a,b: one Slurm job array per sweep (submit.array_parallelism=K)",
    "hydra.sweeper": "-m with key=a,b, range() or choice(): Hydra's basic sweeper grammar",
    "hydra/launcher": "-m with key=a,b: one Slurm job array per sweep (submit.array_parallelism=K)",
    "hydra/sweeper": "-m with key=a,b, range() or choice(): Hydra's basic sweeper grammar",
}

HYDRA_HELP = """\
slurmkit composes its config with Hydra: the override grammar (key=value, +key=value, ~key,
group=option, and with -m key=a,b, range(), choice()), config groups and interpolations are
Hydra's. It never runs a Hydra application, so Hydra's run directory, logging and launcher
settings (hydra.*) do not apply; the run directory is submit.run_root/<job.name>/<stamp>.

  --cfg job | -c job   print the composed config (what submit freezes) and exit
  --info               config search path, groups with their options, what the defaults pick
  SLURMKIT_CONF_DIR    a site's conf directory, searched before the packaged one
"""


def refuse_hydra_overrides(overrides: list[str]) -> None:
    """``hydra.run.dir=...`` and friends were composed and then silently ignored."""
    for ov in overrides:
        key = ov.lstrip("+~").partition("=")[0]
        if key == "hydra" or key.startswith(("hydra.", "hydra/")):
            instead = next((v for k, v in HYDRA_KEYS.items() if key == k or key.startswith((k + ".", k + "/"))),
                           "there is no counterpart: Hydra's own settings do not apply to a slurmkit run")
            raise ConfigError(f"the override {ov!r}, a setting of Hydra's application runner",
                              "slurmkit's own keys: it composes with Hydra but never runs a Hydra app "
                              "(slurmkit submit --hydra-help)", f"use {instead}")


def _split(argv: list[str]) -> tuple[dict[str, str | None], list[str]]:
    flags: dict[str, str | None] = {}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        name, eq, value = a.partition("=") if a.startswith("--") else (a, "", "")
        if name in REFUSED:
            raise ConfigError(f"Hydra's flag {name}", "what slurmkit's verbs take: overrides, -m, --cfg, "
                              "--info, --hydra-help", REFUSED[name])
        if name in DONE:
            takes = DONE[name] == "cfg" or (DONE[name] == "info" and i + 1 < len(argv)
                                            and argv[i + 1] in INFO_WORDS)
            if takes and not eq:
                value = argv[i + 1] if i + 1 < len(argv) else ""
                i += 1
            flags[DONE[name]] = value or None
        else:
            rest.append(a)
        i += 1
    return flags, rest


def handle(argv: list[str], console: Console) -> int | None:
    """Do the Hydra flag in ``argv``, if any, and return the exit code; None when there is none.

    Raises ConfigError for a refused flag (the caller prints it and exits 2)."""
    flags, rest = _split(argv)
    refuse_hydra_overrides(rest)
    if not flags:
        return None
    if "hydra-help" in flags:
        console.print(HYDRA_HELP, markup=False, highlight=False, end="")
        return 0
    if "info" in flags:
        console.print(info_text(), markup=False, highlight=False, end="")
        return 0
    which = flags.get("cfg")
    if which not in ("job", "all"):
        raise ConfigError(f"--cfg {which or '(no value)'}",
                          "--cfg job or --cfg all (the composed config; slurmkit has no Hydra job config)",
                          "write --cfg job")
    from slurmkit.config import compose, to_yaml

    console.print(to_yaml(compose(rest)), markup=False, highlight=False, end="")
    return 0


#: The sections whose keys ``--help`` lists (every key: ``--cfg job``, docs/config.md).
MAIN_SECTIONS = ("job", "train", "submit", "cluster")


def field_docs(cls: type) -> list[tuple[str, str, str]]:
    """(name, default, doc) of a config dataclass's fields, the doc being the comment on the
    field's line or the comment lines right above it (docs/config.md: "the comment on each
    field says what it means")."""
    import ast
    import dataclasses
    import inspect
    import textwrap

    try:
        lines = textwrap.dedent(inspect.getsource(cls)).splitlines()
    except (OSError, TypeError):
        return []
    defaults = {f.name: (f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default)
                for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    out = []
    for node in ast.parse("\n".join(lines)).body[0].body:  # type: ignore[attr-defined]
        if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
            continue
        name = node.target.id
        if name not in defaults:
            continue
        line = lines[node.lineno - 1]
        doc = line.split("#", 1)[1].strip() if "#" in line else ""
        above = node.lineno - 2
        block: list[str] = []
        while not doc and above >= 0 and lines[above].strip().startswith("#"):
            block.insert(0, lines[above].strip().lstrip("#").strip())
            above -= 1
        doc = doc or " ".join(block)
        default = defaults[name]
        out.append((name, "(no default)" if default is dataclasses.MISSING or default == "???" else repr(default),
                    doc))
    return out


def keys_text(sections: tuple[str, ...] = MAIN_SECTIONS) -> str:
    """The main sections' keys with their defaults and docs, for ``--help``."""
    import dataclasses
    import typing

    from slurmkit.config.schema import SlurmkitConfig

    hints = typing.get_type_hints(SlurmkitConfig)
    lines = ["Main keys (key=value on the command line; every key: --cfg job +exp=NAME, docs/config.md):"]
    for section in sections:
        cls = hints.get(section)
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            continue
        for name, default, doc in field_docs(cls):
            text = f"  {section}.{name} = {default}"
            lines.append(text + (f"    {doc[:110]}" if doc else ""))
    return "\n".join(lines) + "\n"


def info_text() -> str:
    from slurmkit.config.compose import available, conf_dirs

    dirs = conf_dirs()
    lines = ["Config search path (the first file found wins):"]
    lines += [f"  {d}" for d in dirs]
    groups = sorted({g for d in dirs for g in os.listdir(d) if os.path.isdir(os.path.join(d, g))
                     and not g.startswith(("_", "."))})
    lines += ["", "Config groups (group=option; +exp=NAME picks an experiment):"]
    width = max(map(len, groups), default=0)
    lines += [f"  {g:<{width}}  {', '.join(available(g))}" for g in groups]
    lines += ["", "Defaults: see config.yaml in the first directory above; `--cfg job +exp=NAME` prints "
              "every key with its value.", ""]
    return "\n".join(lines)
