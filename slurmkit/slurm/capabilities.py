"""What this Slurm site can do, probed once and cached: the job uses what the site has.

A production site runs Slurm 23.02-25.11 with its own choices (cgroups or not, requeue allowed or
not, pyxis or not); the local test cluster is 22.05 with proctrack/linuxproc. Rather than assume
either, :func:`probe` asks the site with a few cheap commands (``scontrol show config``,
``scontrol show node``, ``squeue --json --me``, and the local ``sacct --helpformat`` and
``srun --help``) and returns a frozen :class:`SiteCapabilities`. Every value Slurm prints is
untrusted text: what cannot be read or understood becomes None ("unknown") and a line in
``problems``, never an exception.

The result is cached per user (:func:`site_capabilities`; JSON, 0600, one hour) and written into
the run directory at submit (``capabilities.json``) so node 0's agent can read the copy instead
of asking the controller again (:func:`read_run_dir_copy`). A cached or copied file that is a
link, another user's, writable by others, or not what this module writes is ignored.

Facts the fields rest on (Slurm documentation and SchedMD's own tests):

* ``--requeue=expedite`` (sbatch) exists from Slurm 25.11 and only works where the admin set
  ``SlurmctldParameters=enable_expedited_requeue``; SchedMD's test suite submits it with exactly
  that spelling and notes that a submission is rejected where it is not enabled.
* Before 26.05 a requeued job is not eligible for about 121 s (credential lifetime + 1 s);
  ``requeue_delay=<s>`` makes the hold tunable where the site sets it.
* ``sacct`` has the field ``FailedNode`` from 23.02; ``--json`` output exists from 21.08 when the
  site installed the data_parser/openapi plugins (Debian's 22.05 has them: probe, not assume).
* ``PreemptParameters=send_user_signal`` sends the job's ``--signal`` at preemption time.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import logging
import os
import re
import stat
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from slurmkit.atomic import atomic_write
from slurmkit.runfiles import CAPABILITIES_NAME
from slurmkit.slurm.client import SlurmClient
from slurmkit.slurm.errors import SlurmCommandError, SlurmError
from slurmkit.slurm.retry import Disposition, RetryPolicy, classify
from slurmkit.slurm.runner import CommandRunner
from slurmkit.untrusted import parse_json

log = logging.getLogger(__name__)

SCHEMA = 1
CACHE_TTL_S = 3600.0
CACHE_FILE_MODE = 0o600
RUN_DIR_FILE_MODE = 0o644  # as config.yaml and layout.json: the job's user alone writes it
_MAX_FILE_BYTES = 256 * 1024
_PROBE_TIMEOUT_S = 15.0
_NULL = {"", "(null)", "null", "none", "n/a", "(null type)"}
_VERSION = re.compile(r"\b(\d{1,3})\.(\d{1,2})(?:\.(\d{1,3}))?\b")
#: sbatch's spelling of expedited requeue, and the first release that has it.
EXPEDITE_ARG = "--requeue=expedite"
EXPEDITE_SINCE = (25, 11)
FAILED_NODE_SINCE = (23, 2)


@dataclass(frozen=True)
class SiteCapabilities:
    """One probe of one site. None means unknown (not asked, not answered, not understood).

    Attributes:
        probed_at: epoch seconds of the probe.
        slurm_conf: the SLURM_CONF the probe ran with (None: Slurm's default / configless).
        version: e.g. "22.05.8".
        json_output: ``squeue --json`` works (the data_parser/openapi plugins are installed).
        failed_node_field: ``sacct`` knows the field ``FailedNode``.
        job_requeue: ``JobRequeue``: the site's default for batch jobs (sbatch --requeue or
            --no-requeue overrides it).
        expedited_requeue: Slurm >= 25.11 and ``enable_expedited_requeue`` set by the admin.
        requeue_delay_s: the admin's ``requeue_delay`` in seconds; None where not set.
        requeue_setup_env_fail: ``SchedulerParameters=requeue_setup_env_fail``.
        kill_wait_s / unkillable_step_timeout_s: ``KillWait`` / ``UnkillableStepTimeout``, seconds.
        proctrack: the ``ProctrackType`` plugin without its prefix ("cgroup", "linuxproc").
        task_plugins: ``TaskPlugin`` entries without prefix ("affinity", "cgroup").
        prolog_flags: ``PrologFlags`` entries, lower case ("alloc", "contain").
        stepmgr: ``SlurmctldParameters=enable_stepmgr`` (step management on the batch host).
        send_user_signal: ``PreemptParameters=send_user_signal``.
        preempt_mode: ``PreemptMode`` ("OFF", "REQUEUE", ...).
        pyxis: "present", "absent" or "unknown" (the spank plugin that adds --container-image).
        gres: distinct node GRES as name or name:type ("gpu", "gpu:h100"), sorted.
        typed_gres: some node GRES has a type (gpu:h100:8); False where all are untyped.
        problems: what could not be probed and why, one line each.
    """

    probed_at: float
    slurm_conf: str | None = None
    cluster_name: str | None = None
    version: str | None = None
    json_output: bool | None = None
    failed_node_field: bool | None = None
    job_requeue: bool | None = None
    expedited_requeue: bool | None = None
    requeue_delay_s: int | None = None
    requeue_setup_env_fail: bool | None = None
    kill_wait_s: int | None = None
    unkillable_step_timeout_s: int | None = None
    proctrack: str | None = None
    task_plugins: tuple[str, ...] | None = None
    prolog_flags: tuple[str, ...] | None = None
    stepmgr: bool | None = None
    send_user_signal: bool | None = None
    preempt_mode: str | None = None
    pyxis: str = "unknown"
    gres: tuple[str, ...] | None = None
    typed_gres: bool | None = None
    problems: tuple[str, ...] = ()

    @property
    def version_tuple(self) -> tuple[int, int, int] | None:
        return parse_version(self.version)

    def at_least(self, release: tuple[int, int]) -> bool | None:
        """True when the site's Slurm is ``release`` (major, minor) or newer; None if unknown."""
        v = self.version_tuple
        return None if v is None else v[:2] >= release

    @property
    def json_accounting(self) -> bool:
        """Read sacct as JSON: ``--json`` works and the site runs 23.02 or later. 22.05's
        data_parser v0.0.38 reports a failed step's exit code as success (on the local
        cluster: step 3.batch FAILED, text ExitCode 9:0, JSON return_code 0), so there the
        text columns stay the source."""
        return bool(self.json_output) and bool(self.at_least((23, 2)))

    @property
    def requeue_arg(self) -> str:
        """The sbatch argument that asks for requeue on this site: ``--requeue=expedite`` only
        where the probe found it enabled (elsewhere sbatch rejects it), else ``--requeue``."""
        return EXPEDITE_ARG if self.expedited_requeue else "--requeue"

    def to_dict(self) -> dict[str, Any]:
        return {"schema": SCHEMA, **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, data: object) -> SiteCapabilities:
        """Rebuild from :meth:`to_dict`; raises ValueError on anything else (untrusted input)."""
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            raise ValueError("not a capabilities record of schema %d" % SCHEMA)
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name not in data:
                raise ValueError(f"missing field {f.name}")
            values[f.name] = _checked(f.name, str(f.type), data[f.name])
        if values["pyxis"] not in ("present", "absent", "unknown"):
            raise ValueError(f"pyxis is {values['pyxis']!r}")
        return cls(**values)


