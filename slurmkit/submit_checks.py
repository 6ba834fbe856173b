"""What submit can check about the world before it writes or submits anything, and how it
creates a run directory so that a refused submission leaves nothing behind.

A store URI whose protocol has no installed fsspec backend is otherwise found by every rank of
every allocation (the job crash-loops, then stops with 93); an unwritable ``submit.run_root``
was a traceback; a script named by a relative path in ``job.command`` was looked for in the run
directory, where the ranks start, and crash-looped too. All are answered here with
Detected/Requirement/Fix.
"""

from __future__ import annotations

import dataclasses
import errno
import importlib.util
import os
import re
import shutil
from collections.abc import Sequence

from slurmkit.config import SlurmkitConfig
from slurmkit.errors import ConfigError
from slurmkit.rundir import RUN_DIR_MODE
from slurmkit.runfiles import LOGS_DIR
from slurmkit.store.config import StoreConfig

_LOCAL = {None, "", "file", "local"}


def _protocols(uri: str) -> list[str]:
    """The fsspec protocols a URI names, chained ones included ("simplecache::s3://b/k")."""
    out: list[str] = []
    parts = uri.split("::")
    for i, part in enumerate(parts):
        if "://" in part:
            out.append(part.split("://", 1)[0])
        elif i < len(parts) - 1:  # a bare chain member: "simplecache::..."
            out.append(part)
    return [p for p in out if p not in _LOCAL]


def backend_missing(protocol: str) -> str | None:
    """Why ``protocol`` cannot be opened here, or None. Looks the backend up in fsspec's
    registry and finds its package without importing it (s3fs pulls in botocore)."""
    from fsspec.registry import known_implementations, registry

    if protocol in registry:
        return None
    impl = known_implementations.get(protocol)
    if impl is None:
        return f"fsspec knows no protocol {protocol!r}"
    top = str(impl["class"]).split(".", 1)[0]
    if importlib.util.find_spec(top) is None:
        return f"its backend {impl['class']} is not installed ({impl.get('err') or 'no package ' + top})"
    return None


def check_store_backends(store: StoreConfig) -> None:
    for key in ("nvme_uri", "lustre_uri", "object_uri"):
        uri = getattr(store, key)
        for protocol in _protocols(uri):
            why = backend_missing(protocol)
            if why:
                raise ConfigError(f"store.{key}={uri!r} uses protocol {protocol!r}: {why}",
                                  "every checkpoint tier's protocol has an fsspec backend installed "
                                  "in the job's Python environment",
                                  f"install the backend (e.g. pip install s3fs for s3://) or set "
                                  f"store.{key} to a path or a supported URI")


def check_adopt(cfg: SlurmkitConfig, reference_trainer: bool) -> None:
    """``store.adopt=true`` where the agents could not act on it: no tier to copy to, or a
    program whose DCP saves slurmkit cannot find and name (the job would run without it)."""
    store, job = cfg.store, cfg.job
    if not store.adopt or reference_trainer:  # (the reference trainer saves through the store)
        return
    if not (store.lustre_uri or store.object_uri):
        raise ConfigError("store.adopt=true with neither store.lustre_uri nor store.object_uri set",
                          "adopted saves are copied to a shared or an object tier",
                          "set store.lustre_uri (a shared file system path) and/or store.object_uri "
                          "(s3://bucket/prefix), or store=tiered")
    from slurmkit import adapters
    from slurmkit.adapters.command import TORCHTITAN

    command = [str(a) for a in job.command]
    adapter = adapters.resolve(job.program, command, reference_trainer=False)
    glob = job.checkpoint_glob.rstrip("/")
    named = (glob.endswith("{step}/.metadata") or glob.endswith("{step}")) and not any(w in glob for w in "*?")
    if glob and not named:
        raise ConfigError(f"store.adopt=true with job.checkpoint_glob={job.checkpoint_glob!r}",
                          "adopted saves are DCP step directories the glob names exactly: "
                          "one {step}, no * or ?, ending in {step}/.metadata (or the directory {step})",
                          "set job.checkpoint_glob to e.g. 'ckpt/step_{step}/.metadata'")
    if not glob and adapter != TORCHTITAN:
        raise ConfigError(f"store.adopt=true for a program read as {adapter!r}, without job.checkpoint_glob",
                          "slurmkit knows where the program's DCP saves are: job.program=torchtitan "
                          "(its checkpoint/step-N) or job.checkpoint_glob",
                          "set job.checkpoint_glob to the .metadata of the program's step directories, "
                          "e.g. 'ckpt/step_{step}/.metadata', or store.adopt=false")
    if not glob and not adapters.checkpoint_dirs(adapter, command, os.getcwd()):
        raise ConfigError("store.adopt=true, but the torchtitan command does not say where it saves "
                          "(--checkpoint.folder on a remote URI?)",
                          "a checkpoint folder on a file system every node reads",
                          "save to a path (the default: <dump folder>/checkpoint) or set store.adopt=false")


