"""Content-addressed store.

Layout under the root (default ``cache/``)::

    objects/ab/<hex>      tensor bytes or file bytes, named by their digest
    artifacts/ab/<hex>    artifact listings (canonical JSON), named by their digest
    actions/ab/<hex>      action records: cache key -> named output artifacts
    sources/ab/<hex>      stat cache for files outside the store (sources, published
                          shards): path -> digest, and digest -> paths
    refs/<name>.json      keys of the last build of a variant (roots for gc), its graph's topology
    locks/, tmp/

Every write is temp file + fsync + rename, so a reader sees a whole entry or
none. A corrupt or missing entry is a miss: it is reported, removed and
rebuilt, never served.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import itertools
import json
import mmap
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

from . import keys
from .allocator import libc
from .errors import SourceError, StoreError, StoreMiss
from .lazy import lazy
from .tensors import DTYPES, Header, byte_view, nbytes, read_header, read_slice, read_tensor

np = lazy("numpy", __name__)

RACY_TICK_NS = 2_000_000_000  # coarsest common filesystem timestamp resolution (FAT: 2 s)


def _fan(root: Path, digest: str) -> Path:
    h = digest.removeprefix(keys.PREFIX)
    return root / h[:2] / h[2:]


def _ident(st: os.stat_result) -> list[int]:
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def file_ident(path: str | Path) -> list[int]:
    """What a stat record of a file is checked against: device, inode, size, mtime, ctime."""
    return _ident(os.stat(path))


def settle(path: str | Path) -> None:
    """Move the mtime of a file its writer has just closed, and that nobody else can see yet,
    two timestamp ticks into the past. A stat record of it taken now is then not racy (see
    ``digest_file``): any later write sets the mtime to the present, which tells it apart."""
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, min(st.st_mtime_ns, time.time_ns() - 2 * RACY_TICK_NS)))


# Blocks of rows a step reads, makes and writes at a time (``Store.iter_rows``): memory is a
# block, not the largest tensor, and blocks this size stay below glibc's largest mmap threshold
# (32 MiB), so their buffers are reused instead of mapped fresh: one real-size 512 MiB expert
# tensor quantized in 1.3-1.4 s (0.2 s system) in 8 MiB blocks against 2.4-3.2 s (1.0-1.6 s
# system, 1 GB peak) whole.
ROW_BLOCK_BYTES = 8 << 20
HASH_CHUNK = 4 << 20  # source files are hashed through a buffer of this size
HASH_READERS = 4  # source files hashed at once


def start_writeback(fd: int) -> None:
    """Start writing a file's dirty pages to disk without waiting (Linux sync_file_range), so
    a later ``sync_objects`` finds little left to wait for; a no-op elsewhere."""
    fn = getattr(libc(), "sync_file_range", None)
    if fn is not None:
        SYNC_FILE_RANGE_WRITE = 2
        fn(fd, ctypes.c_int64(0), ctypes.c_int64(0), SYNC_FILE_RANGE_WRITE)


def fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class _Buffers:
    """Page-aligned buffers for ``DirectFile``, kept for the next file once one is closed.

    A fresh anonymous mapping faults in every page it is written to, and a page fault is dear
    on this project's VMs: a new buffer for every store object cost a cold xl build of the
    bench fixture 150 000-270 000 faults and about 1.3 s of system time (six alternating
    rounds). At most ``keep`` idle buffers are kept, one for each tensor worker (16 MB
    resident); any more are unmapped on release."""

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
    none and needs the memory (publish's load check, a build's peak)."""
    _buffers.drop_idle()