def _checked(name: str, type_text: str, value: object) -> object:
    """``value`` if it has the field's declared type (from the annotation text), else ValueError."""
    optional = "None" in type_text
    if value is None:
        if optional:
            return None
        raise ValueError(f"{name} is null")
    if "tuple" in type_text:
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"{name} is not a list of strings")
        return tuple(value)
    checks: list[tuple[str, Callable[[object], bool]]] = [
        ("bool", lambda v: isinstance(v, bool)),
        ("int", lambda v: isinstance(v, int) and not isinstance(v, bool)),
        ("float", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)),
        ("str", lambda v: isinstance(v, str)),
    ]
    for word, ok in checks:
        if type_text.startswith(word):
            if not ok(value):
                raise ValueError(f"{name} is not a {word}")
            return float(value) if word == "float" else value  # type: ignore[arg-type]
    raise ValueError(f"{name}: unexpected declared type {type_text}")


# --- parsing untrusted text ---------------------------------------------------------------------

def parse_version(text: str | None) -> tuple[int, int, int] | None:
    """"22.05.8", "slurm-wlm 22.05.8", "slurm 25.11.0-0rc1" -> (22, 5, 8); None if no version."""
    m = _VERSION.search(text or "")
    if not m:
        return None
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def config_value(config: Mapping[str, str], key: str) -> str | None:
    """A ``scontrol show config`` value, None for Slurm's spellings of "not set"."""
    value = config.get(key)
    if value is None or value.strip().lower() in _NULL:
        return None
    return value.strip()


