"""A DCP storage writer that seals every file while writing it: one pass over the bytes.

Each byte DCP serializes passes through ``SealingStream.write`` once, where it is hashed
(the manifest checksum, so no second read pass) and handed to the page cache; one fsync per
file at the end makes it durable. A file is recorded (name, checksum, size) only after its
fsync returned; a stream that fails is closed without a record. (Starting writeback early
with ``sync_file_range`` every 16 MiB was measured and dropped: with two files written at
once it tripled the kernel CPU time of a save and made it slower on ext4.)

The on-disk format is plain DCP (``FileSystemReader`` and ``dcp.load`` read it). One
difference in how the bytes are made: ``torch.save`` inside DCP normally computes a zip
CRC32 per record, in a single-threaded pass slower than the disk; our writer threads skip it
(``torch.load`` does not check it) because the manifest checksum covers every byte anyway.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import threading
from collections.abc import Generator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.serialization
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem, _StorageInfo
from torch.distributed.checkpoint.planner import (
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from slurmkit.store.manifest import Hasher

log = logging.getLogger(__name__)
# -- torch.save's zip CRC32, off for our writer threads only ------------------------------
_tls = threading.local()
_switch_lock = threading.Lock()
_switch_installed = False


def _install_crc_switch() -> None:
    """Route torch.save's CRC32 option through a per-thread flag (once per process).

    torch's own setting (``torch.serialization.set_crc32_options``) is process-wide; changing
    it would also change the trainer's concurrent ``torch.save`` calls. The wrapper returns
    torch's setting unchanged on every other thread. If a torch version stops reading the
    option through this module attribute, the wrapper is simply not consulted (slower, same
    bytes on disk apart from the zip CRC fields).
    """
    global _switch_installed
    with _switch_lock:
        original = getattr(torch.serialization, "get_crc32_options", None)
        if _switch_installed or original is None:
            return

        def get_crc32_options() -> bool:
            if getattr(_tls, "skip_zip_crc", False):
                return False
            return bool(original())

        torch.serialization.get_crc32_options = get_crc32_options
        _switch_installed = True


@contextlib.contextmanager
def _no_zip_crc() -> Generator[None, None, None]:
    _install_crc_switch()
    _tls.skip_zip_crc = True
    try:
        yield
    finally:
        _tls.skip_zip_crc = False


# -- the stream ------------------------------------------------------------------------
class SealingStream(io.RawIOBase):
    """Write-only file stream: hashes what it writes, fsyncs at seal."""

    def __init__(self, path: str, algo: str) -> None:
        super().__init__()
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        self._hasher = Hasher(algo)
        self._pos = 0

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    def tell(self) -> int:
        return self._pos

    def write(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        self._hasher.update(mv)  # hashlib and zlib release the GIL on large buffers
        done = 0
        while done < len(mv):
            done += os.write(self._fd, mv[done:])
        self._pos += len(mv)
        return len(mv)

    def seal(self) -> tuple[str, int]:
        """fsync and close; return (checksum, size) of everything written."""
        try:
            os.fsync(self._fd)
        finally:
            self.close()
        return self._hasher.hexdigest(), self._pos

    def close(self) -> None:
        if not self.closed:
            os.close(self._fd)
        super().close()


class SealingFileSystem(FileSystem):
    """DCP's local FileSystem whose write streams seal; records (checksum, size) per name."""

    def __init__(self, algo: str) -> None:
        super().__init__()
        self.algo = algo
        self.sealed: dict[str, tuple[str, int]] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str
                      ) -> Generator[io.IOBase, None, None]:
        if "w" not in mode:
            with super().create_stream(path, mode) as s:
                yield s
            return
        stream = SealingStream(os.fspath(path), self.algo)
        try:
            yield stream
        except BaseException:
            stream.close()  # no record: the caller drops the partial directory
            raise
        record = stream.seal()
        with self._lock:
            self.sealed[os.path.basename(stream.path)] = record

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        super().rename(path, new_path)
        with self._lock:
            record = self.sealed.pop(os.path.basename(os.fspath(path)), None)
            if record is not None:
                self.sealed[os.path.basename(os.fspath(new_path))] = record


