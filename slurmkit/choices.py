"""Config fields that hold one of a fixed set of words, and the one check all of them get.

A config dataclass lists such fields in its ``CHOICES`` class attribute (field name -> the
allowed values) and calls :func:`check_choices` from ``__post_init__``, which
``OmegaConf.to_object`` runs when a config is composed, so ``parallel.strategy=bogus`` is
refused before anything is submitted, with the allowed values named. docs/config.md lists
every choice: tools/config_choices.py prints that table from the schema (choice_table).

The fields stay plain ``str`` rather than a ``(str, Enum)``: OmegaConf refuses a bool for an
Enum field, and ``supervisor.require_heartbeat=true`` on the command line is a bool; it looks
members up by name, and ``submit.emit``'s "" is no valid name; and on Python 3.11+ an f-string
of such a member reads ``Strategy.ddp``, so every rendered script, environment variable and
message would need ``.value`` to keep carrying the plain word.

A leaf module (it imports only slurmkit.errors): every package's config imports it.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Collection, Mapping
from typing import Any

from slurmkit.errors import ConfigError

#: field name -> the values it may hold
Choices = Mapping[str, tuple[str, ...]]


def _word(value: Any) -> str:
    """A value as typed in an override: "" as '' (``submit.emit=''``), a list as [a,b]."""
    if isinstance(value, (list, tuple)):
        return f"[{','.join(_word(v) for v in value)}]"
    return str(value) if value != "" else "''"


def _default(obj: Any, name: str) -> Any:
    for f in dataclasses.fields(obj):
        if f.name == name:
            return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    return None


def check_choices(section: str, obj: Any, choices: Choices, *, fold_case: Collection[str] = ()) -> None:
    """Refuse a choice field of ``obj`` whose value is not one of its allowed values.

    ``section`` names the config section in the message (``parallel``). A list field
    (topology.nic_kinds) has each element checked. A field in ``fold_case`` is compared, and
    stored, in lower case: a bool typed on the command line arrives there as "True".
    """
    for name, allowed in choices.items():
        value = getattr(obj, name)
        key = f"{section}.{name}"
        words = ", ".join(_word(v) for v in allowed)
        if isinstance(value, (list, tuple)):
            if any(v not in allowed for v in value):
                raise ConfigError(f"{key}={list(value)}", f"every entry of {key} is one of {words}",
                                  f"set {key}={_word(_default(obj, name))}, or list others of those values")
            continue
        if name in fold_case:
            value = str(value).lower()
        if value not in allowed:
            raise ConfigError(f"{key}={getattr(obj, name)!r}", f"{key} is one of {words}",
                              f"set {key}={_word(_default(obj, name))} (the default), or another of those values")
        if name in fold_case:
            setattr(obj, name, value)


def choice_table(root: type) -> list[tuple[str, str, tuple[str, ...]]]:
    """(key, default, allowed values) of every choice field under the config dataclass
    ``root``, in the schema's order, values as typed in an override: docs/config.md's table."""
    rows: list[tuple[str, str, tuple[str, ...]]] = []

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        own: Choices = getattr(cls, "CHOICES", {})
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            kind = hints[f.name]
            if isinstance(kind, type) and dataclasses.is_dataclass(kind):
                walk(kind, f"{prefix}{f.name}.")
            elif f.name in own:
                rows.append((f"{prefix}{f.name}", _word(_default(cls, f.name)),
                             tuple(_word(v) for v in own[f.name])))

    walk(root, "")
    return rows