def parse_params(text: str | None) -> dict[str, str | None]:
    """A comma-separated parameter list ("enable_stepmgr,requeue_delay=5") -> {name: value}.

    Names are lower case; a bare name maps to None.
    """
    out: dict[str, str | None] = {}
    for item in (text or "").split(","):
        name, eq, value = item.strip().partition("=")
        if name and name.lower() not in _NULL:
            out[name.lower()] = value.strip() if eq else None
    return out


def _seconds(text: str | None) -> int | None:
    m = re.match(r"^\s*(\d{1,9})\s*(sec|secs|s)?\s*$", text or "")
    return int(m.group(1)) if m else None


def _flag(text: str | None) -> bool | None:
    if text is None:
        return None
    value = text.strip().lower()
    if value in ("1", "yes", "true"):
        return True
    if value in ("0", "no", "false"):
        return False
    return None


def _plugins(text: str | None, prefix: str) -> tuple[str, ...] | None:
    if text is None:
        return None
    names = (p.strip().removeprefix(prefix).strip() for p in text.split(","))
    return tuple(n for n in names if n)


def parse_gres(values: list[str | None]) -> tuple[tuple[str, ...], bool]:
    """Node Gres strings ("gpu:h100:8(S:0-1),nic:2", "gpu:4") -> (sorted distinct "name" or
    "name:type", whether any has a type)."""
    found: set[str] = set()
    typed = False
    for value in values:
        for item in re.sub(r"\([^)]*\)", "", value or "").split(","):
            parts = [p for p in item.strip().split(":") if p]
            if not parts or parts[0].lower() in _NULL or not re.fullmatch(r"[\w.-]+", parts[0]):
                continue
            if parts[-1].isdigit():
                parts = parts[:-1]  # the count
            if len(parts) >= 2:
                typed = True
                found.add(f"{parts[0]}:{parts[1]}")
            else:
                found.add(parts[0])
    return tuple(sorted(found)), typed


def from_config(config: Mapping[str, str], *, probed_at: float, slurm_conf: str | None = None,
                version: str | None = None) -> SiteCapabilities:
    """Everything ``scontrol show config`` says (a pure function of its parsed text; {} when
    it did not answer). ``version`` is used where the config names none."""
    ctld = parse_params(config_value(config, "SlurmctldParameters"))
    sched = parse_params(config_value(config, "SchedulerParameters"))
    preempt = parse_params(config_value(config, "PreemptParameters"))
    v = parse_version(config_value(config, "SLURM_VERSION")) or parse_version(version)
    # SchedMD documents enable_expedited_requeue under SlurmctldParameters; AWS PCS's notes put
    # it under SchedulerParameters: either counts.
    asked = "enable_expedited_requeue" in ctld or "enable_expedited_requeue" in sched
    expedite: bool | None = None
    if v is not None and (config or v[:2] < EXPEDITE_SINCE):
        expedite = v[:2] >= EXPEDITE_SINCE and asked
    delay = ctld.get("requeue_delay") or sched.get("requeue_delay")
    proctrack = config_value(config, "ProctrackType")
    flags = _plugins(config_value(config, "PrologFlags"), "")
    if flags is None and "PrologFlags" in config:
        flags = ()  # shown and (null): no flags
    return SiteCapabilities(
        probed_at=probed_at, slurm_conf=slurm_conf or config_value(config, "SLURM_CONF"),
        cluster_name=config_value(config, "ClusterName"),
        version=f"{v[0]}.{v[1]:02d}.{v[2]}" if v else None,
        failed_node_field=None if v is None else v[:2] >= FAILED_NODE_SINCE,
        job_requeue=_flag(config_value(config, "JobRequeue")),
        expedited_requeue=expedite,
        requeue_delay_s=_seconds(delay),
        requeue_setup_env_fail="requeue_setup_env_fail" in sched if config else None,
        kill_wait_s=_seconds(config_value(config, "KillWait")),
        unkillable_step_timeout_s=_seconds(config_value(config, "UnkillableStepTimeout")),
        proctrack=proctrack.removeprefix("proctrack/") if proctrack else None,
        # 24.11 prints task/none as "(null)": with a config read, no value is no task plugin
        task_plugins=_plugins(config_value(config, "TaskPlugin") or ("task/none" if "TaskPlugin" in config else None),
                              "task/"),
        prolog_flags=tuple(f.lower() for f in flags) if flags is not None else None,
        stepmgr="enable_stepmgr" in ctld if config else None,
        send_user_signal="send_user_signal" in preempt if config else None,
        preempt_mode=config_value(config, "PreemptMode"),
    )


