"""The checkpoints a program has finished writing, found in its own folder, by the mark its
writer leaves last:

- torchtitan: ``step-N`` directories that hold DCP's ``.metadata`` (DCP writes it after every
  rank's data, in ``finish``) or, for a save in Hugging Face's format, ``model.safetensors.index.json``:
  the two marks torchtitan's own resume (``_find_load_step``, 0.3.0) accepts. A ``step-N``
  without either is a save in progress or one cut short.
- Lightning: ``*.ckpt`` files whose name carries ``step=N`` (ModelCheckpoint's default
  ``epoch=E-step=S.ckpt``, ``-vK`` for a repeated name) in the folder or in its logger's
  ``version_K/checkpoints``. Lightning 2.6 writes through an fsspec transaction: to a temporary
  file in the system's temp folder, then moved to the name; across file systems the move copies,
  so the ``.ckpt`` grows in place. A ``.ckpt`` counts once it ends with a zip's end-of-directory
  record (``torch.save`` writes a zip and that record last); ``last.ckpt`` (a link or a copy) has
  no step and is not counted.
- any program: a glob with one ``{step}`` (:func:`compile_glob`), relative to the folder, e.g.
  ``snapshot-{step}.pt`` or ``ckpt/step_{step}/.metadata``. A match that is a regular file
  counts (when it is a ``torch.save`` zip, once its end record is there); a directory counts
  when it holds DCP's ``.metadata``. Point the glob at the file the program writes last.

The folder is written by the program, so it is read as untrusted: no link below it is followed
(each step is opened relative to its parent's descriptor with ``O_NOFOLLOW``), no FIFO or
device is opened, at most ``limit`` directory entries are read in all (a warning says when the
list was cut there), and an odd name is skipped, never raised on.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import stat
from dataclasses import dataclass

from slurmkit.adapters.command import LIGHTNING, TORCHTITAN
from slurmkit.errors import ConfigError

log = logging.getLogger(__name__)

#: Directory entries one scan reads at most (torchtitan keeps every step unless keep_latest_k).
MAX_ENTRIES = 4096
_MAX_STEP = 2 ** 53
_STEP = r"(\d{1,16})"
_TITAN_DIR = re.compile(r"step-" + _STEP, re.ASCII)
_TITAN_MARKS = (".metadata", "model.safetensors.index.json")
_LIGHTNING_CKPT = re.compile(r"(?:^|-)step=" + _STEP + r"(?=-|\.ckpt$)", re.ASCII)
_LIGHTNING_VERSION = re.compile(r"version_\d{1,9}", re.ASCII)
_DCP_MARK = ".metadata"
_ZIP_START = b"PK\x03\x04"
_ZIP_END = b"PK\x05\x06"  # the end of central directory record, 22 bytes and a comment
_ZIP_TAIL = 22 + 1024  # torch writes no comment; a short one is allowed

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


@dataclass
class _Budget:
    left: int
    cut: bool = False


def _entries(fd: int, budget: _Budget) -> list[tuple[str, bool]]:
    """(name, is a real directory) of the directory ``fd``, as long as the budget lasts; links are
    neither directories nor anything else here (their name is returned, is_dir False)."""
    out = []
    try:
        with os.scandir(fd) as it:
            for entry in it:
                if budget.left <= 0:
                    budget.cut = True
                    break
                budget.left -= 1
                if entry.is_symlink():
                    continue
                out.append((entry.name, entry.is_dir(follow_symlinks=False)))
    except OSError:
        pass
    return out


def _open_dir(name: str, parent: int) -> int | None:
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=parent)
    except (OSError, ValueError):  # ValueError: a name with a NUL, from no real directory
        return None


def _is_file(name: str, parent: int) -> bool:
    try:
        return stat.S_ISREG(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode)
    except (OSError, ValueError):
        return False


def _zip_state(name: str, parent: int) -> bool | None:
    """For the regular file ``name``: None when it is no zip, else whether its end record is
    there (a complete ``torch.save``). False for anything that is not a regular file."""
    try:
        fd = os.open(name, _FILE_FLAGS, dir_fd=parent)
    except (OSError, ValueError):
        return False
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return False
        if os.pread(fd, 4, 0) != _ZIP_START:
            return None
        size = info.st_size
        tail = os.pread(fd, min(size, _ZIP_TAIL), max(0, size - _ZIP_TAIL))
    except OSError:
        return False
    finally:
        os.close(fd)
    at = tail.rfind(_ZIP_END)
    while at >= 0:
        if at + 22 <= len(tail) and at + 22 + int.from_bytes(tail[at + 20:at + 22], "little") == len(tail):
            return True
        at = tail.rfind(_ZIP_END, 0, at)
    return False


def _step(found: re.Match[str] | None) -> int | None:
    if found is None:
        return None
    step = int(found.group(1))
    return step if step < _MAX_STEP else None


def _torchtitan(fd: int, folder: str, budget: _Budget) -> list[tuple[int, str]]:
    out = []
    for name, is_dir in _entries(fd, budget):
        step = _step(_TITAN_DIR.fullmatch(name))
        if step is None or not is_dir:
            continue
        sub = _open_dir(name, fd)
        if sub is None:
            continue
        try:
            if any(_is_file(mark, sub) for mark in _TITAN_MARKS):
                out.append((step, os.path.join(folder, name)))
        finally:
            os.close(sub)
    return out


def _ckpt_files(fd: int, folder: str, budget: _Budget) -> tuple[list[tuple[int, str]], list[str]]:
    """Lightning's complete checkpoints directly in ``fd``, and its ``version_K`` directories."""
    out, versions = [], []
    for name, is_dir in _entries(fd, budget):
        if is_dir:
            if _LIGHTNING_VERSION.fullmatch(name):
                versions.append(name)
            continue
        step = _step(_LIGHTNING_CKPT.search(name)) if name.endswith(".ckpt") else None
        if step is not None and _zip_state(name, fd) is True:
            out.append((step, os.path.join(folder, name)))
    return out, versions