# -- the storage writer ----------------------------------------------------------------
def _item_bytes(item: WriteItem) -> int:
    if item.tensor_data is None:
        return 0
    n = 1
    for s in item.tensor_data.size:
        n *= s
    return n * torch.empty((), dtype=item.tensor_data.properties.dtype).element_size()


def split_items(items: list[WriteItem], bins: int) -> list[list[WriteItem]]:
    """Byte items round robin, tensors largest first onto the lightest bin (like DCP)."""
    buckets: list[list[WriteItem]] = [[] for _ in range(max(1, bins))]
    sizes = [0] * len(buckets)
    blobs = [i for i in items if i.type == WriteItemType.BYTE_IO]
    for n, item in enumerate(blobs):
        buckets[n % len(buckets)].append(item)
    for item in sorted((i for i in items if i.type != WriteItemType.BYTE_IO),
                       key=_item_bytes, reverse=True):
        k = sizes.index(min(sizes))
        buckets[k].append(item)
        sizes[k] += _item_bytes(item)
    return buckets


class SealingWriter(FileSystemWriter):
    """DCP FileSystemWriter (same files, same metadata) writing through sealing streams.

    ``sealed``: file name -> (checksum, size) of every file this rank wrote and fsynced
    (rank 0 also ``.metadata``).
    """

    def __init__(self, path: str, *, algo: str, thread_count: int) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=False,
                         thread_count=thread_count)
        self.fs = SealingFileSystem(algo)

    @property
    def sealed(self) -> dict[str, tuple[str, int]]:
        return dict(self.fs.sealed)  # type: ignore[attr-defined]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        prefix = plan.storage_data.prefix
        # within a file, the state's own order: the order in which a snapshot fills buffers
        order = {id(item): n for n, item in enumerate(plan.items)}
        jobs = [(f"{prefix}{n}.distcp", sorted(bucket, key=lambda i: order[id(i)]))
                for n, bucket in enumerate(split_items(plan.items, self.thread_count))]
        with ThreadPoolExecutor(max_workers=len(jobs), thread_name_prefix="slurmkit-seal") as pool:
            parts = list(pool.map(lambda job: self._write_file(job[0], job[1], planner), jobs))
        fut: Future[list[WriteResult]] = Future()
        fut.set_result([r for part in parts for r in part])
        return fut

    def _write_file(self, name: str, items: list[WriteItem], planner: SavePlanner
                    ) -> list[WriteResult]:
        """One shard file: byte items first, then tensors (DCP's order), sealed at the end."""
        results = []
        path = os.path.join(os.fspath(self.path), name)
        ordered = [i for i in items if i.type == WriteItemType.BYTE_IO] + \
                  [i for i in items if i.type != WriteItemType.BYTE_IO]
        with _no_zip_crc(), self.fs.create_stream(path, "wb") as stream:
            for item in ordered:
                offset = stream.tell()
                _write_item(stream, planner.resolve_data(item))
                length = stream.tell() - offset
                results.append(WriteResult(index=item.index, size_in_bytes=length,
                                           storage_data=_StorageInfo(name, offset, length)))
        return results


def _write_item(stream: Any, data: Any) -> None:
    """One item in DCP's torch_save format: raw bytes, or torch.save of a CPU tensor."""
    if isinstance(data, io.BytesIO):
        stream.write(data.getbuffer())
        return
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"DCP resolved a write item to {type(data).__name__}")
    tensor = data.detach().cpu()
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        tensor = tensor.clone()  # torch.save writes a view's whole storage
    torch.save(tensor, stream)


__all__ = ["SealingFileSystem", "SealingStream", "SealingWriter", "split_items"]