# --- probing --------------------------------------------------------------------------------

def _fails_to_reach(exc: SlurmError) -> bool:
    """The command did not get an answer from the controller (as opposed to refusing the request)."""
    if not isinstance(exc, SlurmCommandError):
        return True  # not installed: nothing can be said about the site
    return classify(exc) in (Disposition.NOT_DELIVERED, Disposition.AMBIGUOUS)


def _json_output(runner: CommandRunner, problems: list[str]) -> tuple[bool | None, str | None]:
    """Whether ``squeue --json --me`` answers JSON (O(the user's jobs) on the controller), and
    the version its ``meta`` names."""
    try:
        out = runner.run(["squeue", "--json", "--me"], timeout_s=_PROBE_TIMEOUT_S).stdout
    except SlurmError as exc:
        if _fails_to_reach(exc):
            problems.append(f"squeue --json: {exc}")
            return None, None
        return False, None  # an unknown option or a missing plugin: no JSON here
    try:
        data = json.loads(out)
    except ValueError:
        return False, None
    meta = data.get("meta") if isinstance(data, dict) else None
    slurm = None
    if isinstance(meta, dict):
        slurm = next((v for k, v in meta.items() if k.lower() == "slurm" and isinstance(v, dict)), None)
    release = slurm.get("release") if slurm else None
    return isinstance(data, dict), release if isinstance(release, str) else None


def _failed_node_field(runner: CommandRunner) -> bool | None:
    """``sacct --helpformat`` (local, no controller) lists FailedNode; None if sacct fails."""
    try:
        out = runner.run(["sacct", "--helpformat"], timeout_s=_PROBE_TIMEOUT_S).stdout
    except SlurmError:
        return None
    return "failednode" in out.lower().split()


def _plugstack_files(path: str, depth: int = 0, seen: set[str] | None = None) -> list[str] | None:
    """The plugstack file and the files its ``include`` lines name; None if one cannot be read."""
    seen = set() if seen is None else seen
    if depth > 3 or path in seen or len(seen) > 64:
        return []
    seen.add(path)
    try:
        with open(path, errors="replace") as f:
            text = f.read(_MAX_FILE_BYTES)
    except FileNotFoundError:
        return []
    except OSError:
        return None
    texts = [text]
    for line in text.splitlines():
        words = line.split("#", 1)[0].split()
        if len(words) >= 2 and words[0].lower() == "include":
            for inc in sorted(glob.glob(words[1]))[:64]:
                more = _plugstack_files(inc, depth + 1, seen)
                if more is None:
                    return None
                texts += more
    return texts


def _pyxis(runner: CommandRunner, config: Mapping[str, str], slurm_conf: str | None) -> str:
    """"present" when srun offers pyxis's --container-image or the plugstack names pyxis;
    "absent" when the plugstack was read (or missing) and names no pyxis; else "unknown"."""
    try:
        if "--container-image" in runner.run(["srun", "--help"], timeout_s=_PROBE_TIMEOUT_S).stdout:
            return "present"
    except SlurmError:
        pass
    path = config_value(config, "PlugStackConfig")
    if path is None:
        conf = slurm_conf or config_value(config, "SLURM_CONF")
        if not conf:
            return "unknown"
        path = os.path.join(os.path.dirname(conf), "plugstack.conf")  # Slurm's default place
    texts = _plugstack_files(path)
    if texts is None:
        return "unknown"
    # plugstack.conf(5): "required|optional <plugin path> [args]"; pyxis is spank_pyxis.so
    plugins = [words[1] for t in texts for ln in t.splitlines()
               if len(words := ln.split("#", 1)[0].split()) >= 2
               and words[0].lower() in ("required", "optional")]
    return "present" if any("pyxis" in os.path.basename(p).lower() for p in plugins) else "absent"


