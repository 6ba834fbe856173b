"""What submit can check about the world before it writes or submits anything, and how it
creates a run directory so that a refused submission leaves nothing behind.

A store URI whose protocol has no installed fsspec backend is otherwise found by every rank of
every allocation (the job crash-loops, then stops with 93); an unwritable ``submit.run_root``
was a traceback. Both are answered here with Detected/Requirement/Fix.
"""

from __future__ import annotations

import errno
import importlib.util
import os
import shutil

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
