"""Secrets have no place in the config: job.env / cluster.env values, job.command, cluster.setup,
the container image and the store URIs are frozen into the run directory's config.yaml, and
most of them are written into the batch script, which slurmctld keeps (``scontrol write
batch_script``) and which whoever can read the shared file system may read.

A secret belongs in the submitting shell's environment (sbatch exports it to the job by
default) or in a file only its owner can read. This module recognises

- the usual names (``*SECRET*``, ``*TOKEN*``, ``*PASSWORD*``, ``DB_PASS``, ``*_KEY``,
  ``AWS_*KEY*``, ...), as env names and in ``NAME=value`` / ``--name=value`` tokens anywhere;
- the shapes of well-known keys (AWS, GitHub, Slack, Stripe, Google, JWTs, PEM keys, ...);
- credentials in URIs (``scheme://user:pass@host``, an empty user, a ``/`` in the password,
  credentials in a query) and in container images (``user:pass@registry#image``);
- a long random string right after a key-like word (``--api-key 3f9a...``);

and says which, never echoing the value itself. What is not a secret stays allowed: names that
name a file (``*_FILE``, ``*_PATH``), ``TOKENIZERS_PARALLELISM``, ``MAX_TOKENS``,
``PAD_TOKEN_ID``, paths, host names, NCCL settings, digests.

It lives in the config package (it was slurmkit.render.secrets): compose refuses a secret
read through a resolver before it is resolved, and render refuses one in what it writes;
render imports config, never the reverse.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator
from typing import Any

from slurmkit.errors import ConfigError

# Names: matched on the upper-cased name, after _BENIGN's parts are cut out of it.
_SECRET_NAMES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("a name with SECRET", re.compile(r"SECRET")),
    ("a name with TOKEN", re.compile(r"TOKEN")),
    ("a name with PASSWORD", re.compile(r"PASSWORD|PASSWD|PASSPHRASE|(?:^|_)PASS(?:_|$)|_PWD$")),
    ("a name with CREDENTIAL", re.compile(r"CREDENTIAL")),
    ("an AWS key name", re.compile(r"^AWS_.*KEY")),
    ("an API or private key name", re.compile(r"API_?KEY|PRIVATE_?KEY|ACCESS_?KEY")),
    ("a key name", re.compile(r"(?:^|_)KEYS?$|(?:ACCOUNT|STORAGE|ENCRYPTION|SIGNING|MASTER|LICENSE|"
                              r"CLIENT|SHARED|SESSION)_?KEY")),
    ("an authorization name", re.compile(r"AUTHORIZATION|(?:^|_)AUTH$|COOKIE")),
    ("a connection string name", re.compile(r"CONNECTION_?STRING|CONN_?STR|(?:^|_)DSN$")),
)
# Parts of a name that are not secrets: a tokenizer, token counts and ids, special tokens.
_BENIGN = re.compile(r"TOKENIZ[A-Z]*|TOKENS|(?:PAD|EOS|BOS|UNK|SEP|CLS|MASK|SPECIAL)_?TOKEN(?:_?IDS?)?"
                     r"|TOKEN_?IDS?")
# A name that names a file or socket holding the secret, not the secret
# (AWS_SHARED_CREDENTIALS_FILE, SSH_AUTH_SOCK): the value is still checked for key shapes.
_NAMES_A_PATH = re.compile(r"_(?:FILE|PATH|DIR|SOCK|SOCKET)$")

# Values: the shapes of keys that are secrets wherever they appear.
_SECRET_SHAPES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("an AWS access key id", re.compile(r"\b(?:AKIA|ASIA|ABIA|ACCA)[0-9A-Z]{16}\b")),
    ("a GitHub token", re.compile(r"\b(?:gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{30,})")),
    ("a GitLab token", re.compile(r"\bglpat-[A-Za-z0-9_-]{20,}")),
    ("a Slack token", re.compile(r"\bxox[abposr]-[A-Za-z0-9-]{10,}")),
    ("a Hugging Face token", re.compile(r"\bhf_[A-Za-z0-9]{30,}")),
    ("an OpenAI-style API key", re.compile(r"\bsk-(?:proj-)?[A-Za-z0-9_-]{20,}")),
    ("a Stripe key", re.compile(r"\b[rsp]k_(?:live|test)_[A-Za-z0-9]{10,}")),
    ("a Google API key", re.compile(r"\bAIza[0-9A-Za-z_-]{30,}")),
    ("a JSON Web Token", re.compile(r"\beyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}")),
    ("a bearer token", re.compile(r"(?i)\bbearer\s+[A-Za-z0-9._~+/-]{16,}")),
    ("a private key", re.compile(r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----")),
    ("an Azure storage key or signature",
     re.compile(r"(?i)\bAccountKey=[^;\s]{10,}|\bSharedAccessSignature=|[?&]sig=[^&\s]{10,}")),
    ("an AWS signed URL", re.compile(r"(?i)[?&]X-Amz-(?:Signature|Credential|Security-Token)=")),
    ("a credential in a URL query", re.compile(
        r"(?i)[?&](?:password|passwd|pwd|token|access_token|api_?key|secret|client_secret)=[^&\s]+")),
)

# scheme://user[:password]@ : the user may be empty, the password may hold '/' (an authority
# would end there, but a password with '/' pasted into a URI is exactly what is looked for).
_URL_USERINFO = re.compile(r"(?i)\b[a-z][a-z0-9+.-]*://([^\s/@:]*)(?::([^\s@]*))?@")
# A key-like word, then ':' '=' or blanks, then a long random-looking string.
_KEYWORD_VALUE = re.compile(
    r"(?i)(?<![a-z0-9])(?:api_?key|apikey|key|secret|token|passw(?:or)?d|pass|pwd|auth|credentials?|"
    r"signature)(?:[_-][a-z0-9]+)*[\"']?\s*[:=\s]\s*[\"']?([A-Za-z0-9+/_-]{32,}={0,2})(?![A-Za-z0-9+/=_-])")
# NAME=value in a shell line or an argument (at the start, or after a blank, ; & | ( ` " ').
_ASSIGNMENT = re.compile(r"(?<![^\s;&|(`\"'])([A-Za-z_][A-Za-z0-9_]*)=([^\s;&|)`]*)")
# --name=value (the value up to a blank)
_OPTION = re.compile(r"(?<!\S)--?([A-Za-z][A-Za-z0-9_-]*)=(\S*)")

FIX = ("remove it from the config; export it in the shell you submit from (sbatch passes that "
       "environment to the job) or have the job read it from a file only you can read")
REQUIREMENT = ("no secrets in the config: it is frozen into config.yaml and written into the batch "
               "script")


def secret_name(name: str) -> str | None:
    """Why ``name`` looks like the name of a secret, or None."""
    upper = name.upper().replace("-", "_")
    if _NAMES_A_PATH.search(upper):
        return None
    upper = _BENIGN.sub("", upper)
    return next((why for why, rx in _SECRET_NAMES if rx.search(upper)), None)


def _looks_random(text: str) -> bool:
    """A key rather than a word or a path: 32+ hex digits, or letters of both cases and digits
    (base64), not a path."""
    if re.fullmatch(r"[0-9a-fA-F]{32,}", text):
        return True
    if text.startswith(("/", "-", ".")) or text.count("/") > 3:
        return False
    return (len(text) >= 32 and any(c.isupper() for c in text) and any(c.islower() for c in text)
            and any(c.isdigit() for c in text))


def _url_credentials(text: str) -> str | None:
    for m in _URL_USERINFO.finditer(text):
        user, password = m.group(1), m.group(2)
        if password is None:
            if len(user) >= 20 and _looks_random(user):
                return "a token inside a URL"
            continue
        if password == "" or re.fullmatch(r"[0-9]+(?:/.*)?", password):
            continue  # no password, or host:port/path with an '@' further on
        return "a password inside a URL"
    return None


def secret_shape(value: str) -> str | None:
    """Which known key shape ``value`` holds, or None."""
    why = next((why for why, rx in _SECRET_SHAPES if rx.search(value)), None)
    if why:
        return why
    why = _url_credentials(value)
    if why:
        return why
    for m in _KEYWORD_VALUE.finditer(value):
        if _looks_random(m.group(1).rstrip("=")):
            return "a long random string after a key-like word"
    return None


def _literal(value: str) -> bool:
    """A value written out, not read at run time ($VAR, $(cat file)) nor empty."""
    value = value.strip("\"'")
    return bool(value) and not value.startswith("$")


def _plain_setting(value: str) -> bool:
    """A number or a boolean: the value of an option named like a secret but not one
    (``--key-bits=2048``, ``--auth=false``)."""
    value = value.strip("\"'").lower()
    return value in ("true", "false", "none", "null", "yes", "no", "0", "1") or bool(
        re.fullmatch(r"[0-9.]+", value))


def assigned_secrets(text: str) -> Iterator[str]:
    """Why each ``NAME=value`` / ``--name=value`` token in ``text`` sets a secret by its name."""
    for m in _ASSIGNMENT.finditer(text):
        why = secret_name(m.group(1))
        if why and _literal(m.group(2)):
            yield f"{m.group(1)}=... ({why})"
    for m in _OPTION.finditer(text):
        why = secret_name(m.group(1))
        if why and _literal(m.group(2)) and not _plain_setting(m.group(2)):
            yield f"--{m.group(1)}=... ({why})"


def _option_pairs(args: list[str]) -> Iterator[str]:
    """``--password VALUE`` as two list items (job.command)."""
    for opt, value in zip(args, args[1:]):
        if opt.startswith("-") and "=" not in opt and not value.startswith("-"):
            why = secret_name(opt.lstrip("-"))
            if why and _literal(value) and not _plain_setting(value):
                yield f"{opt} ... ({why})"


def _refuse(detected: str) -> ConfigError:
    return ConfigError(detected, REQUIREMENT, FIX)


def check_env_secrets(env: Iterable[tuple[str, str]]) -> None:
    """Refuse a job.env / cluster.env entry whose name or value is a secret."""
    for name, value in env:
        why = secret_name(name)
        if why:
            raise _refuse(f"environment variable {name} in job.env / cluster.env: {why}, "
                          "so it looks like a secret (value not shown)")
        why = secret_shape(value) or next(assigned_secrets(value), None)
        if why:
            raise _refuse(f"the value of environment variable {name} in job.env / cluster.env "
                          f"holds {why} (value not shown)")


def check_text_secrets(what: str, lines: Iterable[str], *, arguments: bool = False) -> None:
    """Refuse a secret in other rendered or frozen text (cluster.setup lines, job.command with
    ``arguments``: its items are one command's arguments, ``--password VALUE`` included)."""
    lines = list(lines)
    for line in lines:
        why = secret_shape(line) or next(assigned_secrets(line), None)
        if why:
            raise _refuse(f"{what} holds {why} (value not shown)")
    # one command's arguments: a key-like option and its value are two items
    why = (secret_shape(" ".join(lines)) or next(_option_pairs(lines), None)) if arguments else None
    if why:
        raise _refuse(f"{what} holds {why} (value not shown)")


def image_credentials(image: str) -> str | None:
    """Why a container image reference holds a credential, or None. pyxis/enroot read
    ``[docker://][USER[:PASSWORD]@][REGISTRY#]IMAGE[:TAG]``; ``IMAGE@sha256:...`` is a digest."""
    why = secret_shape(image)
    if why:
        return why
    ref = image.split("://", 1)[-1]
    user, at, rest = ref.partition("@")
    if not at or re.match(r"[a-z0-9]+:[0-9a-fA-F]{32,}", rest):
        return None
    if ":" in user and "#" not in user and "/" not in user.split(":", 1)[0]:
        return "a user and password before '@' (USER:PASSWORD@REGISTRY)"
    return None


def check_image_secrets(what: str, image: str | None) -> None:
    why = None if image is None else image_credentials(image)
    if why:
        raise _refuse(f"{what} holds {why} (value not shown)")


def config_strings(node: Any, path: str = "") -> Iterator[tuple[str, str]]:
    """(dotted key, value) of every string in a config: dataclasses, dicts, lists."""
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        for f in dataclasses.fields(node):
            yield from config_strings(getattr(node, f.name), f"{path}.{f.name}" if path else f.name)
    elif isinstance(node, dict):
        for k, v in node.items():
            yield from config_strings(v, f"{path}.{k}" if path else str(k))
    elif isinstance(node, (list, tuple)):
        for i, v in enumerate(node):
            yield from config_strings(v, f"{path}[{i}]")
    elif isinstance(node, str):
        yield path, node


def check_config_secrets(cfg: object) -> None:
    """Refuse a key shape or a credential in a URI in any string of the whole config (a data
    path, a model URI, a field added later): all of it is frozen into config.yaml."""
    for path, value in config_strings(cfg):
        why = secret_shape(value)
        if why:
            raise _refuse(f"{path} holds {why} (value not shown)")
