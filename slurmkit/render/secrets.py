"""Secrets have no place in job.env / cluster.env: those values are frozen into the run
directory's config.yaml and written into the batch script, both readable by whoever can read
the shared file system (and the script is kept by slurmctld, shown by `scontrol write batch_script`).

A secret belongs in the submitting shell's environment (sbatch exports it to the job by
default) or in a file only its owner can read. This module recognises the usual names
(``*SECRET*``, ``*TOKEN*``, ``*PASSWORD*``, ``AWS_*KEY*``, ...) and the shapes of well-known
keys, and says which, never echoing the value itself.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from slurmkit.errors import ConfigError

# Names: matched on the upper-cased variable name. TOKEN is a secret, TOKENIZERS_PARALLELISM
# (Hugging Face's switch, set in many training environments) is not.
_SECRET_NAMES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("a name with SECRET", re.compile(r"SECRET")),
    ("a name with TOKEN", re.compile(r"TOKEN(?!IZER)")),
    ("a name with PASSWORD", re.compile(r"PASSWORD|PASSWD")),
    ("a name with CREDENTIAL", re.compile(r"CREDENTIAL")),
    ("an AWS key name", re.compile(r"^AWS_.*KEY")),
    ("an API or private key name", re.compile(r"API_?KEY|PRIVATE_?KEY|ACCESS_?KEY")),
)

# Values: the shapes of keys that are secrets wherever they appear.
_SECRET_SHAPES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("an AWS access key id", re.compile(r"\b(?:AKIA|ASIA|ABIA|ACCA)[0-9A-Z]{16}\b")),
    ("a GitHub token", re.compile(r"\b(?:gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{30,})")),
    ("a GitLab token", re.compile(r"\bglpat-[A-Za-z0-9_-]{20,}")),
    ("a Slack token", re.compile(r"\bxox[abposr]-[A-Za-z0-9-]{10,}")),
    ("a Hugging Face token", re.compile(r"\bhf_[A-Za-z0-9]{30,}")),
    ("an OpenAI-style API key", re.compile(r"\bsk-(?:proj-)?[A-Za-z0-9_-]{20,}")),
    ("a private key", re.compile(r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----")),
    ("a password inside a URL", re.compile(r"://[^/\s:@]+:[^/\s@]+@")),
)

FIX = ("remove it from the config; export it in the shell you submit from (sbatch passes that "
       "environment to the job) or have the job read it from a file only you can read")


def secret_name(name: str) -> str | None:
    """Why ``name`` looks like the name of a secret, or None."""
    upper = name.upper()
    return next((why for why, rx in _SECRET_NAMES if rx.search(upper)), None)


def secret_shape(value: str) -> str | None:
    """Which known key shape ``value`` holds, or None."""
    return next((why for why, rx in _SECRET_SHAPES if rx.search(value)), None)


def check_env_secrets(env: Iterable[tuple[str, str]]) -> None:
    """Refuse a job.env / cluster.env entry whose name or value is a secret."""
    for name, value in env:
        why = secret_name(name)
        if why:
            raise ConfigError(f"environment variable {name} in job.env / cluster.env: {why}, "
                              "so it looks like a secret (value not shown)",
                              "no secrets in the config: it is frozen into config.yaml and "
                              "written into the batch script", FIX)
        why = secret_shape(value)
        if why:
            raise ConfigError(f"the value of environment variable {name} in job.env / cluster.env "
                              f"holds {why} (value not shown)",
                              "no secrets in the config: it is frozen into config.yaml and "
                              "written into the batch script", FIX)


def check_text_secrets(what: str, lines: Iterable[str]) -> None:
    """Refuse a known key shape in other rendered or frozen text (cluster.setup, job.command)."""
    for line in lines:
        why = secret_shape(line)
        if why:
            raise ConfigError(f"{what} holds {why} (value not shown)",
                              "no secrets in the config: it is frozen into config.yaml and "
                              "written into the batch script", FIX)