def _unwritable(run_root: str, why: str) -> ConfigError:
    return ConfigError(f"submit.run_root={run_root!r}: {why}",
                       "a directory this user can create run directories in, on a file system "
                       "every node sees", "set submit.run_root to such a directory (or fix its "
                       "permissions)")


def check_run_root(run_root: str) -> None:
    """Refuse a run root that cannot hold run directories, creating nothing: its nearest
    existing ancestor must be a directory this user may write into."""
    path = os.path.abspath(run_root)
    probe = path
    while not os.path.lexists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        raise _unwritable(run_root, f"{probe} is not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise _unwritable(run_root, f"{probe} is not writable by this user")


def missing_dirs(path: str) -> list[str]:
    """``path`` and those of its ancestors that do not exist yet, outermost first."""
    out: list[str] = []
    probe = os.path.abspath(path)
    while not os.path.lexists(probe):
        out.insert(0, probe)
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    return out


def make_run_dir(run_dir: str, run_root: str) -> list[str]:
    """Create ``run_dir`` (with its logs/), returning every directory this call created,
    outermost first, for :func:`remove_created`. An OSError becomes a ConfigError."""
    created = missing_dirs(run_dir)
    made: list[str] = []
    try:
        for path in created:
            try:
                os.mkdir(path)
            except FileExistsError:
                if path == created[-1]:
                    raise
                continue  # a parent another submission created meanwhile: not ours to remove
            made.append(path)
        # private: what every allocation runs lives here (slurmkit/rundir.py); chmod, since
        # mkdir's mode is filtered by the umask
        if os.path.abspath(run_dir) in made:
            os.chmod(run_dir, RUN_DIR_MODE)
        os.makedirs(os.path.join(run_dir, LOGS_DIR), exist_ok=True)
    except OSError as exc:
        remove_created(made, run_dir)
        if exc.errno == errno.EEXIST:
            raise  # a run directory of the same name appeared at the same time: not a config error
        raise _unwritable(run_root, f"creating {exc.filename or run_dir} failed: "
                                    f"{exc.strerror or exc}") from exc
    return made


def remove_created(created: list[str], run_dir: str | None) -> None:
    """Undo :func:`make_run_dir` (or a sweep's creation, ``created`` from :func:`missing_dirs`):
    ``run_dir`` with its contents if this submission created it, then each other directory it
    created, while empty (another submission may be creating its own run directory there)."""
    run_dir = os.path.abspath(run_dir) if run_dir else None
    if run_dir in created:
        shutil.rmtree(run_dir, ignore_errors=True)
    for path in reversed([p for p in created if p != run_dir]):
        try:
            os.rmdir(path)
        except OSError:
            break  # not empty: someone else's run directory lives there now


# ------------------------------------------------------------------ job.command's own files

#: An interpreter's name (the last part of argv[0]): python, python3, python3.11.
_PYTHON = re.compile(r"python\d*(?:\.\d+)*")
#: The modules that are torchrun under ``python -m``.
_TORCHRUN_MODULES = frozenset({"torch.distributed.run", "torch.distributed.launch"})
#: torchrun's options that take no value (every other option takes one, in the same argument
#: after '=' or in the next). -m/--module: the script is a module; --no-python: a program.
_TORCHRUN_FLAGS = frozenset({"-h", "--help", "--standalone", "--run-path", "--run_path",
                             "--virtual-local-rank", "--virtual_local_rank", "--use-env", "--use_env"})
_TORCHRUN_MODULE_FLAGS = frozenset({"-m", "--module"})
_TORCHRUN_NO_PYTHON = frozenset({"--no-python", "--no_python"})

SCRIPT, PROGRAM = "script", "program"  # a file an interpreter reads; a file executed itself


def _python_target(args: Sequence[str]) -> tuple[str, int, str] | None:
    """What ``python ARGS`` runs: (SCRIPT, i, path) with i the script's index in ``args``, or
    ("module", i, name) with i the index of the module's first argument; None for ``-c`` code,
    stdin or no argument. Reads the options as CPython does: short ones may be joined (-uB);
    -W and -X take the rest of their argument or the next one; -c and -m end the options."""
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            return (SCRIPT, i + 1, args[i + 1]) if i + 1 < len(args) else None
        if arg == "-":
            return None  # the program comes on stdin
        if not arg.startswith("-"):
            return (SCRIPT, i, arg)
        if arg.startswith("--"):  # --check-hash-based-pycs MODE is the one long option with a value
            i += 2 if arg == "--check-hash-based-pycs" else 1
            continue
        step = 1
        for k, letter in enumerate(arg[1:], start=1):
            if letter == "c":
                return None
            if letter == "m":
                if k < len(arg) - 1:  # -mpkg: the name in the same argument
                    return ("module", i + 1, arg[k + 1:])
                return ("module", i + 2, args[i + 1]) if i + 1 < len(args) else None
            if letter in "WX":
                step = 2 if k == len(arg) - 1 else 1
                break
        i += step
    return None


def _torchrun_target(args: Sequence[str]) -> tuple[str, int] | None:
    """What ``torchrun ARGS`` runs: (SCRIPT or PROGRAM, i) with i its index in ``args``; None
    for ``-m module`` or no argument."""
    kind = SCRIPT
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            i += 1
            break
        if not arg.startswith("-") or arg == "-":
            break
        if arg in _TORCHRUN_MODULE_FLAGS:
            return None
        if arg in _TORCHRUN_NO_PYTHON:
            kind = PROGRAM
        takes_value = (arg not in _TORCHRUN_FLAGS and arg not in _TORCHRUN_NO_PYTHON and "=" not in arg
                       and (arg.startswith("--") or len(arg) == 2))
        i += 2 if takes_value else 1
    return (kind, i) if i < len(args) else None


def command_files(command: Sequence[str]) -> list[tuple[int, str]]:
    """The arguments of ``command`` that name a file of the user's, as (index, SCRIPT or
    PROGRAM): argv[0] when it is a path (./run.sh, bin/train, /opt/venv/bin/python); a Python
    interpreter's script; torchrun's script (``torchrun`` or ``python -m torch.distributed.run``),
    its program under --no-python only when that is a path. A bare name found on PATH, a module
    (``-m``) and ``-c`` code name no file here. Pure: nothing is looked up."""
    if not command:
        return []
    out: list[tuple[int, str]] = [(0, PROGRAM)] if "/" in command[0] else []
    name = os.path.basename(command[0])
    offset = 1
    if _PYTHON.fullmatch(name):
        found = _python_target(command[1:])
        if found is None:
            return out
        kind, at, what = found
        if kind == SCRIPT:
            return [*out, (1 + at, SCRIPT)]
        if what not in _TORCHRUN_MODULES:
            return out
        offset = 1 + at
    elif name != "torchrun":
        return out
    target = _torchrun_target(command[offset:])
    if target is not None and (target[0] == SCRIPT or "/" in command[offset + target[1]]):
        out.append((offset + target[1], target[0]))
    return out


def _missing(path: str, kind: str) -> str | None:
    """Why ``path`` cannot be run as ``kind``, or None."""
    if kind == SCRIPT and os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "__main__.py")):
            return None  # python runs a directory's __main__.py
        return "is a directory without __main__.py"
    if not os.path.exists(path):
        return "does not exist"
    if not os.path.isfile(path):
        return "is not a regular file"
    if kind == PROGRAM and not os.access(path, os.X_OK):
        return "is not executable"
    return None


