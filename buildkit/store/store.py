"""The content-addressed store: objects, artifact listings, action records, memos, refs, gc.

Layout under the root (default ``cache/``), the one place that names it (``Layout``)::

    objects/ab/<hex>       tensor or file bytes, named by their digest
    artifacts/ab/<hex>     artifact listings (canonical JSON), named by their digest
    actions/ab/<hex>       action records: cache key -> named output artifacts
    memos/<kind>/ab/<hex>  remembered facts that are not step outputs (a load check passed,
                           a shard written): a miss only costs the work again
    sources/               the source index (``sources.py``): file digests by stat
    refs/<variant>.json    the last build of a variant: each node's key and ingredients
                           (for rebuild reasons) and its graph's topology
    roots/<hex>.json       one per build request (variant, source, out): the keys gc keeps
    reports/               verify reports of failed builds, for the user to read
    fixtures/              generated fixture checkpoints (``fixture:`` sources)
    uptodate/              records of successful builds (``uptodate.py``)
    locks/, tmp/

Every write is temp file + fsync + rename (``fsio.py``), so a reader sees a whole entry or
none. A corrupt or missing entry is a miss: it is reported, removed and rebuilt, never served.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import os
import shutil
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

from buildkit.core import keys, workers
from buildkit.core.errors import SourceError, StoreError, StoreMiss
from buildkit.core.lazy import lazy
from buildkit.formats.tensors import (
    DTYPES,
    Header,
    block_read,
    byte_view,
    nbytes,
    read_header,
    read_row_blocks,
    read_slice,
    read_tensor,
)
from buildkit.store.artifact import Artifact, objects
from buildkit.store.fsio import atomic_write, readahead, syncfs, write_temp
from buildkit.store.layout import Layout, fan
from buildkit.store.sources import SourceIndex

np = lazy("numpy", __name__)

# Blocks of rows a step reads, makes and writes at a time (``Store.iter_rows``): memory is a
# block, not the largest tensor, and below glibc's 32 MiB mmap threshold a block's buffer is
# reused instead of mapped fresh (bench/RESULTS.md, "Speed tricks re-measured").
ROW_BLOCK_BYTES = 8 << 20
HASH_CHUNK = 4 << 20  # source files are hashed through a buffer of this size
HASH_READERS = 4  # source files hashed at once


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
        self.layout = Layout(root)
        self.root = self.layout.root
        try:
            for d in Layout.DIRS:
                getattr(self.layout, d).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(f"cannot use store at {self.root}: {e.strerror}") from e
        self.stats = Stats()
        self.sources = SourceIndex(self.layout.sources, self.layout.tmp, self.lock, self.stats)
        self._unsynced = False
        self._headers: dict[str, Header] = {}

    # ---- objects -------------------------------------------------------------------

    def object_path(self, digest: str) -> Path:
        return fan(self.layout.objects, digest)

    def has_object(self, digest: str) -> bool:
        return self.object_path(digest).exists()

    def _put_object(self, digest: str, chunks: Iterable[bytes | memoryview]) -> str:
        path = self.object_path(digest)
        if path.exists():
            return digest
        size = atomic_write(path, chunks, self.layout.tmp, sync_dir=False, sync=False)
        self.stats.add(written=size, objects=1)
        self._unsynced = True
        return digest

    def mark_unsynced(self) -> None:
        """An object was written past ``put_object`` (packs, a remote pull): sync before a
        listing names it."""
        self._unsynced = True

    def sync_objects(self) -> None:
        """Make every object written so far durable: one syncfs of the store's filesystem
        instead of an fsync per object (each of which would wait for the disk in turn)."""
        if not self._unsynced:
            return
        self._unsynced = False  # before syncing: an object written meanwhile sets it again
        syncfs(self.layout.objects)

    def put_tensor(self, dtype: str, arr: np.ndarray) -> dict:
        """Store a tensor given as a numpy array of its storage dtype; returns its entry."""
        arr = np.ascontiguousarray(arr, dtype=DTYPES[dtype])
        data = memoryview(arr).cast("B")
        digest = keys.tensor_digest(dtype, arr.shape, data)
        self._put_object(digest, [data])
        return {"dtype": dtype, "shape": list(arr.shape), "digest": digest}

    def put_tensor_chunks(
        self, dtype: str, shape: list[int] | tuple[int, ...], chunks: Iterable[np.ndarray]
    ) -> dict:
        """Store a tensor given as consecutive blocks (numpy arrays of its storage dtype) without
        holding it whole: hashed as it is written, named by its digest once all of it is."""
        h = keys.tensor_hasher(dtype, shape)
        tmp, size = write_temp(
            (memoryview(np.ascontiguousarray(c, dtype=DTYPES[dtype])).cast("B") for c in chunks),
            self.layout.tmp,
            "tensor",
            sync=False,
            on_chunk=h.update,
            direct=True,
        )
        try:
            if size != nbytes(dtype, shape):
                raise StoreError(
                    f"tensor blocks add up to {size} bytes, "
                    f"expected {nbytes(dtype, shape)} for {dtype}{list(shape)}"
                )
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

    def put_row_blocks(
        self, rows: int, blocks: Iterable[dict[str, tuple[np.ndarray, str]]], stream: str
    ) -> dict[str, dict]:
        """``row_blocks`` into objects of their own."""
        return row_blocks(
            rows,
            blocks,
            stream,
            lambda name, dtype, shape, chunks: self.put_tensor_chunks(dtype, shape, chunks),
            lambda name, dtype, arr: self.put_tensor(dtype, arr),
        )

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
        self.quarantine(self.object_path(digest), "content does not match its digest")
        return StoreMiss(
            f"store object {keys.short(digest)} was corrupt and has been removed; rebuild"
        )

    def read_tensor(self, entry: dict, verify: bool = True) -> np.ndarray:
        """Read a tensor entry (store object or source view) as a storage-dtype array."""
        dtype, shape = entry["dtype"], tuple(entry["shape"])
        if "view" in entry:
            return self._read_view(entry["view"], dtype, shape)
        f, start, obj = self._open(entry)
        arr = np.empty(shape, DTYPES[dtype])
        view = byte_view(arr)
        with f:
            got = 0
            while got < len(view) and (k := f.readinto(view[got:])):
                got += k
            longer = start == 0 and bool(f.read(1))  # an object of its own is exactly the tensor
        self.stats.add(read=got)
        if (
            got != len(view)
            or longer
            or (verify and keys.tensor_digest(dtype, shape, view) != entry["digest"])
        ):
            raise self._corrupt(obj)
        return arr

    def _open(self, entry: dict):
        """A stored tensor's file, unbuffered and at its first byte; that offset, and the object
        to quarantine if its bytes are wrong."""
        path, start, obj = self._span(entry)
        try:
            f = open(path, "rb", buffering=0)
        except FileNotFoundError:
            raise self._missing(obj) from None
        f.seek(start)
        return f, start, obj

    def prefetch(self, entries: Iterable[dict]) -> Future | None:
        """Start the OS reading these tensors' bytes into its cache, on a thread of its own, and
        return: a forward pass names the next layer's while it computes this one, so that the
        reads that follow wait on memory, not on the disk (a 35B layer's experts are 0.65 GB
        at 6 bits, its attention ~1 s of arithmetic here: bench/RESULTS.md). Returns the
        read's future (None: nothing to read)."""
        spans = []
        for e in entries:
            try:
                if "view" in e:
                    path, header = self.header(e["view"]["file"])
                    info = header.tensors[e["view"]["tensor"]]
                    spans.append((path, info.start, info.nbytes))
                else:
                    path, start, _ = self._span(e)
                    spans.append((path, start, nbytes(e["dtype"], e["shape"])))
            except (StoreMiss, SourceError, StoreError, KeyError, OSError):
                continue  # the read itself says what is wrong
        return workers.pool("prefetch").submit(readahead, spans, workers=1) if spans else None

    def _span(self, entry: dict) -> tuple[Path, int, str]:
        """Where a stored tensor's bytes start: its own object at 0, or its place in a pack
        (``packs.py``); and the object to quarantine if they are wrong."""
        pack = entry.get("pack")
        if pack is None:
            return self.object_path(entry["digest"]), 0, entry["digest"]
        path = self.object_path(pack["file"])
        h = self._headers.get(pack["file"])
        if h is None:
            if not path.exists():
                raise self._missing(pack["file"])
            try:
                h = read_header(path)
            except SourceError:
                raise self._corrupt(pack["file"]) from None
            self._headers[pack["file"]] = h
        info = h.tensors.get(pack["tensor"])
        if info is None or (info.dtype, list(info.shape)) != (entry["dtype"], list(entry["shape"])):
            raise self._corrupt(pack["file"])
        return path, info.start, pack["file"]

    def iter_rows(
        self, entry: dict, max_bytes: int = ROW_BLOCK_BYTES, pick: np.ndarray | None = None
    ) -> Iterator[np.ndarray]:
        """A tensor entry as consecutive blocks along its first axis, each at most ``max_bytes``
        (but at least one row), read one at a time: memory is a block, not the tensor.

        A store object is checked against its digest as it passes; a mismatch quarantines it and
        raises StoreMiss after the last block (the caller discards what it made of them). A
        view of a source file is not checked, so with ``pick`` (sorted row ids) its blocks that
        hold none of them are not read (``read_row_blocks``: handed out unfilled).
        """
        dtype, shape = entry["dtype"], tuple(entry["shape"])
        if not shape or shape[0] == 0:
            yield self.read_tensor(entry)
            return
        n = shape[0]
        step = max(1, max_bytes // max(nbytes(dtype, shape) // n, 1))
        if "view" in entry:
            yield from self._view_rows(entry, step, pick)
        else:
            yield from self._object_rows(entry, step)

    def _view_rows(self, entry: dict, step: int, pick=None) -> Iterator[np.ndarray]:
        """``iter_rows`` of a view: the rows read from its source file where they lie."""
        dtype, shape = entry["dtype"], tuple(entry["shape"])
        n = shape[0]
        path, header = self.header(entry["view"]["file"])
        info = header.tensors.get(entry["view"]["tensor"])
        slc = entry["view"].get("slice")
        sliced = list(info.shape) if info is not None else []
        if slc is not None and sliced:
            sliced[slc[0]] = slc[2] - slc[1]
        if (
            info is None
            or info.dtype != dtype
            or tuple(sliced) != shape
            or (slc is not None and slc[0] == 0)
        ):
            # Not rows of its source as they lie (a reshaped view, say; or gone, which
            # read_tensor reports): read whole, still handed out in blocks.
            whole = self.read_tensor(entry)
            for a in range(0, n, step):
                yield whole[a : a + step]
            return
        for a, arr in zip(range(0, n, step), read_row_blocks(info, path, n, step, slc, pick)):
            if block_read(pick, a, arr.shape[0]):  # an unread block is not counted
                self.stats.add(read=arr.nbytes)
            yield arr

    def _object_rows(self, entry: dict, step: int) -> Iterator[np.ndarray]:
        """``iter_rows`` of a store object, checked against its digest as it passes."""
        dtype, shape = entry["dtype"], tuple(entry["shape"])
        n = shape[0]
        digest = entry["digest"]
        f, start, obj = self._open(entry)
        h = keys.tensor_hasher(dtype, shape)
        with f:
            for a in range(0, n, step):
                b = min(n, a + step)
                arr = np.empty((b - a, *shape[1:]), DTYPES[dtype])
                view = byte_view(arr)
                got = 0
                while got < len(view) and (k := f.readinto(view[got:])):
                    got += k
                if got < len(view):
                    raise self._corrupt(obj)  # shorter than its shape
                h.update(view)
                self.stats.add(read=got)
                yield arr
            if (start == 0 and f.read(1)) or keys.finish(h) != digest:
                raise self._corrupt(obj)

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
        f, start, obj = self._open(entry)
        extra = 1 if start == 0 else 0  # an object of its own must end with the tensor
        h = keys.tensor_hasher(entry["dtype"], entry["shape"])
        view, done = memoryview(buf), 0
        with f:
            while n := f.readinto(view[: min(len(buf), want - done + extra)]):
                h.update(view[:n])
                sink(view[:n])
                done += n
        self.stats.add(read=done)
        if done != want or keys.finish(h) != digest:
            raise self._corrupt(obj)
        return done

    def header(self, file_digest: str) -> tuple[Path, Header]:
        """Path and parsed header of a source file, by content digest (headers cached per
        process)."""
        path = self.sources.resolve(file_digest)
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
            raise SourceError(
                f"{path}: tensor {view['tensor']!r} no longer matches its recorded "
                f"{dtype}{list(shape)}"
            )
        self.stats.add(read=arr.nbytes)
        return arr.reshape(shape)

    def quarantine(self, path: Path, why: str) -> None:
        print(f"buildkit: warning: {path}: {why}; removed", file=sys.stderr)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()

    # ---- artifacts -----------------------------------------------------------------

    def put_artifact(self, art: Artifact) -> str:
        self.sync_objects()  # the listing must never be durable before the objects it names
        digest = art.digest
        path = fan(self.layout.artifacts, digest)
        if not path.exists():
            atomic_write(path, keys.canonical_json(art.listing()), self.layout.tmp)
        return digest

    def get_artifact(self, digest: str) -> Artifact:
        path = fan(self.layout.artifacts, digest)
        try:
            listing = json.loads(path.read_bytes())
            art = Artifact.from_listing(listing)
        except FileNotFoundError:
            raise StoreMiss(f"artifact {keys.short(digest)} is missing; rebuild") from None
        except (ValueError, AttributeError):
            self.quarantine(path, "listing is not valid JSON")
            raise StoreMiss(f"artifact {keys.short(digest)} was corrupt; rebuild") from None
        if art.digest != digest:
            self.quarantine(path, "listing does not match its digest")
            raise StoreMiss(f"artifact {keys.short(digest)} was corrupt; rebuild")
        return art

    def artifact_complete(self, digest: str) -> bool:
        """The listing is intact and every object it names exists with the right size."""
        try:
            art = self.get_artifact(digest)
        except StoreError:
            return False
        for d, shape in objects(art).items():
            p = self.object_path(d)
            try:
                if shape is not None and p.stat().st_size != nbytes(*shape):
                    self.quarantine(p, "wrong size")
                    return False
            except FileNotFoundError:
                return False
            if shape is None and not p.exists():
                return False
        return True

    def record_files(self, action_keys: Iterable[str], artifacts: Iterable[str]) -> list[Path]:
        """The store files a build that finds these keys cached reads: their action records,
        the artifact listings and the objects those name (a view's source file is not here)."""
        paths = [fan(self.layout.actions, k) for k in action_keys]
        for digest in dict.fromkeys(artifacts):  # nodes may share an output: read it once
            paths.append(fan(self.layout.artifacts, digest))
            art = self.get_artifact(digest)
            paths += [self.object_path(d) for d in objects(art)]
        return list(dict.fromkeys(paths))

    # ---- actions -------------------------------------------------------------------

    def get_action(self, key: str) -> dict | None:
        """The recorded outputs for a cache key, or None if absent, corrupt or incomplete."""
        path = fan(self.layout.actions, key)
        try:
            rec = json.loads(path.read_bytes())
        except FileNotFoundError:
            return None
        except ValueError:
            rec = None
        if not (
            isinstance(rec, dict) and rec.get("key") == key and isinstance(rec.get("outputs"), dict)
        ):
            self.quarantine(path, "action record is corrupt")
            return None
        outputs = rec["outputs"]
        if not all(self.artifact_complete(d) for d in outputs.values()):
            return None
        return rec

    def put_action(self, key: str, record: dict) -> None:
        atomic_write(fan(self.layout.actions, key), keys.canonical_json(record), self.layout.tmp)

    @contextlib.contextmanager
    def lock(self, name: str) -> Iterator[None]:
        """An exclusive inter-process lock (flock) held for the duration of the block."""
        path = self.layout.locks / (keys.short(name, 32) + ".lock")
        with open(path, "a+") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)

    @contextlib.contextmanager
    def in_use(self, exclusive: bool = False) -> Iterator[None]:
        """Builds hold the store shared; gc holds it exclusively and never waits for a build."""
        with open(self.layout.locks / "store.lock", "a+") as f:
            try:
                fcntl.flock(
                    f.fileno(), (fcntl.LOCK_EX | fcntl.LOCK_NB) if exclusive else fcntl.LOCK_SH
                )
            except BlockingIOError:
                raise StoreError(
                    f"a build is using the store {self.root}; run gc again when it has finished"
                ) from None
            try:
                yield
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)

    # ---- memos ---------------------------------------------------------------------

    def get_memo(self, kind: str, key: str) -> dict | None:
        """A remembered fact (``put_memo``), or None if absent or unreadable (a memo is a hint)."""
        path = fan(self.layout.memos / kind, key)
        with contextlib.suppress(FileNotFoundError, ValueError):
            rec = json.loads(path.read_bytes())
            if isinstance(rec, dict) and rec.get("key") == key:
                return rec
        return None

    def put_memo(self, kind: str, key: str, record: dict) -> None:
        path = fan(self.layout.memos / kind, key)
        atomic_write(path, keys.canonical_json({**record, "key": key}), self.layout.tmp)

    # ---- refs, roots and gc --------------------------------------------------------

    def set_ref(self, name: str, value: dict) -> None:
        atomic_write(self.layout.refs / f"{name}.json", keys.canonical_json(value), self.layout.tmp)

    def get_ref(self, name: str) -> dict | None:
        with contextlib.suppress(FileNotFoundError, ValueError):
            return json.loads((self.layout.refs / f"{name}.json").read_text())
        return None

    def refs(self) -> dict[str, dict]:
        out = {}
        for p in sorted(self.layout.refs.glob("*.json")):
            with contextlib.suppress(ValueError):
                out[p.stem] = json.loads(p.read_text())
        return out

    @staticmethod
    def root_id(request: dict) -> str:
        return keys.short(keys.digest_json("root", request), 32)

    def set_root(self, request: dict, nodes: dict[str, dict]) -> None:
        """Keep what one build request (variant, source, out) built until the user forgets it:
        ``nodes`` maps node name -> {"key", "ingredients"}."""
        rec = {"request": request, "nodes": nodes, "built_ns": time.time_ns()}
        atomic_write(
            self.layout.roots / f"{self.root_id(request)}.json",
            keys.canonical_json(rec),
            self.layout.tmp,
        )

    def get_root(self, request: dict) -> dict | None:
        with contextlib.suppress(FileNotFoundError, ValueError):
            return json.loads((self.layout.roots / f"{self.root_id(request)}.json").read_text())
        return None

    def roots(self) -> list[dict]:
        """Every build request's root, oldest first; each with its file as ``path``."""
        out = []
        for p in self.layout.roots.glob("*.json"):
            with contextlib.suppress(OSError, ValueError):
                rec = json.loads(p.read_text())
                if isinstance(rec, dict) and isinstance(rec.get("request"), dict):
                    out.append({**rec, "path": str(p)})
        return sorted(out, key=lambda r: (r.get("built_ns", 0), r["path"]))

    def forget(
        self,
        variant: str,
        out: str | None = None,
        keep_last: int | None = None,
        dry_run: bool = False,
    ) -> list[dict]:
        """Drop build roots: a variant's (only those that published to ``out``, if given; the
        default output is recorded as None and matched by ``out/VARIANT``), or, with
        ``keep_last``, all but the newest ``keep_last`` of each variant (``variant`` "*": every
        variant). Returns the roots dropped; ``gc`` then frees what no root reaches."""
        by_variant: dict[str, list[dict]] = {}
        for r in self.roots():
            by_variant.setdefault(r["request"].get("variant", ""), []).append(r)
        dropped = []
        for v, rs in by_variant.items():
            if variant not in ("*", v):
                continue
            if keep_last is not None:
                drop = rs[: max(0, len(rs) - keep_last)]
            else:
                default = os.path.abspath(f"out/{v}")
                drop = [r for r in rs if out is None or (r["request"].get("out") or default) == out]
            if not dry_run:
                for r in drop:
                    Path(r["path"]).unlink(missing_ok=True)
            dropped += drop
        return dropped

    def gc(self, dry_run: bool = False, keep_last: int | None = None) -> dict:
        """Remove actions no build root names, then artifacts and objects no kept action
        reaches, memos, and the records of source files that no longer exist. ``keep_last``:
        first forget all but the newest ``keep_last`` builds of each variant.

        Refuses (StoreError) while a build holds the store, whose new objects no root names yet.
        """
        with self.in_use(exclusive=True):
            dropped = (
                [] if keep_last is None else self.forget("*", keep_last=keep_last, dry_run=dry_run)
            )
            gone = {r["path"] for r in dropped}
            removed = self._gc(dry_run, [r for r in self.roots() if r["path"] not in gone])
            removed["roots"] = dropped
            return removed

    def _gc(self, dry_run: bool, roots: list[dict]) -> dict:
        keep_keys = {n["key"] for r in roots for n in r.get("nodes", {}).values() if n.get("key")}
        live_arts: set[str] = set()
        removed = {"actions": 0, "artifacts": 0, "objects": 0, "memos": 0, "bytes": 0, "nodes": {}}
        doomed: list[tuple[Path, dict]] = []
        for p in sorted(self.layout.actions.glob("*/*")):
            key = keys.PREFIX + p.parent.name + p.name
            rec = None
            with contextlib.suppress(ValueError):
                rec = json.loads(p.read_bytes())
            if key in keep_keys and isinstance(rec, dict):
                live_arts.update(rec.get("outputs", {}).values())
            else:
                doomed.append((p, rec if isinstance(rec, dict) else {}))
        for p, rec in doomed:
            removed["actions"] += 1
            removed["bytes"] += p.stat().st_size
            group = removed["nodes"].setdefault(rec.get("variant", "?"), {})
            group.setdefault(rec.get("node", "?"), []).append(
                keys.short(keys.PREFIX + p.parent.name + p.name)
            )
            if not dry_run:
                p.unlink()
        live_objs: set[str] = set()
        for d in live_arts:
            with contextlib.suppress(StoreError):
                art = self.get_artifact(d)
                live_objs.update(objects(art))
        for sub, live in (("artifacts", live_arts), ("objects", live_objs)):
            for p in sorted(getattr(self.layout, sub).glob("*/*")):
                if keys.PREFIX + p.parent.name + p.name not in live:
                    removed[sub] += 1
                    removed["bytes"] += p.stat().st_size
                    if not dry_run:
                        p.unlink()
        for p in sorted(self.layout.memos.glob("*/*/*")):
            removed["memos"] += 1
            removed["bytes"] += p.stat().st_size
            if not dry_run:
                p.unlink()
        removed["files"], freed = self.sources.forget_gone(dry_run)
        removed["bytes"] += freed
        if not dry_run:
            shutil.rmtree(self.layout.tmp, ignore_errors=True)
            self.layout.tmp.mkdir(exist_ok=True)
        return removed

    def check(self) -> list[str]:
        """Re-hash every object and listing; return a line per corrupt entry (and remove it)."""
        bad = []
        for p in sorted(self.layout.artifacts.glob("*/*")):
            d = keys.PREFIX + p.parent.name + p.name
            try:
                self.get_artifact(d)
            except StoreError as e:
                bad.append(str(e))
        tensor_shapes: dict[str, tuple[str, list[int]]] = {}
        blobs: set[str] = set()
        for p in sorted(self.layout.artifacts.glob("*/*")):
            with contextlib.suppress(Exception):
                for d, shape in objects(Artifact.from_listing(json.loads(p.read_bytes()))).items():
                    if shape is None:
                        blobs.add(d)
                    else:
                        tensor_shapes[d] = shape
        for p in sorted(self.layout.objects.glob("*/*")):
            d = keys.PREFIX + p.parent.name + p.name
            ok = hash_file(p, keys.blob_hasher()) == d
            if not ok and d in tensor_shapes:
                ok = hash_file(p, keys.tensor_hasher(*tensor_shapes[d])) == d
            elif not ok and d not in blobs:
                # a tensor no listing names (its build was interrupted): unread, gc frees it
                continue
            if not ok:
                self.quarantine(p, "content does not match its digest")
                bad.append(f"object {keys.short(d)}: content does not match its digest")
        return bad


def row_blocks(rows: int, blocks, stream: str, put_stream, put_whole) -> dict[str, dict]:
    """Tensors made together block by block along their first axis (``rows`` rows in all),
    each block a dict name -> (array, dtype): tensor ``stream`` goes to ``put_stream(name,
    dtype, shape, chunks)`` as its blocks come, the others (small: a quantized weight's scales
    and biases) are joined at the end for ``put_whole(name, dtype, array)``."""
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
    out = {stream: put_stream(stream, dtype, [rows, *arr.shape[1:]], streamed())}
    for k, parts in rest.items():
        out[k] = put_whole(k, first[k][1], np.concatenate(parts))
    return out


def hash_file(path: Path, h) -> str:
    """A file's digest through ``h`` (``keys.blob_hasher()``, or a tensor's), read in chunks:
    a pack is gigabytes."""
    buf = bytearray(HASH_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while k := f.readinto(buf):
            h.update(view[:k])
    return keys.finish(h)
