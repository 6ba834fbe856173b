"""Verified downloads: byte ranges fetched in parallel, hashed in order, written once.

One pass over the bytes: while later ranges are still on the wire, the earliest finished
range is hashed and written to the local file (hashlib/zlib and os.write release the GIL,
so the download, the hash and the write overlap). Memory stays bounded by
``(workers + 1) * part_bytes``. The local file only appears under its final name once every
byte arrived; the caller compares the returned checksum with the manifest before anything
deserializes it.
"""

from __future__ import annotations

import os
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import IO

from slurmkit.store import nofollow
from slurmkit.store.manifest import Hasher

PART_BYTES = 16 << 20  # bytes per ranged GET
WORKERS = 4  # ranged GETs in flight per file

ReadRange = Callable[[int, int], bytes]  # (start, end exclusive) -> bytes


def ranges(size: int, part: int) -> list[tuple[int, int]]:
    """[start, end) pieces of ``part`` bytes covering ``size`` bytes."""
    return [(start, min(start + part, size)) for start in range(0, size, part)]


def fetch_hashed(read_range: ReadRange, size: int, local_path: str, algo: str, *,
                 part_bytes: int = PART_BYTES, workers: int = WORKERS) -> tuple[str, int]:
    """Download ``size`` bytes into ``local_path``; return (checksum, bytes received).

    A short read (the object is smaller than ``size``) ends the download early; the byte
    count then differs from ``size``, which the caller reports as a bad copy.
    """
    hasher = Hasher(algo)
    tmp = f"{local_path}.part-{uuid.uuid4().hex[:8]}"
    received = 0
    fd = nofollow.create_private(tmp)  # O_EXCL|O_NOFOLLOW: a planted link is not written
    try:
        todo = deque(ranges(size, part_bytes))
        with ThreadPoolExecutor(max_workers=max(1, workers),
                                thread_name_prefix="slurmkit-get") as pool:
            inflight: deque[tuple[int, int, Future[bytes]]] = deque()
            while todo or inflight:
                while todo and len(inflight) < max(1, workers):
                    start, end = todo.popleft()
                    inflight.append((start, end, pool.submit(read_range, start, end)))
                start, end, fut = inflight.popleft()
                data = memoryview(fut.result())
                hasher.update(data)
                _write_all(fd, data)
                received += len(data)
                if len(data) < end - start:  # object shorter than expected: stop here
                    for *_, f in inflight:
                        f.cancel()
                    break
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    os.replace(tmp, local_path)
    return hasher.hexdigest(), received


def copy_hashed(fi: IO[bytes], local_path: str, algo: str, chunk: int = 8 << 20
                ) -> tuple[str, int]:
    """Local copy of the open file ``fi`` (opened by the caller without following a link)
    with the checksum taken on the way (one read of the source)."""
    hasher = Hasher(algo)
    n = 0
    tmp = f"{local_path}.part-{uuid.uuid4().hex[:8]}"
    with os.fdopen(nofollow.create_private(tmp), "wb") as fo:
        while data := fi.read(chunk):
            hasher.update(data)
            fo.write(data)
            n += len(data)
    os.replace(tmp, local_path)
    return hasher.hexdigest(), n


def _write_all(fd: int, data: memoryview) -> None:
    done = 0
    while done < len(data):
        done += os.write(fd, data[done:])