def _step(problems: list[str], what: str, fn: Callable[[], Any], default: Any = None) -> Any:
    """``fn()``, or ``default`` with a line in ``problems``: one probe that fails (a command, or
    text no parser expected) must not cost the others."""
    try:
        return fn()
    except Exception as exc:
        problems.append(f"{what}: {exc}"[:300])
        return default


def probe(runner: CommandRunner, *, slurm_conf: str | None = None,
          clock: Callable[[], float] = time.time) -> SiteCapabilities:
    """Ask the site what it has. Never raises for what Slurm prints or fails to print.

    ``runner`` runs the commands (tried once each: a probe must not keep a submission waiting on
    a busy controller); ``slurm_conf`` is the SLURM_CONF they run with (where plugstack.conf
    is looked for when the config does not name it).
    """
    client = SlurmClient(runner, retry=RetryPolicy(max_attempts=1), timeout_s=_PROBE_TIMEOUT_S)
    problems: list[str] = []
    config: dict[str, str] = _step(problems, "scontrol show config", client.config, {})
    version = config_value(config, "SLURM_VERSION")
    json_ok: bool | None = None
    gres: tuple[tuple[str, ...], bool] | None = None
    if config:  # the controller answered: worth two more questions
        json_ok, release = _step(problems, "squeue --json", lambda: _json_output(runner, problems),
                                 (None, None))
        version = version or release
        gres = _step(problems, "scontrol show node",
                     lambda: parse_gres([n.gres for n in client.nodes()]))
    if parse_version(version) is None:
        version = _step(problems, "scontrol --version", lambda: runner.run(
            ["scontrol", "--version"], timeout_s=_PROBE_TIMEOUT_S).stdout)
    caps = from_config(config, probed_at=clock(), slurm_conf=slurm_conf, version=version)
    listed = _step(problems, "sacct --helpformat", lambda: _failed_node_field(runner))
    return dataclasses.replace(
        caps, json_output=json_ok,
        failed_node_field=caps.failed_node_field if listed is None else listed,
        gres=gres[0] if gres else None, typed_gres=gres[1] if gres else None,
        pyxis=_step(problems, "pyxis", lambda: _pyxis(runner, config, slurm_conf), "unknown"),
        problems=tuple(p[:300] for p in problems))


# --- the cache and the run directory's copy -------------------------------------------------

def cache_path(env: Mapping[str, str]) -> str | None:
    """The per-user cache file for the site that ``env``'s SLURM_CONF names; None without a home.

    ``SLURMKIT_CACHE_DIR`` overrides the directory (else ``$XDG_CACHE_HOME/slurmkit`` or
    ``~/.cache/slurmkit``).
    """
    base = env.get("SLURMKIT_CACHE_DIR")
    if not base:
        root = env.get("XDG_CACHE_HOME") or (os.path.join(env["HOME"], ".cache") if env.get("HOME") else "")
        if not root:
            return None
        base = os.path.join(root, "slurmkit")
    conf = env.get("SLURM_CONF")
    key = hashlib.sha256(os.path.abspath(conf).encode() if conf else b"<default>").hexdigest()[:16]
    return os.path.join(base, f"site-{key}.json")