class DirectFile:
    """A new file written past the page cache where the OS allows it (Linux ``O_DIRECT``).

    Writing a new file through the page cache takes a fresh page per 4 KiB; on this project's
    VMs that costs 5-7 s of system time per GB (720 MB of zeros: 7.6 s buffered, 0.3 s
    direct). Store objects and published shards are written this way: nothing reads them back
    soon enough to use their pages. Bytes are gathered in a page-aligned buffer and written in
    whole blocks; the last block is padded and the file truncated to its length, then
    fsynced if ``sync`` (else a later syncfs makes it durable, as ``Store.sync_objects``
    does). If the file system refuses direct I/O, the rest goes through the page cache, as
    all of it does with ``direct=False`` or without ``O_DIRECT`` (macOS).
    """

    BLOCK = 4096
    FLAGS = os.O_WRONLY | os.O_CREAT | os.O_TRUNC

    def __init__(self, path: Path, size: int = 8 << 20, direct: bool = True, sync: bool = True):
        assert size % self.BLOCK == 0
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


def _write_temp(
    data: bytes | Iterable[bytes | memoryview], tmp_dir: Path, name: str, sync: bool, on_chunk=None, direct: bool = False
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

    ``sync=False, sync_dir=False`` is for store objects: they are made durable together by
    ``Store.sync_objects`` before any listing that names them is written, and a torn object
    left by a power loss fails its digest check on read and is rebuilt.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp, size = _write_temp(data, tmp_dir or path.parent, path.name, sync)
    try:
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    if sync_dir:
        fsync_dir(path.parent)
    return size


@dataclass
class Artifact:
    """A named tree of tensors and small files, addressed by the digest of its listing.

    ``tensors`` maps name -> {"dtype", "shape", "digest"} for store objects, or
    {"dtype", "shape", "view": {"file", "tensor", "slice"?}} for a byte range of
    an external source file (identified by content digest, never by path).
    ``files`` maps name -> blob digest. ``meta`` is free-form canonical JSON.
    """

    tensors: dict[str, dict] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)
    external: dict[str, str] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)

    def listing(self) -> dict:
        return {
            "tensors": self.tensors,
            "files": self.files,
            "external": self.external,
            "meta": self.meta,
        }

    @property
    def digest(self) -> str:
        return keys.digest_json("artifact", self.listing())

    @classmethod
    def from_listing(cls, d: dict) -> Artifact:
        return cls(
            dict(d.get("tensors", {})),
            dict(d.get("files", {})),
            dict(d.get("external", {})),
            dict(d.get("meta", {})),
        )

    def tensor_bytes(self) -> int:
        return sum(nbytes(t["dtype"], t["shape"]) for t in self.tensors.values())


@dataclass
class Stats:
    """Bytes through the store, counted from every thread that reads or writes it."""

    bytes_read: int = 0
    bytes_written: int = 0
    objects_written: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, read: int = 0, written: int = 0, objects: int = 0) -> None:
        with self._lock:  # ``+=`` on an attribute is not atomic across threads
            self.bytes_read += read
            self.bytes_written += written
            self.objects_written += objects


