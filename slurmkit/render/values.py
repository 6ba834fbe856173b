"""What a JobSpec may carry into a batch script: printable text, and Slurm names that are names.

Every value is quoted where it is rendered, but quoting is not enough for ``#SBATCH`` lines:
sbatch stops reading directives at the first line that is not one, so a newline inside a value
turns the rest of it into a shell command and silently drops every later directive
(``--requeue``, ``--signal``, ``--time``). And a partition named ``debug --qos=high`` or
``a'b`` is a config mistake, never a name Slurm knows: it is refused here, before anything is
written, with the name of the field that holds it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import TYPE_CHECKING

from slurmkit.errors import ConfigError
from slurmkit.slurm.timelimit import parse_time_limit

if TYPE_CHECKING:
    from slurmkit.render.jobspec import JobSpec

# One Slurm entity name (partition, account, qos, reservation, wckey, GRES type): what
# sacctmgr/scontrol create in practice. No whitespace, quotes, '=', '#', ':' (the GRES
# separator) or shell metacharacters.
NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]{0,127}")
NAME_RULE = ("a Slurm name: 1-128 characters of letters, digits, '_', '.', '+' or '-', starting "
             "with a letter, digit or '_' (no spaces, quotes, '=', '#', ':' or shell characters)")
# A node name in job.exclude (after hostlist expansion) and a --constraint expression (features
# joined by & | , with [] () * ! and counts): no spaces, quotes, '=', '#', ';' or '$'.
HOST_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,254}")
CONSTRAINT_RE = re.compile(r"[A-Za-z0-9_.+&|,\[\]()*!:-]{1,1024}")
# --switches=<count>[@<max-time>]
_SWITCHES_RE = re.compile(r"([0-9]{1,4})(?:@([0-9:-]+))?")


def unprintable(text: str, allow_tab: bool = False) -> str | None:
    """The first character of ``text`` that is not printable, as U+XXXX, or None.

    One rule for everything written into a script: ``str.isprintable()``. ASCII controls are
    not the only line breaks: Python's ``splitlines()`` (and some readers) also break on
    U+0085, U+2028 and U+2029, and bidi overrides (U+202E) make a line read otherwise than it
    runs; all of them fail ``isprintable()``."""
    for c in text:
        if not c.isprintable() and not (allow_tab and c == "\t"):
            return f"U+{ord(c):04X}"
    return None


def _fields(spec: JobSpec) -> Iterable[tuple[str, str | None]]:
    """Every string the templates (sbatch_templates/*.j2) and submitit's script render, by the
    config key a user would fix. cluster.setup is checked on its own (tabs allowed)."""
    yield "job.name", spec.name
    yield "run directory (submit.run_root)", spec.run_dir
    yield "cluster.partition", spec.partition
    yield "cluster.account", spec.account
    yield "cluster.qos", spec.qos
    yield "cluster.constraint", spec.constraint
    yield "cluster.gpu_type", spec.gpu_type
    yield "cluster.reservation", spec.reservation
    yield "cluster.wckey", spec.wckey
    yield "cluster.switches", spec.switches
    yield "cluster.container_image", spec.container_image
    yield "job.time", spec.time_limit
    yield "array (sweep)", spec.array
    for m in spec.container_mounts:
        yield "cluster.container_mounts", m
    for n in spec.exclude:
        yield "job.exclude", n
    for a in spec.srun_args:
        yield "srun arguments", a
    for k, v in spec.env:
        yield f"environment variable {k} (job.env / cluster.env)", k
        yield f"environment variable {k} (job.env / cluster.env)", v
    yield "the config digest", spec.config_sha256


def refuse_unprintable(what: str, value: str | None, allow_tab: bool = False, show: bool = True) -> None:
    """Refuse ``value`` (the config key ``what``) unless every character is printable.
    ``show`` False: an environment value, which may be a secret, is not quoted."""
    bad = None if value is None else unprintable(value, allow_tab)
    if bad is not None:
        shown = repr(value) if show else "(value not shown)"
        raise ConfigError(f"{what} {shown} holds a control character or other non-printable "
                          f"character ({bad})",
                          "printable text only (str.isprintable()): it reaches the batch script "
                          "or the job's config, where a line separator such as U+2028 or U+0085 "
                          "starts a new line and a bidi override hides what runs",
                          f"remove the newline, line separator or control character from {what}")


def check_printable(spec: JobSpec, more: Iterable[tuple[str, str | None]] = ()) -> None:
    """Refuse a non-printable character anywhere in what the batch script carries (and in
    ``more``: other values that reach the job, by config key)."""
    for what, value in _fields(spec):
        refuse_unprintable(what, value, show=not what.startswith("environment variable"))
    for what, value in more:  # not on a script line of their own: a tab does no harm
        refuse_unprintable(what, value, allow_tab=True)
    for line in spec.setup:
        bad = unprintable(line, allow_tab=True)
        if bad is not None:
            raise ConfigError(f"cluster.setup line {line!r} holds a control character or other "
                              f"non-printable character ({bad})",
                              "one shell line per list item, printable text only",
                              "split it into separate cluster.setup items")


def _check_name(what: str, value: str | None, allow_list: bool = False) -> None:
    if value is None:
        return
    parts = value.split(",") if allow_list else [value]
    if not all(NAME_RE.fullmatch(p) for p in parts):
        rule = NAME_RULE + (", or a comma-separated list of them" if allow_list else "")
        raise ConfigError(f"{what}={value!r} is not a Slurm name", rule,
                          f"set {what} to the name `sinfo -s` / `sacctmgr show assoc user=$USER` "
                          "lists, or remove it")


def check_slurm_names(spec: JobSpec) -> None:
    """Partition, account, qos, reservation, wckey and GRES type must be plain Slurm names;
    constraint, excluded nodes and switches must have their Slurm shapes.
    (job.name is checked by the schema with a stricter rule: it also names a directory.)"""
    _check_name("cluster.partition", spec.partition, allow_list=True)  # sbatch takes a,b
    _check_name("cluster.account", spec.account)
    _check_name("cluster.qos", spec.qos)
    _check_name("cluster.gpu_type", spec.gpu_type)
    _check_name("cluster.reservation", spec.reservation, allow_list=True)
    _check_name("cluster.wckey", spec.wckey)
    if spec.constraint is not None and not CONSTRAINT_RE.fullmatch(spec.constraint):
        raise ConfigError(f"cluster.constraint={spec.constraint!r} is not a Slurm constraint",
                          "node features joined by '&', '|' or ',' (with [], (), '*' counts, '!'): "
                          "letters, digits, '_', '.', '+', '-' and those operators only",
                          "set cluster.constraint to features `sinfo -o %f` lists, e.g. h100&ib")
    for host in spec.exclude:
        if not HOST_RE.fullmatch(host):
            raise ConfigError(f"job.exclude names {host!r}, which is not a node name",
                              "node names or hostlist expressions such as gpu[001-004]",
                              "list the nodes as `sinfo -N` names them")
    if spec.switches is not None:
        m = _SWITCHES_RE.fullmatch(spec.switches)
        ok = m is not None
        if m is not None and m.group(2) is not None:
            try:
                ok = parse_time_limit(m.group(2)) is not None
            except ConfigError:
                ok = False
        if not ok:
            raise ConfigError(f"cluster.switches={spec.switches!r}",
                              "Slurm's --switches value: <count>[@<max-time>], e.g. 1 or 2@01:00:00",
                              "set cluster.switches=1@01:00:00 or remove it")
