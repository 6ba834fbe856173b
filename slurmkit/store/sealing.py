"""A DCP storage writer that seals every file while writing it: one pass over the bytes.

Each byte DCP serializes passes through ``SealingStream.write`` once, where it is hashed
(the manifest checksum, so no second read pass) and written with O_DIRECT from reused
aligned buffers (the page cache where the filesystem refuses it); one fsync per file at the
end makes it durable. A file is recorded (name, checksum, size) only after its
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
import errno
import io
import logging
import mmap
import os
import threading
from collections.abc import Generator
from concurrent.futures import Future, ThreadPoolExecutor
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
from torch.futures import Future as TorchFuture

from slurmkit.store.manifest import Hasher
from slurmkit.store.tiertrust import private_fd

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
ALIGN = 4096  # O_DIRECT offsets, lengths and buffer addresses are multiples of this
CHUNK = 8 << 20  # bytes per direct write (a multiple of ALIGN)
_POOL_MAX = 8
_pool: list[mmap.mmap] = []
_pool_lock = threading.Lock()


def _take_buffer() -> mmap.mmap:
    """A page-aligned CHUNK-byte buffer, reused across files and saves."""
    with _pool_lock:
        while _pool:
            buf = _pool.pop()
            if len(buf) == CHUNK:
                return buf
            buf.close()
    return mmap.mmap(-1, CHUNK)


def _give_buffer(buf: mmap.mmap) -> None:
    with _pool_lock:
        if len(_pool) < _POOL_MAX:
            _pool.append(buf)
            return
    buf.close()


def _open_direct(path: str) -> int | None:
    """A second descriptor on ``path`` with O_DIRECT, or None where the OS or the filesystem
    does not offer it (tmpfs, some network filesystems): then the page cache path is used."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        return os.open(path, os.O_WRONLY | flag | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
            return None
        raise


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)


