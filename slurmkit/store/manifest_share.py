"""The root's manifest of one save, shared without sending it to every rank.

The manifest names every rank's files, so it grows with the job: broadcasting it made every
rank receive O(N) bytes per save. Each node's tier needs one copy on disk, not each rank: the
root publishes the body (compressed) under one key and broadcasts only its digest; in the commit, the
first rank of a node to take the tier lock fetches the body (checked against the digest) and
writes it, and the node's other ranks find it on disk, this save's by its digest.
"""

from __future__ import annotations

import base64
import hashlib
import zlib

from slurmkit.store.coord import CoordinationError, Coordinator
from slurmkit.store.manifest import Manifest


def digest(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


MAX_MANIFEST = 256 << 20  # bytes a fetched manifest may inflate to (16k ranks: ~5 MB)


def pack(body: bytes) -> str:
    """The body as sent: zlib (a manifest is repetitive JSON, ~8x smaller) in base64."""
    return base64.b64encode(zlib.compress(body, 6)).decode()


def unpack(wire: object) -> bytes:
    if not isinstance(wire, str):
        raise ValueError("not a packed manifest")
    z = zlib.decompressobj()
    out = z.decompress(base64.b64decode(wire, validate=True), MAX_MANIFEST)
    if z.unconsumed_tail or not z.eof:
        raise ValueError(f"inflates past {MAX_MANIFEST} bytes")
    return out


class SharedManifest:
    """One save's manifest as a rank knows it: step, digest, and the body on demand."""

    def __init__(self, coord: Coordinator, step: int, key: str, sha: str,
                 body: bytes | None = None) -> None:
        self.coord, self.step, self.key, self.sha = coord, step, key, sha
        self._body = body

    def matches(self, data: bytes | None) -> bool:
        return data is not None and digest(data) == self.sha

    def body(self) -> bytes:
        """The body (the root's own, or fetched once; call before this rank's next
        coordinator operation, which may reclaim the key)."""
        if self._body is None:
            try:
                data = unpack(self.coord.fetch(self.key))
            except (ValueError, zlib.error) as exc:
                raise CoordinationError(f"the manifest of step {self.step} fetched from the "
                                        f"root does not decode: {exc}") from exc
            if not self.matches(data):
                raise CoordinationError(f"the manifest of step {self.step} fetched from the "
                                        "root does not match the digest it announced")
            self._body = data
        return self._body

    def manifest(self, data: bytes | None = None) -> Manifest:
        """The parsed manifest: from ``data`` (this node's copy) when it is this save's."""
        return Manifest.from_json(data if data is not None and self.matches(data)
                                  else self.body())