class Store:
    def __init__(self, root: str | Path):
        self.root = Path(root).absolute()
        try:
            for d in ("objects", "artifacts", "actions", "sources", "refs", "locks", "tmp"):
                (self.root / d).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(f"cannot use store at {self.root}: {e.strerror}") from e
        self.stats = Stats()
        self._sources_lock = threading.Lock()
        self._unsynced = False
        self._headers: dict[str, Header] = {}
        self._resolved: dict[str, tuple[Path, list[int]]] = {}

    # ---- objects -------------------------------------------------------------------

    def object_path(self, digest: str) -> Path:
        return _fan(self.root / "objects", digest)

    def has_object(self, digest: str) -> bool:
        return self.object_path(digest).exists()

    def _put_object(self, digest: str, chunks: Iterable[bytes | memoryview]) -> str:
        path = self.object_path(digest)
        if path.exists():
            return digest
        size = atomic_write(path, chunks, self.root / "tmp", sync_dir=False, sync=False)
        self.stats.add(written=size, objects=1)
        self._unsynced = True
        return digest

    def sync_objects(self) -> None:
        """Make every object written so far durable: one syncfs of the store's filesystem
        instead of an fsync per object (each of which would wait for the disk in turn)."""
        if not self._unsynced:
            return
        self._unsynced = False  # before syncing: an object written meanwhile sets it again
        syncfs = getattr(libc(), "syncfs", None)
        fd = os.open(self.root / "objects", os.O_RDONLY)
        try:
            if syncfs is None or syncfs(fd) != 0:
                os.sync()
        finally:
            os.close(fd)

    def put_tensor(self, dtype: str, arr: np.ndarray) -> dict:
        """Store a tensor given as a numpy array of its storage dtype; returns its entry."""
        arr = np.ascontiguousarray(arr, dtype=DTYPES[dtype])
        data = memoryview(arr).cast("B")
        digest = keys.tensor_digest(dtype, arr.shape, data)
        self._put_object(digest, [data])
        return {"dtype": dtype, "shape": list(arr.shape), "digest": digest}

    def put_tensor_chunks(self, dtype: str, shape: list[int] | tuple[int, ...], chunks: Iterable[np.ndarray]) -> dict:
        """Store a tensor given as consecutive blocks (numpy arrays of its storage dtype) without
        holding it whole: hashed as it is written, named by its digest once all of it is."""
        h = keys.tensor_hasher(dtype, shape)
        tmp, size = _write_temp(
            (memoryview(np.ascontiguousarray(c, dtype=DTYPES[dtype])).cast("B") for c in chunks),
            self.root / "tmp", "tensor", sync=False, on_chunk=h.update, direct=True,
        )
        try:
            if size != nbytes(dtype, shape):
                raise StoreError(f"tensor blocks add up to {size} bytes, expected {nbytes(dtype, shape)} for {dtype}{list(shape)}")
            digest = keys.finish(h)
            path = self.object_path(digest)
            if path.exists():
                tmp.unlink()
            else:
                path.parent.mkdir(parents=True, exist_ok=True)
                os.replace(tmp, path)
                self.stats.add(written=size, objects=1)
                self._unsynced = True
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            raise
        return {"dtype": dtype, "shape": list(shape), "digest": digest}

    def put_row_blocks(self, rows: int, blocks: Iterable[dict[str, tuple[np.ndarray, str]]], stream: str) -> dict[str, dict]:
        """Tensors made together block by block along their first axis (``rows`` rows in all),
        each block a dict name -> (array, dtype): tensor ``stream`` is written as its blocks
        come, the others (small: a quantized weight's scales and biases) are joined at the end."""
        blocks = iter(blocks)
        first = next(blocks)  # dtypes and trailing dims are known once one block is made
        rest: dict[str, list] = {k: [] for k in first if k != stream}

        def streamed():
            for block in itertools.chain([first], blocks):
                for k, (arr, _) in block.items():
                    if k != stream:
                        rest[k].append(arr)
                yield block[stream][0]

        arr, dtype = first[stream]
        out = {stream: self.put_tensor_chunks(dtype, [rows, *arr.shape[1:]], streamed())}
        for k, parts in rest.items():
            out[k] = self.put_tensor(first[k][1], np.concatenate(parts))
        return out

    def put_blob(self, data: bytes) -> str:
        return self._put_object(keys.blob_digest(data), [data])

    def get_blob(self, digest: str) -> bytes:
        data = self._read_object(digest)
        if keys.blob_digest(data) != digest:
            raise self._corrupt(digest)
        return data

    def _read_object(self, digest: str) -> bytes:
        path = self.object_path(digest)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise self._missing(digest) from None
        self.stats.add(read=len(data))
        return data

    def _missing(self, digest: str) -> StoreMiss:
        return StoreMiss(f"store object {keys.short(digest)} is missing from {self.root}; rebuild")

    def _corrupt(self, digest: str) -> StoreMiss:
        """Quarantine an object whose bytes do not match its digest; the miss to raise."""
        self._quarantine(self.object_path(digest), "content does not match its digest")
        return StoreMiss(f"store object {keys.short(digest)} was corrupt and has been removed; rebuild")

    def read_tensor(self, entry: dict, verify: bool = True) -> np.ndarray:
        """Read a tensor entry (store object or source view) as a storage-dtype array."""
        dtype, shape = entry["dtype"], tuple(entry["shape"])
        if "view" in entry:
            return self._read_view(entry["view"], dtype, shape)
        data = self._read_object(entry["digest"])
        if len(data) != nbytes(dtype, shape) or (
            verify and keys.tensor_digest(dtype, shape, data) != entry["digest"]
        ):
            raise self._corrupt(entry["digest"])
        return np.frombuffer(data, dtype=DTYPES[dtype]).reshape(shape)

    def iter_rows(self, entry: dict, max_bytes: int = ROW_BLOCK_BYTES) -> Iterator[np.ndarray]:
        """A tensor entry as consecutive blocks along its first axis, each at most ``max_bytes``
        (but at least one row), read one at a time: memory is a block, not the tensor.

        A store object is checked against its digest as it passes; a mismatch quarantines it and
        raises StoreMiss after the last block (the caller discards what it made of them).
        """
        dtype, shape = entry["dtype"], tuple(entry["shape"])
        if not shape or shape[0] == 0:
            yield self.read_tensor(entry)
            return
        n = shape[0]
        row = nbytes(dtype, shape) // n
        step = max(1, max_bytes // max(row, 1))
        if "view" in entry:
            path, header = self.header(entry["view"]["file"])
            info = header.tensors.get(entry["view"]["tensor"])
            slc = entry["view"].get("slice")
            sliced = list(info.shape) if info is not None else []
            if slc is not None and sliced:
                sliced[slc[0]] = slc[2] - slc[1]
            if info is None or info.dtype != dtype or tuple(sliced) != shape or (slc is not None and slc[0] == 0):
                # Not rows of its source as they lie (a reshaped view, say; or gone, which
                # read_tensor reports): read whole, still handed out in blocks.
                whole = self.read_tensor(entry)
                for a in range(0, n, step):
                    yield whole[a : a + step]
                return
            stride = info.nbytes // info.shape[0]
            for a in range(0, n, step):
                b = min(n, a + step)
                part = replace(info, shape=(b - a, *info.shape[1:]), start=info.start + a * stride, end=info.start + b * stride)
                arr = read_slice(part, path, *slc) if slc is not None else read_tensor(part, path)
                self.stats.add(read=arr.nbytes)
                yield arr
            return
        digest = entry["digest"]
        h = keys.tensor_hasher(dtype, shape)
        try:
            f = open(self.object_path(digest), "rb", buffering=0)
        except FileNotFoundError:
            raise self._missing(digest) from None
        with f:
            for a in range(0, n, step):
                b = min(n, a + step)
                arr = np.empty((b - a, *shape[1:]), DTYPES[dtype])
                view = byte_view(arr)
                got = 0
                while got < len(view) and (k := f.readinto(view[got:])):
                    got += k
                if got < len(view):
                    raise self._corrupt(digest)  # shorter than its shape
                h.update(view)
                self.stats.add(read=got)
                yield arr
            if f.read(1) or keys.finish(h) != digest:
                raise self._corrupt(digest)

    def copy_tensor(self, entry: dict, sink, buf: bytearray) -> int:
        """Stream a tensor entry's bytes to ``sink(memoryview)`` through ``buf``; returns the count.

        Store objects are checked against their digest as they pass; a mismatch quarantines the
        object and raises StoreMiss after the bytes went to ``sink`` (the caller discards them).
        """
        if "view" in entry:
            data = memoryview(self.read_tensor(entry)).cast("B")
            sink(data)
            return len(data)
        digest, want = entry["digest"], nbytes(entry["dtype"], entry["shape"])
        h = keys.tensor_hasher(entry["dtype"], entry["shape"])
        view, done = memoryview(buf), 0
        try:
            f = open(self.object_path(digest), "rb", buffering=0)
        except FileNotFoundError:
            raise self._missing(digest) from None
        with f:
            while n := f.readinto(view[: min(len(buf), want - done + 1)]):
                h.update(view[:n])
                sink(view[:n])
                done += n
        self.stats.add(read=done)
        if done != want or keys.finish(h) != digest:
            raise self._corrupt(digest)
        return done

    def header(self, file_digest: str) -> tuple[Path, Header]:
        """Path and parsed header of a source file, by content digest (headers cached per process)."""
        path = self.resolve_external(file_digest)
        h = self._headers.get(file_digest)
        if h is None:
            h = self._headers[file_digest] = read_header(path)
        return path, h

    def _read_view(self, view: dict, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
        path, header = self.header(view["file"])
        info = header.tensors.get(view["tensor"])
        if info is None:
            raise SourceError(f"{path}: tensor {view['tensor']!r} is missing")
        if "slice" in view:
            arr = read_slice(info, path, *view["slice"])
        else:
            arr = read_tensor(info, path)
        if arr.dtype != DTYPES[dtype] or arr.size != int(np.prod(shape, dtype=np.int64)):
            raise SourceError(f"{path}: tensor {view['tensor']!r} no longer matches its recorded {dtype}{list(shape)}")
        self.stats.add(read=arr.nbytes)
        return arr.reshape(shape)

    def _quarantine(self, path: Path, why: str) -> None:
        print(f"buildkit: warning: {path}: {why}; removed", file=sys.stderr)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()

    # ---- external (source) files -------------------------------------------------

    def digest_file(self, path: str | Path, rehash: bool = False) -> str:
        """Content digest of a source file, remembered by (dev, inode, size, mtime, ctime).

        A remembered digest is trusted only if it was recorded more than one
        filesystem timestamp tick after the file's mtime (the racy-git rule).
        """
        return self.digest_files([path], rehash)[0]

    def digest_files(self, paths: Iterable[str | Path], rehash: bool = False, on_hash: Callable[[int], None] | None = None) -> list[str]:
        """``digest_file`` of each path; the files not remembered are hashed ``HASH_READERS``
        at a time (a disk serves several streams faster than one: four cold shards took
        0.8 s instead of 1.0-1.7 s on this project's machines). ``on_hash(bytes)`` is called
        once with their total size before the first of them is read, if any is."""
        paths = [Path(p).absolute() for p in paths]
        known = {p: None if rehash else self._remembered(p) for p in paths}
        todo = [p for p, d in known.items() if d is None]
        if todo and on_hash is not None:
            on_hash(sum(p.stat().st_size for p in todo))
        if len(todo) == 1:
            known[todo[0]] = self._hash_file(todo[0])
        elif todo:
            with ThreadPoolExecutor(min(HASH_READERS, len(todo)), thread_name_prefix="hash") as ex:
                known.update(zip(todo, ex.map(self._hash_file, todo)))
        return [known[p] for p in paths]

    def _remembered(self, path: Path) -> str | None:
        st = path.stat()
        with contextlib.suppress(FileNotFoundError, ValueError, KeyError):
            e = json.loads(self._source_entry(path).read_text())
            if e["stat"] == _ident(st) and e["recorded_ns"] - st.st_mtime_ns > RACY_TICK_NS:
                return e["digest"]
        return None

    def _source_entry(self, path: Path) -> Path:
        return _fan(self.root / "sources", keys.digest_json("path", str(path)))

    def _hash_file(self, path: Path) -> str:
        """Hash a file and remember its digest under its stat (taken before reading)."""
        ident = _ident(path.stat())
        h = keys.blob_hasher()
        buf = bytearray(HASH_CHUNK)  # one buffer, refilled: no fresh pages for every chunk
        view = memoryview(buf)
        with open(path, "rb", buffering=0) as f:
            # Read once, front to back: Linux doubles the readahead window. Four cold shards of
            # the bench fixture hashed at 1.29-1.59 GB/s against 1.13-1.49 GB/s without it.
            if hasattr(os, "posix_fadvise"):
                with contextlib.suppress(OSError):  # a hint: a file system may refuse it
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
            while n := f.readinto(buf):
                h.update(view[:n])
                self.stats.add(read=n)
        digest = keys.finish(h)
        self._remember(path, ident, digest)
        return digest

    def remember_file(self, path: str | Path, digest: str, ident: list[int]) -> None:
        """Remember the digest of a file the caller wrote and hashed as it wrote it, under the
        stat it took then (``file_ident``), so ``find_local`` can hand it out without reading
        it."""
        self._remember(Path(path).absolute(), ident, digest)

    def _remember(self, path: Path, ident: list[int], digest: str) -> None:
        """Record ``path``'s digest under its stat. Files that share its inode (hard links) share
        its bytes: their records move to the new stat too, since linking and unlinking change
        the inode's ctime.

        The path is listed under its digest before its own record is written: a build killed in
        between leaves a path listed but not remembered, which the next build hashes and
        records. The other order would leave a remembered path that ``find_local`` cannot find
        by its digest, and every build after it would fail to resolve the source."""
        rec = {"path": str(path), "stat": ident, "digest": digest, "recorded_ns": time.time_ns()}
        by_digest = _fan(self.root / "sources", digest)
        # Two files with the same content: both paths are kept, whichever threads or processes
        # hash them (the list is read, extended and written back under both locks).
        with self._sources_lock, self.lock(keys.digest_json("sources", digest)):
            paths = set()
            with contextlib.suppress(FileNotFoundError, ValueError):
                paths = set(json.loads(by_digest.read_text()))
            if str(path) not in paths:
                atomic_write(by_digest, keys.canonical_json(sorted(paths | {str(path)})), self.root / "tmp")
            atomic_write(self._source_entry(path), keys.canonical_json(rec), self.root / "tmp")
            for other in sorted(paths - {str(path)}):
                with contextlib.suppress(FileNotFoundError, ValueError, KeyError):
                    e = json.loads(self._source_entry(Path(other)).read_text())
                    if e["digest"] == digest and e["stat"][:2] == ident[:2]:
                        e["stat"] = ident
                        atomic_write(self._source_entry(Path(other)), keys.canonical_json(e), self.root / "tmp")

    def find_local(self, digest: str) -> Path | None:
        """A local path whose current content has this digest, if the store knows one (its
        stat checked on every call). Files whose stat vouches for the digest come first; one
        whose stat changed is hashed again only if none does."""
        known = self._resolved.get(digest)
        if known is not None:
            path, ident = known
            with contextlib.suppress(OSError):
                if _ident(path.stat()) == ident:
                    return path
        paths: list[Path] = []
        with contextlib.suppress(FileNotFoundError, ValueError):
            paths = [Path(p) for p in json.loads(_fan(self.root / "sources", digest).read_text())]
        for check in (self._remembered, self.digest_file):
            for p in paths:
                with contextlib.suppress(OSError):
                    if check(p) == digest:
                        self._resolved[digest] = (p, _ident(p.stat()))
                        return p
        return None

    def resolve_external(self, digest: str) -> Path:
        """A local path whose current content has this digest (checked by stat on every call)."""
        path = self.find_local(digest)
        if path is not None:
            return path
        raise SourceError(
            f"no local file has content {keys.short(digest)} any more (the source changed "
            "or moved since it was fetched); run the build again to re-fetch"
        )

    # ---- artifacts -----------------------------------------------------------------

    def put_artifact(self, art: Artifact) -> str:
        self.sync_objects()  # the listing must never be durable before the objects it names
        digest = art.digest
        path = _fan(self.root / "artifacts", digest)
        if not path.exists():
            atomic_write(path, keys.canonical_json(art.listing()), self.root / "tmp")
        return digest

    def get_artifact(self, digest: str) -> Artifact:
        path = _fan(self.root / "artifacts", digest)
        try:
            listing = json.loads(path.read_bytes())
            art = Artifact.from_listing(listing)
        except FileNotFoundError:
            raise StoreMiss(f"artifact {keys.short(digest)} is missing; rebuild") from None
        except (ValueError, AttributeError):
            self._quarantine(path, "listing is not valid JSON")
            raise StoreMiss(f"artifact {keys.short(digest)} was corrupt; rebuild") from None
        if art.digest != digest:
            self._quarantine(path, "listing does not match its digest")
            raise StoreMiss(f"artifact {keys.short(digest)} was corrupt; rebuild")
        return art

    def artifact_complete(self, digest: str) -> bool:
        """The listing is intact and every object it names exists with the right size."""
        try:
            art = self.get_artifact(digest)
        except StoreError:
            return False
        for t in art.tensors.values():
            if "digest" in t:
                p = self.object_path(t["digest"])
                try:
                    if p.stat().st_size != nbytes(t["dtype"], t["shape"]):
                        self._quarantine(p, "wrong size")
                        return False
                except FileNotFoundError:
                    return False
        return all(self.has_object(d) for d in art.files.values())

    def record_files(self, action_keys: Iterable[str], artifacts: Iterable[str]) -> list[Path]:
        """The store files a build that finds these keys cached reads: their action records,
        the artifact listings and the objects those name (a view's source file is not here)."""
        paths = [_fan(self.root / "actions", k) for k in action_keys]
        for digest in dict.fromkeys(artifacts):  # nodes may share an output: read it once
            paths.append(_fan(self.root / "artifacts", digest))
            art = self.get_artifact(digest)
            paths += [self.object_path(t["digest"]) for t in art.tensors.values() if "digest" in t]
            paths += [self.object_path(d) for d in art.files.values()]
        return list(dict.fromkeys(paths))

    # ---- actions -------------------------------------------------------------------

    def get_action(self, key: str) -> dict | None:
        """The recorded outputs for a cache key, or None if absent, corrupt or incomplete."""
        path = _fan(self.root / "actions", key)
        try:
            rec = json.loads(path.read_bytes())
            outputs = rec["outputs"]
            assert rec["key"] == key and isinstance(outputs, dict)
        except FileNotFoundError:
            return None
        except (ValueError, KeyError, AssertionError, TypeError):
            self._quarantine(path, "action record is corrupt")
            return None
        if not all(self.artifact_complete(d) for d in outputs.values()):
            return None
        return rec

    def put_action(self, key: str, record: dict) -> None:
        atomic_write(_fan(self.root / "actions", key), keys.canonical_json(record), self.root / "tmp")

    @contextlib.contextmanager
    def lock(self, name: str) -> Iterator[None]:
        """An exclusive inter-process lock (flock) held for the duration of the block."""
        path = self.root / "locks" / (keys.short(name, 32) + ".lock")
        with open(path, "a+") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)

    @contextlib.contextmanager
    def in_use(self, exclusive: bool = False) -> Iterator[None]:
        """Builds hold the store shared; gc holds it exclusively and never waits for a build."""
        with open(self.root / "locks" / "store.lock", "a+") as f:
            try:
                fcntl.flock(f.fileno(), (fcntl.LOCK_EX | fcntl.LOCK_NB) if exclusive else fcntl.LOCK_SH)
            except BlockingIOError:
                raise StoreError(
                    f"a build is using the store {self.root}; run gc again when it has finished"
                ) from None
            try:
                yield
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)

    # ---- refs and gc ---------------------------------------------------------------

    def set_ref(self, name: str, value: dict) -> None:
        atomic_write(self.root / "refs" / f"{name}.json", keys.canonical_json(value), self.root / "tmp")

    def get_ref(self, name: str) -> dict | None:
        with contextlib.suppress(FileNotFoundError, ValueError):
            return json.loads((self.root / "refs" / f"{name}.json").read_text())
        return None

    def refs(self) -> dict[str, dict]:
        out = {}
        for p in sorted((self.root / "refs").glob("*.json")):
            with contextlib.suppress(ValueError):
                out[p.stem] = json.loads(p.read_text())
        return out

    def gc(self, dry_run: bool = False) -> dict:
        """Remove actions no ref names, then artifacts and objects no kept action reaches, and
        forget the hashes of files that no longer exist.

        Refuses (StoreError) while a build holds the store, whose new objects no ref names yet.
        """
        with self.in_use(exclusive=True):
            return self._gc(dry_run)

    def _gc(self, dry_run: bool) -> dict:
        keep_keys = {k for ref in self.refs().values() for k in ref.get("keys", {}).values()}
        live_arts: set[str] = set()
        removed = {"actions": 0, "artifacts": 0, "objects": 0, "bytes": 0}
        for p in sorted((self.root / "actions").glob("*/*")):
            key = keys.PREFIX + p.parent.name + p.name
            rec = None
            with contextlib.suppress(ValueError):
                rec = json.loads(p.read_bytes())
            if key in keep_keys and rec:
                live_arts.update(rec.get("outputs", {}).values())
            else:
                removed["actions"] += 1
                removed["bytes"] += p.stat().st_size
                if not dry_run:
                    p.unlink()
        live_objs: set[str] = set()
        for d in live_arts:
            with contextlib.suppress(StoreError):
                art = self.get_artifact(d)
                live_objs.update(t["digest"] for t in art.tensors.values() if "digest" in t)
                live_objs.update(art.files.values())
        for sub, live, kind in (("artifacts", live_arts, "artifacts"), ("objects", live_objs, "objects")):
            for p in sorted((self.root / sub).glob("*/*")):
                if keys.PREFIX + p.parent.name + p.name not in live:
                    removed[kind] += 1
                    removed["bytes"] += p.stat().st_size
                    if not dry_run:
                        p.unlink()
        removed["files"], freed = self._forget_gone_files(dry_run)
        removed["bytes"] += freed
        if not dry_run:
            shutil.rmtree(self.root / "tmp", ignore_errors=True)
            (self.root / "tmp").mkdir(exist_ok=True)
        return removed

    def _forget_gone_files(self, dry_run: bool) -> tuple[int, int]:
        """Drop the stat records of files that no longer exist (a source deleted, a published
        directory removed or swapped out) from ``sources/``: path -> digest records, and those
        paths from the digest -> paths lists (a list left empty goes). Returns how many path
        records go and the bytes of the record files removed."""
        gone = freed = 0
        with self._sources_lock:
            for p in sorted((self.root / "sources").glob("*/*")):
                try:
                    rec = json.loads(p.read_text())
                except (OSError, ValueError):
                    continue
                if isinstance(rec, dict):  # path -> digest
                    if os.path.lexists(rec.get("path", "")):
                        continue
                    gone += 1
                elif isinstance(rec, list):  # digest -> paths
                    live = [q for q in rec if os.path.lexists(q)]
                    if live:
                        if live != rec and not dry_run:
                            atomic_write(p, keys.canonical_json(live), self.root / "tmp")
                        continue
                else:
                    continue
                freed += p.stat().st_size
                if not dry_run:
                    p.unlink()
        return gone, freed

    def check(self) -> list[str]:
        """Re-hash every object and listing; return a line per corrupt entry (and remove it)."""
        bad = []
        for p in sorted((self.root / "artifacts").glob("*/*")):
            d = keys.PREFIX + p.parent.name + p.name
            try:
                self.get_artifact(d)
            except StoreError as e:
                bad.append(str(e))
        tensor_shapes: dict[str, tuple[str, list[int]]] = {}
        blobs: set[str] = set()
        for p in sorted((self.root / "artifacts").glob("*/*")):
            with contextlib.suppress(Exception):
                listing = json.loads(p.read_bytes())
                blobs.update(listing["files"].values())
                for t in listing["tensors"].values():
                    if "digest" in t:
                        tensor_shapes[t["digest"]] = (t["dtype"], t["shape"])
        for p in sorted((self.root / "objects").glob("*/*")):
            d = keys.PREFIX + p.parent.name + p.name
            data = p.read_bytes()
            ok = keys.blob_digest(data) == d
            if not ok and d in tensor_shapes:
                ok = keys.tensor_digest(*tensor_shapes[d], data) == d
            elif not ok and d not in blobs:
                continue  # a tensor no listing names (its build was interrupted): unread, gc frees it
            if not ok:
                self._quarantine(p, "content does not match its digest")
                bad.append(f"object {keys.short(d)}: content does not match its digest")
        return bad