def _lightning(fd: int, folder: str, budget: _Budget) -> list[tuple[int, str]]:
    out, versions = _ckpt_files(fd, folder, budget)
    for version in versions:
        vfd = _open_dir(version, fd)
        if vfd is None:
            continue
        try:
            cfd = _open_dir("checkpoints", vfd)
        finally:
            os.close(vfd)
        if cfd is None:
            continue
        try:
            out += _ckpt_files(cfd, os.path.join(folder, version, "checkpoints"), budget)[0]
        finally:
            os.close(cfd)
    return out


@dataclass(frozen=True)
class CheckpointGlob:
    """A checked glob: one regex per path component, ``step_at`` the one holding ``{step}``."""

    text: str
    parts: tuple[re.Pattern[str], ...]
    step_at: int


def _refuse(text: str, detected: str) -> ConfigError:
    return ConfigError(f"checkpoint glob {text!r}: {detected}",
                       "a path relative to the checkpoint folder, components of literal text, '?' "
                       "and at most one '*' each, and '{step}' exactly once (no '..', '**' or [...])",
                       "write it as the program names its saves, e.g. 'snapshot-{step}.pt' or "
                       "'ckpt/step_{step}/.metadata' (the file written last)")


@functools.lru_cache(maxsize=64)
def compile_glob(text: str) -> CheckpointGlob:
    """``text`` checked and compiled (cached: a scan passes the config's string); ConfigError
    (Detected/Requirement/Fix) when it is not a glob this module reads. ``*`` matches within one
    name, ``?`` one character, ``{step}`` the step's digits."""
    if not isinstance(text, str) or not text or len(text) > 256:
        raise _refuse(str(text)[:60], "it is empty or longer than 256 characters")
    if text.count("{step}") != 1:
        raise _refuse(text, "it must hold '{step}' exactly once")
    if "\0" in text:
        raise _refuse(text, "it holds a NUL character")
    if text.startswith("/"):
        raise _refuse(text, "it is absolute (it is read inside the checkpoint folder)")
    components = text.split("/")
    if len(components) > 8:
        raise _refuse(text, "it has more than 8 components")
    parts, step_at = [], -1
    for i, comp in enumerate(components):
        if comp in ("", ".", "..") or "**" in comp or any(c in comp.replace("{step}", "") for c in "[]{}"):
            raise _refuse(text, f"component {comp!r} is not allowed")
        if comp.count("*") > 1:
            raise _refuse(text, f"component {comp!r} has more than one '*'")
        regex = ""
        for piece in re.split(r"(\{step\}|\*|\?)", comp):
            regex += {"{step}": _STEP, "*": r"[^/]*", "?": r"[^/]"}.get(piece, re.escape(piece))
        if "{step}" in comp:
            step_at = i
        parts.append(re.compile(regex, re.DOTALL | re.ASCII))
    return CheckpointGlob(text, tuple(parts), step_at)