class SealingStream(io.RawIOBase):
    """Write-only file stream: hashes what it writes, fsyncs at seal.

    With ``direct`` (the default) the bytes bypass the page cache: they are hashed and copied
    into page-aligned buffers of CHUNK bytes, and a per-file I/O thread writes each full buffer
    with O_DIRECT while the next one fills (two buffers). The last partial block goes through
    the page cache at seal, before the one fsync. Copying into the page cache and writing it
    back cost more CPU than the hash on a busy node and halved the durable bandwidth; O_DIRECT
    writes are DMA from the buffer. Where the filesystem refuses O_DIRECT (at open or at the
    first write) the stream quietly uses the page cache instead.
    """

    def __init__(self, path: str, algo: str, *, direct: bool = True) -> None:
        super().__init__()
        self.path = path
        self._fd = private_fd(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC)
        self._hasher = Hasher(algo)
        self._pos = 0
        self._dfd: int | None = None
        try:
            self._dfd = _open_direct(path) if direct else None
        except BaseException:
            os.close(self._fd)
            raise
        self._cur: mmap.mmap | None = None
        self._spare: mmap.mmap | None = None
        self._fill = 0  # bytes in the current buffer
        self._flushed = 0  # file offset of the current buffer's first byte
        self._pending: Future[None] | None = None
        self._io: ThreadPoolExecutor | None = None
        if self._dfd is not None:
            self._cur, self._spare = _take_buffer(), _take_buffer()
            self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="slurmkit-dio")

    @property
    def direct(self) -> bool:
        """Whether the bytes are (still) written with O_DIRECT."""
        return self._dfd is not None

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def write(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        n = len(mv)
        self._hasher.update(mv)  # hashlib and zlib release the GIL on large buffers
        if self._cur is None:
            _pwrite_all(self._fd, mv, self._pos)
        else:
            i = 0
            while i < n:
                k = min(CHUNK - self._fill, n - i)
                self._cur[self._fill:self._fill + k] = mv[i:i + k]
                self._fill += k
                i += k
                if self._fill == CHUNK:
                    self._submit(CHUNK)
        self._pos += n
        return n

    def _submit(self, length: int) -> None:
        """Hand the first ``length`` bytes (aligned) of the current buffer to the I/O thread
        and continue in the spare one; the bytes after ``length`` move to its start."""
        assert self._cur is not None and self._spare is not None and self._io is not None
        self._wait_pending()  # the spare buffer is free once the previous write finished
        buf, offset = self._cur, self._flushed
        rest = self._fill - length
        if rest:
            self._spare[:rest] = buf[length:self._fill]
        self._pending = self._io.submit(self._write_buffer, buf, length, offset)
        self._cur, self._spare = self._spare, buf
        self._fill = rest
        self._flushed += length

    def _write_buffer(self, buf: mmap.mmap, length: int, offset: int) -> None:
        data = memoryview(buf)[:length]
        try:
            dfd = self._dfd
            if dfd is None:
                _pwrite_all(self._fd, data, offset)
                return
            try:
                _pwrite_all(dfd, data, offset)
            except OSError as exc:  # accepted at open, refused at write: use the page cache
                if exc.errno != errno.EINVAL:
                    raise
                log.info("O_DIRECT refused on %s (%s); writing through the page cache",
                         self.path, exc)
                self._dfd = None
                os.close(dfd)
                _pwrite_all(self._fd, data, offset)
        finally:
            data.release()

    def _wait_pending(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def seal(self) -> tuple[str, int]:
        """Write what is buffered, fsync and close; return (checksum, size) of everything."""
        try:
            if self._cur is not None:
                tail = self._fill % ALIGN
                if self._fill - tail:
                    self._submit(self._fill - tail)
                self._wait_pending()
                if tail:  # the last partial block: through the page cache, same file
                    _pwrite_all(self._fd, memoryview(self._cur)[:tail], self._flushed)
            os.fsync(self._fd)  # covers the O_DIRECT bytes too (device cache, size)
        finally:
            self.close()
        return self._hasher.hexdigest(), self._pos

    def close(self) -> None:
        if self.closed:
            return
        try:
            if self._io is not None:
                self._io.shutdown(wait=True)  # never free a buffer a write still reads
                self._io = None
        finally:
            for buf in (self._cur, self._spare):
                if buf is not None:
                    _give_buffer(buf)
            self._cur = self._spare = None
            if self._dfd is not None:
                os.close(self._dfd)
                self._dfd = None
            os.close(self._fd)
            super().close()


class SealingFileSystem(FileSystem):
    """DCP's local FileSystem whose write streams seal; records (checksum, size) per name."""

    def __init__(self, algo: str, direct: bool = True) -> None:
        super().__init__()
        self.algo = algo
        self.direct = direct
        self.sealed: dict[str, tuple[str, int]] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str
                      ) -> Generator[io.IOBase, None, None]:
        if "w" not in mode:
            with super().create_stream(path, mode) as s:
                yield s
            return
        stream = SealingStream(os.fspath(path), self.algo, direct=self.direct)
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

    def __init__(self, path: str, *, algo: str, thread_count: int, direct: bool = True) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=False,
                         thread_count=thread_count)
        self.fs = SealingFileSystem(algo, direct)

    @property
    def sealed(self) -> dict[str, tuple[str, int]]:
        return dict(self.fs.sealed)  # type: ignore[attr-defined]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> TorchFuture[list[WriteResult]]:
        prefix = plan.storage_data.prefix
        # within a file, the state's own order: the order in which a snapshot fills buffers
        order = {id(item): n for n, item in enumerate(plan.items)}
        jobs = [(f"{prefix}{n}.distcp", sorted(bucket, key=lambda i: order[id(i)]))
                for n, bucket in enumerate(split_items(plan.items, self.thread_count))]
        with ThreadPoolExecutor(max_workers=len(jobs), thread_name_prefix="slurmkit-seal") as pool:
            parts = list(pool.map(lambda job: self._write_file(job[0], job[1], planner), jobs))
        fut: TorchFuture[list[WriteResult]] = TorchFuture()
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