def read_capabilities(path: str, *, now: float, max_age_s: float | None,
                      uid: int | None = None) -> SiteCapabilities | None:
    """The record at ``path`` if it can be trusted and is fresh enough, else None (logged why).

    Trusted: a regular file (not a link), owned by ``uid`` (default: this process's user), not
    writable by group or others, at most 256 KiB of what :meth:`SiteCapabilities.to_dict` writes.
    ``max_age_s`` None accepts any age (a run directory's copy is the job's own record).
    """
    uid = os.getuid() if uid is None else uid
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        log.info("site capabilities: not reading %s: %s", path, exc.strerror or exc)
        return None
    try:
        st = os.fstat(fd)
        why = None
        if not stat.S_ISREG(st.st_mode):
            why = "not a regular file"
        elif st.st_uid != uid:
            why = f"owned by uid {st.st_uid}, not {uid}"
        elif st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            why = "writable by group or others"
        elif st.st_size > _MAX_FILE_BYTES:
            why = "too large"
        if why:
            log.warning("site capabilities: ignoring %s: %s", path, why)
            return None
        with os.fdopen(os.dup(fd), "rb") as f:
            raw = f.read(_MAX_FILE_BYTES + 1)
    finally:
        os.close(fd)
    try:
        # within limits (UntrustedDataError is a ValueError): deep nesting or a 5,000-digit number
        # in the run directory's copy must not crash node 0's agent
        caps = SiteCapabilities.from_dict(parse_json(raw, max_bytes=_MAX_FILE_BYTES))
    except (ValueError, TypeError) as exc:
        log.warning("site capabilities: ignoring %s: %s", path, exc)
        return None
    age = now - caps.probed_at
    if age < -60 or (max_age_s is not None and age > max_age_s):
        log.info("site capabilities: %s is %.0f s old, probing again", path, age)
        return None
    return caps


def _private_dir(path: str, uid: int) -> bool:
    """Create ``path`` 0700 if missing; True when it is a real directory of ``uid`` that no one
    else can write (else nothing is written into it)."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.lstat(path)
    except OSError as exc:
        log.info("site capabilities: cannot use %s: %s", path, exc.strerror or exc)
        return False
    ok = (stat.S_ISDIR(st.st_mode) and st.st_uid == uid
          and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH))
    if not ok:
        log.warning("site capabilities: not writing into %s: a link, another user's or writable "
                    "by others", path)
    return ok


def write_capabilities(path: str, caps: SiteCapabilities, mode: int = CACHE_FILE_MODE) -> None:
    """Write ``caps`` to ``path`` atomically (new temp file, fsync, rename), mode ``mode``
    whatever the umask. Raises OSError; callers treat a failed write as no cache."""
    atomic_write(path, json.dumps(caps.to_dict(), indent=1, sort_keys=True) + "\n", mode=mode)


def site_capabilities(env: Mapping[str, str], *, runner: CommandRunner | None = None,
                      clock: Callable[[], float] = time.time, ttl_s: float = CACHE_TTL_S,
                      refresh: bool = False) -> SiteCapabilities:
    """The site's capabilities: the user's cached probe when under ``ttl_s`` old, else a new
    probe (then cached). ``runner`` defaults to the real Slurm commands with ``env``."""
    path = cache_path(env)
    if path and not refresh:
        cached = read_capabilities(path, now=clock(), max_age_s=ttl_s)
        if cached is not None:
            return cached
    if runner is None:
        from slurmkit.slurm.runner import SubprocessRunner

        runner = SubprocessRunner(env=env)
    caps = probe(runner, slurm_conf=env.get("SLURM_CONF"), clock=clock)
    if path and caps.version is not None and _private_dir(os.path.dirname(path), os.getuid()):
        try:  # an unanswered probe is not cached: the next call asks again
            write_capabilities(path, caps)
        except OSError as exc:
            log.info("site capabilities: cannot cache in %s: %s", path, exc.strerror or exc)
    return caps


def write_run_dir_copy(run_dir: str, caps: SiteCapabilities) -> str:
    """Freeze ``caps`` into the run directory (``capabilities.json``, 0644) for the job's agents."""
    path = os.path.join(run_dir, CAPABILITIES_NAME)
    write_capabilities(path, caps, RUN_DIR_FILE_MODE)
    return path


def read_run_dir_copy(run_dir: str, *, now: float | None = None, max_age_s: float | None = None,
                      uid: int | None = None) -> SiteCapabilities | None:
    """The run directory's copy (node 0 at job start), or None when missing or untrusted.
    ``uid``: the run's user, who wrote it (default: this process's user)."""
    return read_capabilities(os.path.join(run_dir, CAPABILITIES_NAME),
                             now=time.time() if now is None else now, max_age_s=max_age_s, uid=uid)