def split_glob(text: str, base: str) -> tuple[str, str]:
    """(folder, glob inside it) for a user's ``job.checkpoint_glob``: its leading components
    without a wildcard (``*``, ``?``, ``{step}``) are the folder, absolute or taken from
    ``base`` (the ranks' working directory); the rest is for :func:`compile_glob`."""
    parts = text.split("/")
    first = next((i for i, p in enumerate(parts) if any(w in p for w in ("*", "?", "{step}"))), len(parts) - 1)
    folder = "/".join(parts[:first]) or ("/" if text.startswith("/") else ".")
    return os.path.normpath(os.path.join(base, folder)), "/".join(parts[first:])


def _glob_complete(name: str, is_dir: bool, parent: int) -> bool:
    if is_dir:
        sub = _open_dir(name, parent)
        if sub is None:
            return False
        try:
            return _is_file(_DCP_MARK, sub)
        finally:
            os.close(sub)
    return _zip_state(name, parent) is not False


def _walk_glob(fd: int, folder: str, pattern: CheckpointGlob, depth: int, step: int | None,
               budget: _Budget, out: list[tuple[int, str]]) -> None:
    """Depth first, one descriptor per level open at a time (at most 8)."""
    last = depth == len(pattern.parts) - 1
    for name, is_dir in _entries(fd, budget):
        found = pattern.parts[depth].fullmatch(name)
        if found is None:
            continue
        here = _step(found) if depth == pattern.step_at else step
        if depth == pattern.step_at and here is None:
            continue
        if last:
            if here is not None and _glob_complete(name, is_dir, fd):
                out.append((here, os.path.join(folder, name)))
        elif is_dir:
            sub = _open_dir(name, fd)
            if sub is not None:
                try:
                    _walk_glob(sub, os.path.join(folder, name), pattern, depth + 1, here, budget, out)
                finally:
                    os.close(sub)


def complete_checkpoints(adapter: str, folder: str, glob: str | None = None,
                         limit: int = MAX_ENTRIES) -> list[tuple[int, str]]:
    """The complete checkpoints in ``folder`` as (step, path), sorted by step then path.

    ``glob`` (see :func:`compile_glob`; ConfigError when it is not one) wins over the adapter's
    own layout; without it torchtitan's and Lightning's are read (see the module), and any other
    adapter finds nothing. A missing or unreadable folder has none. At most ``limit`` entries
    are read; a scan cut there logs a warning and returns what it found.
    """
    pattern = compile_glob(glob) if glob is not None else None
    if pattern is None and adapter not in (TORCHTITAN, LIGHTNING):
        return []
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NONBLOCK)
    except (OSError, ValueError):
        return []
    budget = _Budget(max(0, limit))
    out: list[tuple[int, str]] = []
    try:
        if pattern is not None:
            _walk_glob(fd, folder, pattern, 0, None, budget, out)
        elif adapter == TORCHTITAN:
            out = _torchtitan(fd, folder, budget)
        else:
            out = _lightning(fd, folder, budget)
    finally:
        os.close(fd)
    if budget.cut:
        log.warning("checkpoint scan of %s stopped after %d entries: the list may miss checkpoints",
                    folder, limit)
    return sorted(out)