def resolve_command(command: Sequence[str], cwd: str) -> list[str]:
    """``command`` with each file of :func:`command_files` made absolute against ``cwd`` (the
    directory submit runs in: ranks start in the run directory, where a relative path names
    nothing), after checking that it is there. Raises ConfigError naming the path looked for."""
    out = list(command)
    for index, kind in command_files(command):
        given = out[index]
        path = os.path.normpath(os.path.join(cwd, given))
        why = _missing(path, kind)
        if why is not None:
            where = "" if os.path.isabs(given) else f", resolved against the directory submit ran in, {cwd}"
            fix = ("chmod +x it, or run it through its interpreter (job.command=[bash,...])"
                   if why == "is not executable" else
                   "give its path from the directory you submit from (or submit from the one "
                   "that holds it), or an absolute path, e.g. job.command=[python,/path/to/train.py]")
            raise ConfigError(f"job.command names the {kind} {given!r}: {path} {why}{where}",
                              f"each {SCRIPT} or {PROGRAM} that job.command names is there when the "
                              "job is submitted (its ranks start in the run directory, so submit makes "
                              "a relative path absolute)", fix)
        out[index] = path
    return out


def with_command_resolved(cfg: SlurmkitConfig, cwd: str) -> SlurmkitConfig:
    """``cfg`` with :func:`resolve_command` applied to job.command: what is frozen and run.
    A container job's paths name files inside its image (cluster.container_image): left alone."""
    if cfg.cluster.container_image:
        return cfg
    command = resolve_command(cfg.job.command, cwd)
    if command == list(cfg.job.command):
        return cfg
    return dataclasses.replace(cfg, job=dataclasses.replace(cfg.job, command=command))
