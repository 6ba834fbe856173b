"""A checkpoint tier: a narrow protocol over string URIs, implemented once on fsspec.

Paths stay ``str`` (pathlib mangles ``s3://``). Every method takes a path relative to the
tier root. Optional backends (s3fs) are imported lazily with an install hint.

On a local tier no method follows a link below the root (nofollow.py): whoever can write a
step directory could otherwise point a shard at another file, read or overwrite it, or have
it removed with the step. The root itself is the user's configured path (tiertrust.py).
"""

from __future__ import annotations

import base64
import os
import re
import uuid
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Any, Protocol

import fsspec

from slurmkit.errors import ConfigError, SlurmkitError
from slurmkit.store import nofollow
from slurmkit.store.manifest import hash_file, hash_stream
from slurmkit.store.tiertrust import make_private_dirs, private_tier_root
from slurmkit.store.transfer import copy_hashed, fetch_hashed

_ENV_RE = re.compile(r"\$(\w+)|\$\{(\w+)\}")


class TierError(SlurmkitError):
    """A tier operation failed (I/O, missing file, full disk, unreachable server)."""


def expand_env(uri: str, env: Mapping[str, str]) -> str:
    """Expand ``$VAR`` / ``${VAR}`` from ``env``; an unset variable is a ConfigError."""

    def sub(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        if name not in env:
            raise ConfigError(
                detected=f"checkpoint URI {uri!r} uses ${name}, which is not set",
                requirement="every variable in a store URI is set in the rank environment",
                fix=f"export {name} or remove it from the URI",
            )
        return env[name]

    return _ENV_RE.sub(sub, uri)


class Tier(Protocol):
    """What the store needs from a storage location. ``rel`` paths use ``/``."""

    name: str
    uri: str

    def local_path(self, rel: str) -> str | None: ...
    def renames_atomically(self) -> bool: ...
    def put_file(self, local_path: str, rel: str) -> None: ...
    def get_file(self, rel: str, local_path: str) -> None: ...
    def get_file_hashed(self, rel: str, local_path: str, algo: str, size: int
                        ) -> tuple[str, int]: ...
    def sizes(self, rel: str) -> dict[str, int]: ...
    def ls(self, rel: str = "") -> list[str]: ...
    def exists(self, rel: str) -> bool: ...
    def size(self, rel: str) -> int: ...
    def checksum(self, rel: str, algo: str) -> str: ...
    def rm(self, rel: str, recursive: bool = False) -> None: ...
    def commit(self, src_rel: str, dst_rel: str) -> None: ...
    def open(self, rel: str, mode: str = "rb") -> IO[bytes]: ...
    def write_atomic(self, rel: str, data: bytes) -> None: ...


def _s3_filesystem(env: Mapping[str, str], profile: str) -> Any:
    try:
        import s3fs
    except ImportError as exc:  # optional backend
        raise ConfigError(
            detected="an s3:// checkpoint tier but s3fs is not installed",
            requirement="s3fs for the object tier", fix="pip install s3fs",
        ) from exc
    endpoint = env.get("SLURMKIT_S3_ENDPOINT") or env.get("AWS_ENDPOINT_URL") or None
    kwargs: dict[str, Any] = {
        "client_kwargs": {"endpoint_url": endpoint} if endpoint else {},
        # Fail fast inside one attempt; the store's own retry policy does the backoff.
        "config_kwargs": {"connect_timeout": 5, "read_timeout": 60,
                          "retries": {"max_attempts": 2, "mode": "standard"}},
        "skip_instance_cache": True,
        "use_listings_cache": False,
    }
    if env.get("AWS_DEFAULT_REGION"):
        kwargs["client_kwargs"]["region_name"] = env["AWS_DEFAULT_REGION"]
    if profile:
        kwargs["profile"] = profile
    elif env.get("AWS_ACCESS_KEY_ID"):
        kwargs["key"] = env["AWS_ACCESS_KEY_ID"]
        kwargs["secret"] = env.get("AWS_SECRET_ACCESS_KEY", "")
        if env.get("AWS_SESSION_TOKEN"):
            kwargs["token"] = env["AWS_SESSION_TOKEN"]
    fs = s3fs.S3FileSystem(**kwargs)
    fs.retries = 1  # s3fs' own retry loop would hide an outage for minutes
    return fs


class FsspecTier:
    """A tier on any fsspec filesystem: local paths, memory://, s3://."""

    def __init__(self, name: str, uri: str, fs: Any) -> None:
        self.name = name
        self.uri = uri.rstrip("/")
        self.fs = fs
        self._local = "file" in _protocols(fs)
        root = str(fs._strip_protocol(self.uri)).rstrip("/")
        self.root = os.path.abspath(root) if self._local else root
        # how checksum() obtained its answers: from the server's metadata or reading back
        self.checksums = {"server": 0, "readback": 0}

    def __repr__(self) -> str:
        return f"FsspecTier({self.name!r}, {self.uri!r})"

    def _p(self, rel: str) -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def local_path(self, rel: str) -> str | None:
        """The OS path of ``rel`` when the tier is a local (POSIX) path, else None."""
        return self._p(rel) if self._local else None

    def secure(self, *, shared: bool) -> list[str]:
        """Before the store writes: refuse a local tier's directory that another user could
        control (UnsafeTierError), create it 0700; return warnings (tiertrust.py). Tiers that
        are not local paths are the server's business."""
        return private_tier_root(self.name, self.root, shared=shared) if self._local else []

    def renames_atomically(self) -> bool:
        """True where rename is atomic (POSIX, memory); object stores commit by manifest."""
        return self._local or "memory" in _protocols(self.fs)

    def _errors(self) -> tuple[type[BaseException], ...]:
        # s3fs surfaces botocore/aiohttp errors (connection refused, timeouts) that are not
        # OSError; for remote tiers every exception of an operation is a tier failure.
        return (OSError,) if self._local else (Exception,)

    def _io(self, what: str, rel: str, exc: BaseException) -> TierError:
        return TierError(f"{self.name} tier {self.uri}: {what} {rel!r} failed: {exc}")

    def put_file(self, local_path: str, rel: str) -> None:
        try:
            if self._local:  # the source is the caller's path; the destination links-free
                with open(local_path, "rb") as src:
                    nofollow.write_from(self.root, rel, src)
            else:
                self.fs.put_file(local_path, self._p(rel))
        except self._errors() as exc:
            raise self._io("put", rel, exc) from exc

    def get_file(self, rel: str, local_path: str) -> None:
        try:
            make_private_dirs(os.path.dirname(local_path) or ".")
            if self._local:
                with nofollow.opened(self.root, rel) as src:
                    _copy_local(src, local_path)
            else:
                self.fs.get_file(self._p(rel), local_path)
                os.chmod(local_path, 0o600)  # the client made it with the umask
        except self._errors() as exc:
            raise self._io("get", rel, exc) from exc

    def get_file_hashed(self, rel: str, local_path: str, algo: str, size: int
                        ) -> tuple[str, int]:
        """Download ``size`` bytes of ``rel`` to ``local_path`` in parallel byte ranges,
        hashing on the way; return (checksum, bytes received)."""
        try:
            make_private_dirs(os.path.dirname(local_path) or ".")
            if self._local:
                with nofollow.opened(self.root, rel) as src:
                    return copy_hashed(src, local_path, algo)
            path = self._p(rel)
            return fetch_hashed(lambda a, b: bytes(self.fs.cat_file(path, start=a, end=b)),
                                size, local_path, algo)
        except self._errors() as exc:
            raise self._io("get", rel, exc) from exc

    def sizes(self, rel: str) -> dict[str, int]:
        """Size of every file directly in ``rel`` (one listing request); {} if missing."""
        try:
            if self._local:  # links are left out; a step that is a link is refused
                return nofollow.sizes(self.root, rel)
            entries = self.fs.ls(self._p(rel), detail=True)
        except FileNotFoundError:
            return {}
        except self._errors() as exc:
            raise self._io("ls", rel, exc) from exc
        return {str(e["name"]).rstrip("/").rsplit("/", 1)[-1]: int(e.get("size") or 0)
                for e in entries if e.get("type") == "file"}

    def ls(self, rel: str = "") -> list[str]:
        """Names of the direct children of ``rel``; [] when it does not exist."""
        try:
            if self._local:
                return nofollow.listdir(self.root, rel)
            entries = self.fs.ls(self._p(rel), detail=False)
        except FileNotFoundError:
            return []
        except self._errors() as exc:
            raise self._io("ls", rel, exc) from exc
        base = self.fs._strip_protocol(self._p(rel)).rstrip("/")
        names = [str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries]
        return sorted(n for n in names if n and f"{base}/{n}" != base)

    def exists(self, rel: str) -> bool:
        try:
            if self._local:
                return nofollow.lexists(self.root, rel)
            return bool(self.fs.exists(self._p(rel)))
        except self._errors() as exc:
            raise self._io("exists", rel, exc) from exc

    def size(self, rel: str) -> int:
        try:
            if self._local:
                return nofollow.size(self.root, rel)
            return int(self.fs.size(self._p(rel)))
        except self._errors() as exc:
            raise self._io("size", rel, exc) from exc

    def checksum(self, rel: str, algo: str) -> str:
        """The checksum of ``rel`` as stored here, in the manifest's format.

        For crc32 on S3 the server's own whole-object CRC32 (one HEAD, no bytes moved) where
        it returns one: SeaweedFS does for objects sent in one PUT, not for multipart
        uploads (no checksum, or a composite one, which is a CRC of part CRCs). Everything
        else is read back and hashed."""
        if algo == "crc32" and not self._local:
            crc = self._server_crc32(rel)
            if crc is not None:
                self.checksums["server"] += 1
                return crc
        try:
            if self._local:
                digest, _ = hash_file(rel, algo, root=self.root)
            else:
                with self.fs.open(self._p(rel), "rb") as f:
                    digest, _ = hash_stream(f, algo)
        except self._errors() as exc:
            raise self._io("checksum", rel, exc) from exc
        self.checksums["readback"] += 1
        return digest

    def _server_crc32(self, rel: str) -> str | None:
        call = getattr(self.fs, "call_s3", None)
        if call is None:
            return None
        try:
            bucket, key, _ = self.fs.split_path(self._p(rel))
            head = call("head_object", Bucket=bucket, Key=key, ChecksumMode="ENABLED")
        except self._errors() as exc:
            raise self._io("head", rel, exc) from exc
        value = head.get("ChecksumCRC32")
        if not value or "-" in value or head.get("ChecksumType", "FULL_OBJECT") != "FULL_OBJECT":
            return None
        raw = base64.b64decode(value)
        return f"{int.from_bytes(raw, 'big'):08x}" if len(raw) == 4 else None

    def rm(self, rel: str, recursive: bool = False) -> None:
        """Remove ``rel`` (a missing path is not an error)."""
        try:
            if self._local:  # a link is removed itself, never its target
                nofollow.remove(self.root, rel, recursive)
                return
            self.fs.rm(self._p(rel), recursive=recursive)
            if recursive and self.fs.exists(self._p(rel)):
                # SeaweedFS leaves a "dir/" marker once the last key under a prefix is gone
                # (it listed as an empty step); the second delete removes it
                self.fs.rm(self._p(rel), recursive=True)
        except FileNotFoundError:
            return
        except self._errors() as exc:
            raise self._io("rm", rel, exc) from exc

    def commit(self, src_rel: str, dst_rel: str) -> None:
        """Make ``src_rel`` visible as ``dst_rel``: a rename where atomic, else copy + delete."""
        if src_rel == dst_rel:
            return
        try:
            if self._local:
                nofollow.rename(self.root, src_rel, dst_rel)
            else:  # object stores have no directories: copy every key (server side), delete
                src = self.fs._strip_protocol(self._p(src_rel)).rstrip("/")
                dst = self.fs._strip_protocol(self._p(dst_rel)).rstrip("/")
                keys = [str(k) for k in self.fs.find(src)]
                with ThreadPoolExecutor(max_workers=max(1, min(len(keys), 8))) as pool:
                    list(pool.map(lambda k: self.fs.copy(k, dst + k[len(src):]), keys))
                self.fs.rm(src, recursive=True)
        except self._errors() as exc:
            raise self._io("commit", src_rel, exc) from exc

    def open(self, rel: str, mode: str = "rb") -> IO[bytes]:
        try:
            if self._local:
                if "w" in mode or "a" in mode:
                    return nofollow.open_write(self.root, rel, append="a" in mode)
                return nofollow.open_file(self.root, rel)
            return self.fs.open(self._p(rel), mode)  # type: ignore[no-any-return]
        except self._errors() as exc:
            raise self._io("open", rel, exc) from exc

    def write_atomic(self, rel: str, data: bytes) -> None:
        """Write ``data`` so readers see the old content or all of the new, never a part."""
        try:
            if self._local:
                nofollow.write_atomic(self.root, rel, data)
            elif "memory" in _protocols(self.fs):
                tmp = f"{rel}.tmp-{uuid.uuid4().hex}"
                self.fs.pipe_file(self._p(tmp), data)
                self.fs.mv(self._p(tmp), self._p(rel))
            else:  # one PUT is atomic on an object store
                self.fs.pipe_file(self._p(rel), data)
        except self._errors() as exc:
            raise self._io("write", rel, exc) from exc


def _protocols(fs: Any) -> tuple[str, ...]:
    proto = getattr(fs, "protocol", ())
    return (proto,) if isinstance(proto, str) else tuple(proto)


def _copy_local(fi: IO[bytes], dst: str, chunk: int = 16 << 20) -> None:
    """Copy with fsync, so a committed manifest never points at bytes still in page cache."""
    tmp = f"{dst}.tmp-{uuid.uuid4().hex}"
    with os.fdopen(nofollow.create_private(tmp), "wb") as fo:
        while buf := fi.read(chunk):
            fo.write(buf)
        fo.flush()
        os.fsync(fo.fileno())
    os.replace(tmp, dst)


def fsync_dir(path: str) -> None:
    """fsync a directory so a rename inside it survives a power loss."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_tier(name: str, uri: str, env: Mapping[str, str], profile: str = "") -> FsspecTier:
    """Build a tier from a URI (env vars expanded with ``env``). s3:// gets env credentials."""
    uri = expand_env(uri, env)
    if uri.startswith(("s3://", "s3a://")):
        return FsspecTier(name, uri, _s3_filesystem(env, profile))
    try:
        fs, _ = fsspec.core.url_to_fs(uri)
    except (ImportError, ValueError) as exc:
        raise ConfigError(
            detected=f"checkpoint URI {uri!r} for the {name} tier cannot be opened ({exc})",
            requirement="a local path, memory:// or s3:// URI",
            fix="fix the URI or install the fsspec backend for its protocol",
        ) from exc
    return FsspecTier(name, uri, fs)
