"""Durable file writes: temp file + fsync + rename, writes past the page cache, stat identities.

Everything buildkit writes that a reader may see (store entries, published shards, locks)
goes through here, so "a reader sees a whole file or none" is one piece of code.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from buildkit.core.allocator import libc

RACY_TICK_NS = 2_000_000_000  # coarsest common filesystem timestamp resolution (FAT: 2 s)


def stat_ident(st: os.stat_result) -> list[int]:
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def file_ident(path: str | Path) -> list[int]:
    """What a stat record of a file is checked against: device, inode, size, mtime, ctime."""
    return stat_ident(os.stat(path))


def settle(path: str | Path) -> None:
    """Move the mtime of a file its writer has just closed, and that nobody else can see yet,
    two timestamp ticks into the past, so a stat record of it taken now is not racy: any later
    write sets the mtime to the present, which tells it apart."""
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, min(st.st_mtime_ns, time.time_ns() - 2 * RACY_TICK_NS)))


def start_writeback(fd: int) -> None:
    """Start writing a file's dirty pages to disk without waiting (Linux sync_file_range), so
    a later syncfs finds little left to wait for; a no-op elsewhere."""
    fn = getattr(libc(), "sync_file_range", None)
    if fn is not None:
        SYNC_FILE_RANGE_WRITE = 2
        fn(fd, ctypes.c_int64(0), ctypes.c_int64(0), SYNC_FILE_RANGE_WRITE)


def readahead(spans: Iterable[tuple[Path, int, int]]) -> None:
    """Read byte ranges (path, offset, length) through a small buffer, for the OS to keep in
    its page cache: the reads that follow come from memory. By hand, because
    posix_fadvise(WILLNEED) returned at once and left the range uncached on this project's
    Linux machines (a 700 MB range read in 0.48 s after it, as cold; 0.11 s after this), and
    macOS has no such call in Python. A file's holes are skipped: they read as zeros that the
    kernel makes on the CPU (a 35B-shaped sparse source: ~1 CPU s a layer, for nothing to
    cache). A hint: errors are left to the real read."""
    buf = memoryview(bytearray(8 << 20))
    for path, start, n in spans:
        try:
            with open(path, "rb", buffering=0) as f:
                for a, b in data_extents(f.fileno(), start, start + n):
                    f.seek(a)
                    while a < b and (k := f.readinto(buf[: min(b - a, len(buf))])):
                        a += k
        except OSError:
            continue


def data_extents(fd: int, start: int, end: int) -> Iterator[tuple[int, int]]:
    """The ranges of [start, end) of a file that hold data, its holes left out (SEEK_DATA and
    SEEK_HOLE); the whole range where the file system cannot tell."""
    at = start
    while at < end:
        try:
            a = os.lseek(fd, at, os.SEEK_DATA)
            b = os.lseek(fd, a, os.SEEK_HOLE)
        except OSError as e:
            if e.errno == errno.ENXIO:  # no data past ``at``
                return
            yield at, end  # no SEEK_DATA here: all of it
            return
        if a >= end:
            return
        yield a, min(b, end)
        at = b


def syncfs(path: Path) -> None:
    """Make everything written on ``path``'s file system durable (one call, not an fsync per
    file)."""
    fn = getattr(libc(), "syncfs", None)
    fd = os.open(path, os.O_RDONLY)
    try:
        if fn is None or fn(fd) != 0:
            os.sync()
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class _Buffers:
    """Page-aligned buffers for ``DirectFile``, kept for the next file once one is closed:
    a fresh mapping faults in every page it is written to (bench/RESULTS.md, "Speed tricks
    re-measured"). At most ``keep``
    idle buffers are kept, one per tensor worker; any more are unmapped on release."""

    def __init__(self, keep: int = 2):
        self.keep, self.idle, self.lock = keep, [], threading.Lock()

    def take(self, size: int) -> mmap.mmap:
        with self.lock:
            for i, buf in enumerate(self.idle):
                if len(buf) == size:
                    return self.idle.pop(i)
        return mmap.mmap(-1, size)

    def release(self, buf: mmap.mmap) -> None:
        with self.lock:
            if len(self.idle) < self.keep:
                self.idle.append(buf)
                return
        self._unmap([buf])

    def drop_idle(self) -> None:
        with self.lock:
            idle, self.idle = self.idle, []
        self._unmap(idle)

    @staticmethod
    def _unmap(bufs: list[mmap.mmap]) -> None:
        for buf in bufs:
            with contextlib.suppress(BufferError):  # a failed write's traceback may hold a view
                buf.close()


_buffers = _Buffers()


def drop_idle_write_buffers() -> None:
    """Unmap the buffers ``DirectFile`` keeps for the next file, before a phase that writes
    none and needs the memory (publish's load check)."""
    _buffers.drop_idle()


class DirectFile:
    """A new file written past the page cache where the OS allows it (Linux ``O_DIRECT``).

    Nothing reads store objects or published shards back soon enough to use their pages, and
    a fresh page cache page is dear on small VMs (bench/RESULTS.md, "Tried and not kept"). Bytes
    are gathered in a page-aligned buffer and written in whole blocks; the last block is padded
    and the file truncated to its length, then fsynced if ``sync`` (else a later syncfs makes it
    durable). If the file system refuses direct I/O, the rest goes through the page cache, as
    all of it does with ``direct=False`` or without ``O_DIRECT`` (macOS).
    """

    BLOCK = 4096
    FLAGS = os.O_WRONLY | os.O_CREAT | os.O_TRUNC

    def __init__(self, path: Path, size: int = 8 << 20, direct: bool = True, sync: bool = True):
        if size % self.BLOCK:
            raise ValueError(f"buffer size {size} is not a multiple of {self.BLOCK}")
        self.path, self.sync, self.length, self.pos, self.flushed = path, sync, 0, 0, 0
        self.fd = -1
        if direct and hasattr(os, "O_DIRECT"):
            with contextlib.suppress(OSError):
                self.fd = os.open(path, self.FLAGS | os.O_DIRECT, 0o644)
        self.direct = self.fd >= 0
        if not self.direct:
            self.fd = os.open(path, self.FLAGS, 0o644)
        self.buf = _buffers.take(size) if self.direct else None  # page-aligned, as direct I/O needs

    def __enter__(self) -> DirectFile:
        return self

    def write(self, data) -> int:
        data = memoryview(data).cast("B")
        n_in = len(data)
        self.length += n_in
        while data and self.direct:
            n = min(len(data), len(self.buf) - self.pos)
            self.buf[self.pos : self.pos + n] = data[:n]
            self.pos += n
            data = data[n:]
            if self.pos == len(self.buf):
                self._flush()
        self._write_out(data)  # what is left once direct I/O was refused; or all, buffered
        return n_in

    def _flush(self) -> None:
        end = self.pos + (-self.pos % self.BLOCK)  # only the last block is ever short
        self.buf[self.pos : end] = bytes(end - self.pos)
        self.pos = 0
        self._write_out(memoryview(self.buf)[:end])

    def _write_out(self, chunk: memoryview) -> None:
        while chunk:
            try:
                n = os.write(self.fd, chunk)
            except OSError as e:
                if not (self.direct and e.errno == errno.EINVAL):
                    raise
                os.close(self.fd)  # direct I/O refused: go on through the page cache
                self.fd, self.direct = os.open(self.path, os.O_WRONLY), False
                os.lseek(self.fd, self.flushed, os.SEEK_SET)
                continue
            chunk, self.flushed = chunk[n:], self.flushed + n

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                if self.pos:
                    self._flush()
                if self.flushed > self.length:
                    os.ftruncate(self.fd, self.length)  # drop the last block's padding
                if self.sync:
                    os.fsync(self.fd)
                elif not self.direct:
                    start_writeback(self.fd)
        finally:
            os.close(self.fd)
            if self.buf is not None:
                _buffers.release(self.buf)
                self.buf = None


class DirectRange:
    """Bytes ``[start, start + length)`` of an existing file, written in order past the page
    cache where the OS allows it: the whole blocks inside the range with ``O_DIRECT``, the
    partial blocks at its two ends (shared with whatever lies beside it in the file) through
    the page cache. So tasks may fill neighbouring ranges of one file at once (a pack's
    tensors) and no block is ever written both ways; writes through the page cache are
    throttled as dirty pages pile up (bench/RESULTS.md, "35B-shaped sparse source"). Direct I/O
    refused: the rest through the page cache, as ``DirectFile``. ``sync``: fsync the file once
    the range is written."""

    BLOCK = DirectFile.BLOCK

    def __init__(
        self, path: str | Path, start: int, length: int, size: int = 8 << 20, sync: bool = False
    ):
        self.pos, self.end, self.sync = start, start + length, sync
        self.lo = min(self.end, start + (-start % self.BLOCK))  # first whole block
        self.hi = max(self.lo, self.end - self.end % self.BLOCK)  # past the last whole one
        self.fd = os.open(path, os.O_WRONLY)
        self.dfd = -1
        if self.hi > self.lo and hasattr(os, "O_DIRECT"):
            with contextlib.suppress(OSError):
                self.dfd = os.open(path, os.O_WRONLY | os.O_DIRECT)
        self.buf = _buffers.take(size) if self.dfd >= 0 else None
        self.fill, self.at = 0, self.lo  # bytes gathered; where they go

    def __enter__(self) -> DirectRange:
        return self

    def write(self, data) -> None:
        data = memoryview(data).cast("B")
        while data:
            if self.buf is not None and self.lo <= self.pos < self.hi:
                n = min(len(data), self.hi - self.pos, len(self.buf) - self.fill)
                self.buf[self.fill : self.fill + n] = data[:n]
                self.fill += n
                if self.fill == len(self.buf) or self.pos + n == self.hi:
                    self._flush()
            else:  # buffered: the head up to the first whole block, the tail, or all of it
                direct_later = self.buf is not None and self.pos < self.lo
                n = min(len(data), self.lo - self.pos) if direct_later else len(data)
                _pwrite_all(self.fd, data[:n], self.pos)
            self.pos += n
            data = data[n:]

    def _flush(self) -> None:
        chunk = memoryview(self.buf)[: self.fill]  # whole blocks: the interior is
        try:
            _pwrite_all(self.dfd, chunk, self.at)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            _pwrite_all(self.fd, chunk, self.at)  # refused: this and the rest buffered
            self._close_direct()
        self.at += self.fill
        self.fill = 0

    def _close_direct(self) -> None:
        if self.dfd >= 0:
            os.close(self.dfd)
            self.dfd = -1
        if self.buf is not None:
            _buffers.release(self.buf)
            self.buf = None

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None and self.fill:
                self._flush()
            if exc_type is None and self.sync:
                os.fsync(self.fd)  # the file's, whichever descriptor wrote them
        finally:
            self._close_direct()
            os.close(self.fd)


def _pwrite_all(fd: int, data: memoryview, at: int) -> None:
    while data:
        k = os.pwrite(fd, data, at)
        data, at = data[k:], at + k


def write_temp(
    data: bytes | Iterable[bytes | memoryview],
    tmp_dir: Path,
    name: str,
    sync: bool,
    on_chunk=None,
    direct: bool = False,
) -> tuple[Path, int]:
    """Write bytes (or chunks) to a new temp file in ``tmp_dir``: (its path, its size). On any
    failure, the chunks' producer's included, the temp file is gone. ``direct``: past the page
    cache (``DirectFile``)."""
    tmp_dir.mkdir(parents=True, exist_ok=True)
    tmp = tmp_dir / f".{name}.{os.getpid()}.{threading.get_ident()}.{time.monotonic_ns()}.tmp"
    size = 0
    try:
        with DirectFile(tmp, direct=direct, sync=sync) as f:
            for chunk in [data] if isinstance(data, bytes | bytearray | memoryview) else data:
                if on_chunk is not None:
                    on_chunk(chunk)
                size += f.write(chunk)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    return tmp, size


def atomic_write(
    path: Path,
    data: bytes | Iterable[bytes | memoryview],
    tmp_dir: Path | None = None,
    sync_dir: bool = True,
    sync: bool = True,
) -> int:
    """Write bytes (or chunks) to ``path`` atomically: temp file, fsync, rename. Returns the size.

    ``sync=False, sync_dir=False`` is for store objects: they are made durable together by one
    syncfs before any listing that names them is written, and a torn object left by a power
    loss fails its digest check on read and is rebuilt.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp, size = write_temp(data, tmp_dir or path.parent, path.name, sync)
    try:
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    if sync_dir:
        fsync_dir(path.parent)
    return size
