"""A Dask worker's own store, for ``build --dask ADDRESS --remote URL``: no path shared with
the client.

A task names its inputs by content: store objects by digest (fetched from the remote cache,
checked against the digest as they arrive) and source tensors by (file digest, tensor name)
(read from the source itself by byte range: ``hub.range_ref`` gives an ``hf://`` file's URL,
size and sha256). Every file it reads is kept as a *sparse copy* under ``ranges/`` in this
worker's store: the file's length, its safetensors header and the byte ranges of the tensors
read so far, so the store's own readers work on it by path and a range is fetched once per
worker. Packs in the remote are read the same way, one tensor's range at a time: a worker that
verifies one tensor never downloads a 5 GB shard. What a task writes goes to objects of this
store (``packs.PackWriter`` writes detached: ``placed``) and is uploaded if the remote lacks
it (a HEAD first: never re-upload what it has); the client puts the bytes in its packs.

A corrupt object is refused by the worker that reads it, named, and removed from the remote
and from this store: the client uploads its own copy again when the build reruns the node.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote, urlparse

from buildkit.core import keys
from buildkit.core.errors import SourceError, StoreMiss
from buildkit.formats.tensors import Header, TensorInfo, nbytes, read_header
from buildkit.store.fsio import atomic_write
from buildkit.store.layout import fan
from buildkit.store.remote import Absent, RemoteError, backend, object_key
from buildkit.store.store import Store

TIMEOUT = 60  # seconds a range request may take before the task fails, naming the URL


# ---- what a task reads: found in its arguments --------------------------------------


def task_inputs(args) -> tuple[dict[str, tuple | None], dict[str, tuple], set[tuple[str, str]]]:
    """What a task reads, named anywhere in its arguments: store objects {digest: (dtype,
    shape)}, tensors in packs {tensor digest: (pack digest, (dtype, shape))} and source tensors
    {(file digest, tensor)}; from tensor entries (``{"digest", "dtype", "shape"}``, in a pack or
    alone), views (``{"view": {"file", "tensor"}}``) and a file digest followed by its
    ``TensorInfo`` (verify's items)."""
    objs: dict[str, tuple | None] = {}
    packed: dict[str, tuple] = {}
    srcs: set[tuple[str, str]] = set()

    def walk(x) -> None:
        if isinstance(x, dict):
            if isinstance(x.get("view"), dict):
                srcs.add((x["view"]["file"], x["view"]["tensor"]))
                return
            if "digest" in x and "dtype" in x and "shape" in x:
                pack = x.get("pack")
                if isinstance(pack, dict) and pack.get("file"):
                    packed[x["digest"]] = (pack["file"], (x["dtype"], tuple(x["shape"])))
                elif pack is None:
                    objs[x["digest"]] = (x["dtype"], tuple(x["shape"]))
                return
            for v in x.values():
                walk(v)
        elif isinstance(x, list | tuple):
            for a, b in zip(x, x[1:]):
                if isinstance(a, str) and keys.is_digest(a) and isinstance(b, TensorInfo):
                    srcs.add((a, b.name))
            for v in x:
                walk(v)

    walk(args)
    return objs, packed, srcs


# ---- reading a file by byte range ---------------------------------------------------


def read_range(ref: dict, start: int, end: int, who: str) -> bytes:
    """Bytes [start, end) of a file named by ``ref`` (``{"url", "size", "sha256"?}``): an
    http(s) URL by a Range request (the Hub's, with the worker's HF token), ``file://`` or
    ``s3://``. The answer must be the file the client indexed: its total size, and where the
    server names its blob (the Hub's ETag of an LFS file is its sha256), that blob."""
    url = ref["url"]
    u = urlparse(url)
    try:
        if u.scheme in ("http", "https"):
            return _http_range(ref, start, end, who)
        if u.scheme == "file":
            with open(unquote(u.path), "rb") as f:
                size = os.fstat(f.fileno()).st_size
                f.seek(start)
                data = f.read(end - start)
        elif u.scheme == "s3":
            be = backend(f"s3://{u.netloc}")
            data, size = be.get_range(u.path.lstrip("/"), start, end)
        else:
            raise SourceError(f"worker {who}: cannot read source {url}: unknown scheme")
    except OSError as e:
        raise SourceError(f"worker {who}: cannot read source {url}: {e}") from None
    if size != ref["size"] or len(data) != end - start:
        raise SourceError(
            f"worker {who}: source {url} is {size} bytes (gave {len(data)} of [{start}, {end})), "
            f"the client indexed {ref['size']}: it changed; fetch the source again"
        )
    return data


def _http_range(ref: dict, start: int, end: int, who: str) -> bytes:
    headers = {"Range": f"bytes={start}-{end - 1}", "User-Agent": f"buildkit-worker/{who}"}
    if ref.get("hub"):
        from huggingface_hub.utils import build_hf_headers

        headers = {**build_hf_headers(), **headers}
    req = urllib.request.Request(ref["url"], headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
            total = int((r.headers.get("Content-Range") or "/-1").rsplit("/", 1)[1])
            etag = (r.headers.get("X-Linked-Etag") or r.headers.get("ETag") or "").strip('"')
            data = r.read()
            status = r.status
    except (urllib.error.URLError, OSError) as e:
        raise SourceError(
            f"worker {who}: cannot read bytes {start}-{end - 1} of {ref['url']}: {e}; check "
            "that this worker reaches the Hub (HF_ENDPOINT, HF_TOKEN) and run the build again"
        ) from None
    want = ref.get("sha256")
    if status != 206 or total != ref["size"] or (want and etag.removeprefix("W/") != want):
        raise SourceError(
            f"worker {who}: {ref['url']} answered {status}, size {total}, etag {etag!r} for a "
            f"range of the file the client indexed ({ref['size']} bytes, sha256 {want}): "
            "not the same file; pin the source to a commit"
        )
    return data


# ---- sparse copies --------------------------------------------------------------------


class Sparse:
    """A file's length, header and the ranges read so far, under this worker's ``ranges/``;
    ``<path>.json`` lists the ranges present (written after their bytes)."""

    def __init__(self, store: Store, digest: str, size: int, read):
        self.store, self.digest, self.size, self.read = store, digest, size, read
        self.path = fan(store.root / "ranges", digest)
        self.index = self.path.with_name(self.path.name + ".json")

    def _have(self) -> list[list[int]]:
        with contextlib.suppress(FileNotFoundError, ValueError):
            return json.loads(self.index.read_text())
        return []

    def ensure(self, start: int, end: int) -> None:
        """Bytes [start, end) present, fetched (under an inter-process lock) if they are not."""
        if any(a <= start and end <= b for a, b in self._have()):
            return
        with self.store.lock(f"range-{self.digest}"):
            have = self._have()
            if any(a <= start and end <= b for a, b in have):
                return
            data = self.read(start, end)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                if os.fstat(fd).st_size != self.size:
                    os.ftruncate(fd, self.size)
                os.pwrite(fd, data, start)
            finally:
                os.close(fd)
            atomic_write(
                self.index,
                json.dumps(sorted([*have, [start, end]])).encode(),
                self.store.layout.tmp,
            )
            self.store.stats.add(read=len(data))

    def header(self) -> Header:
        self.ensure(0, 8)
        with open(self.path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
        if not 0 < n <= min(self.size - 8, 100 << 20):
            raise SourceError(f"{self.path}: header length {n} does not fit the file")
        self.ensure(8, 8 + n)
        return read_header(self.path)

    def remove(self) -> None:
        for p in (self.index, self.path):
            p.unlink(missing_ok=True)


# ---- the worker's store ---------------------------------------------------------------


class DetachedStore(Store):
    """A worker's store that reads what it lacks from the remote and the source by range, and
    whose pack writes become objects to upload (``placed``)."""

    detached = True

    def __init__(self, root: str | Path, remote_url: str, sources: dict[str, dict], who: str):
        super().__init__(root)
        self.be, self.sources_ref, self.who = backend(remote_url), sources, who
        self.placed: list[dict] = []  # pack slots this task filled: {digest, dtype, shape, slot}
        self._sparse: dict[str, tuple[Sparse, Header]] = {}

    def _where(self, digest: str) -> str:
        return f"{self.be.url.rstrip('/')}/{object_key(digest)}"

    def _remote_failed(self, e: Exception, digest: str) -> RemoteError:
        return RemoteError(
            f"worker {self.who}: the remote {self.be.url} failed while reading "
            f"{self._where(digest)}: {type(e).__name__}: {e}; check that this worker reaches "
            "it (endpoint and credentials in its environment)"
        )

    # -- sources and packs by range

    def _open_sparse(self, digest: str) -> tuple[Sparse, Header]:
        got = self._sparse.get(digest)
        if got is None:
            ref = self.sources_ref.get(digest)
            if ref is not None:
                sp = Sparse(self, digest, ref["size"], lambda a, b: read_range(ref, a, b, self.who))
            else:  # a pack in the remote
                size = self._remote_size(digest)
                sp = Sparse(self, digest, size, lambda a, b: self._remote_range(digest, a, b))
            try:
                got = self._sparse[digest] = (sp, sp.header())
            except SourceError:
                sp.remove()
                raise
        return got

    def _remote_size(self, digest: str) -> int:
        try:
            return self.be.size(object_key(digest))
        except Absent:
            raise StoreMiss(
                f"worker {self.who}: object {keys.short(digest)} is not in the remote "
                f"{self.be.url}; rebuild"
            ) from None
        except Exception as e:
            raise self._remote_failed(e, digest) from None

    def _remote_range(self, digest: str, start: int, end: int) -> bytes:
        try:
            return self.be.get_range(object_key(digest), start, end)[0]
        except Exception as e:
            raise self._remote_failed(e, digest) from None

    def want(self, digest: str, tensor: str) -> None:
        """A tensor's bytes in the sparse copy of its file (source or pack)."""
        sp, h = self._open_sparse(digest)
        info = h.tensors.get(tensor)
        if info is None:
            raise SourceError(f"{self._where(digest)}: tensor {tensor!r} is missing")
        if info.end > info.start:
            sp.ensure(info.start, info.end)

    def header(self, file_digest: str) -> tuple[Path, Header]:
        if file_digest not in self.sources_ref:
            return super().header(file_digest)
        sp, h = self._open_sparse(file_digest)
        return sp.path, h

    def _read_view(self, view: dict, dtype: str, shape: tuple[int, ...]):
        if view["file"] in self.sources_ref:
            self.want(view["file"], view["tensor"])
        return super()._read_view(view, dtype, shape)

    def _view_rows(self, entry: dict, step: int, pick=None) -> Iterator:
        if entry["view"]["file"] in self.sources_ref:
            self.want(entry["view"]["file"], entry["view"]["tensor"])
        return super()._view_rows(entry, step, pick)

    def _span(self, entry: dict) -> tuple[Path, int, str]:
        pack = entry.get("pack")
        if pack is None:
            if not self.has_object(entry["digest"]):
                self._download(entry["digest"], (entry["dtype"], entry["shape"]))
            return super()._span(entry)
        if self.has_object(pack["file"]):
            return super()._span(entry)
        alone = {k: v for k, v in entry.items() if k != "pack"}
        if self.has_object(entry["digest"]):  # this worker made it (quantize, then verify)
            return super()._span(alone)
        with contextlib.suppress(Absent):  # a worker uploaded it: no pack needed
            self._download(entry["digest"], (entry["dtype"], entry["shape"]), missing=Absent)
            return super()._span(alone)
        self.want(pack["file"], pack["tensor"])
        sp, h = self._sparse[pack["file"]]
        info = h.tensors[pack["tensor"]]
        if (info.dtype, list(info.shape)) != (entry["dtype"], list(entry["shape"])):
            raise self._corrupt(pack["file"])
        return sp.path, info.start, pack["file"]

    # -- whole objects

    def _download(self, digest: str, shape: tuple | None, missing=StoreMiss) -> None:
        """An object from the remote, checked against its digest; ``missing`` raised if the
        remote has none."""
        h = keys.tensor_hasher(*shape) if shape else keys.blob_hasher()
        tmp = self.layout.tmp / f".worker.{os.getpid()}.{keys.short(digest, 16)}.tmp"

        class Sink:
            size = 0

            def __init__(self, f):
                self.f = f

            def write(self, data) -> int:
                h.update(data)
                Sink.size += len(data)
                return self.f.write(data)

        try:
            with open(tmp, "wb") as f:
                self.be.download(object_key(digest), Sink(f), nbytes(*shape) if shape else None)
            if keys.finish(h) != digest or (shape and Sink.size != nbytes(*shape)):
                raise self._corrupt(digest)
            dest = self.object_path(digest)
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp, dest)
        except Absent:
            raise missing(
                f"worker {self.who}: object {keys.short(digest)} is not in the remote "
                f"{self.be.url}; rebuild"
            ) from None
        except (StoreMiss, OSError):
            raise
        except Exception as e:
            raise self._remote_failed(e, digest) from None
        finally:
            tmp.unlink(missing_ok=True)

    def _corrupt(self, digest: str) -> StoreMiss:
        """Refuse an object read from the remote: removed there and here, named; the client
        sends its own copy again when the build reruns."""
        self.quarantine(self.object_path(digest), "content does not match its digest")
        sp = self._sparse.pop(digest, None)
        if sp is not None:
            sp[0].remove()
        with contextlib.suppress(Exception):
            self.be.delete([object_key(digest)])
        return StoreMiss(
            f"worker {self.who}: remote object {self._where(digest)} is corrupt (its bytes do not "
            "match its digest): removed from the remote; the node is rebuilt"
        )

    # -- outputs

    def upload_outputs(self, out, placed: list[dict]) -> None:
        """Every object a task's result names, and every pack slot it filled (``placed``), into
        the remote unless it has it already."""
        todo = {p["digest"] for p in placed}
        if isinstance(out, dict):
            todo |= {
                e["digest"]
                for e in out.values()
                if isinstance(e, dict) and "digest" in e and "pack" not in e and "view" not in e
            }
        for d in sorted(todo):
            key = object_key(d)
            try:
                if not self.be.head(key):
                    self.be.upload(key, self.object_path(d))
            except Exception as e:
                raise RemoteError(
                    f"worker {self.who}: upload of {keys.short(d)} to the remote {self.be.url} "
                    f"failed: {type(e).__name__}: {e}; check that this worker reaches it "
                    "(endpoint and credentials in its environment)"
                ) from None


def worker_name() -> str:
    """This process as a person finds it: host and, on a Dask worker, its address."""
    try:
        from distributed import get_worker

        w = get_worker()
        return f"{w.name} on {socket.gethostname()} ({w.address})"
    except (ImportError, ValueError):
        return f"{socket.gethostname()} (pid {os.getpid()})"
