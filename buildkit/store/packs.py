"""Packs: a quantizing step's tensors written in the shape of the shards publish will write.

A pack is a safetensors file (``{"format": "mlx"}``, the tensors of one planned shard in
order) kept in the store as an object named by its blob digest. Publish hard-links a pack
whose header is the shard it plans instead of writing the same bytes a second time: the real
model's 30 GB are written once, not twice. Each tensor keeps its own
tensor digest in the listing, ``{"digest", "pack": {"file", "tensor"}}``, checked whenever it
is read, so a tensor is checked without hashing its whole pack.

Tasks (one per source tensor, on local threads or Dask workers that see the store's disk)
write into the packs' temp files at offsets planned up front, from every output's dtype and
shape; the step hashes and names a pack once its last tensor is in.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterable
from pathlib import Path

from buildkit.core import keys
from buildkit.core.errors import StoreError
from buildkit.core.lazy import lazy
from buildkit.formats.checkpoint import model_part
from buildkit.formats.tensors import DTYPES, header_bytes, nbytes
from buildkit.store.fsio import DirectRange, file_ident, settle
from buildkit.store.store import hash_file, row_blocks

np = lazy("numpy", __name__)

SHARD_BYTES = 5 << 30  # publish's default max_shard_bytes: a pack is one of its shards
SYNC_WRITES = False  # set on Dask workers: the client reads the packs after the task returns
FORMAT = {"format": "mlx"}  # the metadata mlx_lm and mlx_vlm write and publish checks


def plan_shards(shapes: dict[str, tuple[str, list[int]]], limit: int) -> list[list[str]]:
    """Tensor names per shard: each part of the model (``checkpoint.model_part``) in shards of
    its own, in order of part, then name; a shard holds at most ``limit`` bytes (or one tensor).
    Parts never share a shard, so xl-mtp's trunk shards are xl's (its head is a part)."""
    shards, cur, size = [], [], 0
    last = None
    for part, name in sorted((model_part(k), k) for k in shapes):
        n = nbytes(*shapes[name])
        if cur and (size + n > limit or part != last):
            shards.append(cur)
            cur, size = [], 0
        cur.append(name)
        last = part
        size += n
    return shards + ([cur] if cur else [])


def shard_header(items: list[tuple[str, str, list[int]]]) -> bytes:
    """The safetensors header of a shard holding ``items`` (name, dtype, shape) in order."""
    return header_bytes([(n, d, tuple(s)) for n, d, s in items], FORMAT)


class PackSet:
    """The packs of one quantizing step, planned from every output's (dtype, shape): each a
    temp file with its header written and its length set, filled by tasks at known offsets."""

    def __init__(self, store, shapes: dict[str, tuple[str, list[int]]], limit: int = SHARD_BYTES):
        self.store = store
        self.groups = plan_shards(shapes, limit)
        self.slots: dict[str, tuple[str, int]] = {}  # name -> (temp path, offset of its data)
        self.left: list[set[str]] = []
        self.paths: list[Path] = []
        self.digests: list[str | None] = []
        self.pack_of: dict[str, int] = {}
        for i, names in enumerate(self.groups):
            head = shard_header([(n, *shapes[n]) for n in names])
            path = store.layout.tmp / f"pack-{os.getpid()}-{uuid.uuid4().hex}"
            with open(path, "wb") as f:
                f.write(head)
                off = len(head)
                for n in names:
                    self.slots[n] = (str(path), off)
                    self.pack_of[n] = i
                    off += nbytes(*shapes[n])
                f.truncate(off)
            self.paths.append(path)
            self.left.append(set(names))
            self.digests.append(None)

    def slots_for(self, names: Iterable[str]) -> dict[str, tuple[str, int]]:
        return {n: self.slots[n] for n in names}

    def written(self, names: Iterable[str]) -> list[int]:
        """Mark tensors written; the packs that are now complete."""
        done = []
        for n in names:
            i = self.pack_of[n]
            self.left[i].discard(n)
            if not self.left[i] and self.digests[i] is None:
                done.append(i)
        return done

    def finish(self, i: int) -> str:
        """Hash a complete pack (it was just written: read back from the page cache) and move
        it into the store under its blob digest."""
        digest = hash_file(self.paths[i], keys.blob_hasher())
        dest = self.store.object_path(digest)
        size = self.paths[i].stat().st_size
        if dest.exists():
            self.paths[i].unlink()
        else:
            settle(self.paths[i])  # its stat, remembered below, vouches for it until it changes
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(self.paths[i], dest)
            self.store.stats.add(written=size, objects=1)
            self.store.mark_unsynced()  # one syncfs before the listing that names it
            # Publish links packs; a write through a published link must not go unseen
            self.store.sources.remember(dest, digest, file_ident(dest))
        self.digests[i] = digest
        return digest

    def entry(self, name: str, entry: dict) -> dict:
        """A tensor's listing entry once its pack is named."""
        return {**entry, "pack": {"file": self.digests[self.pack_of[name]], "tensor": name}}

    def discard(self) -> None:
        for i, p in enumerate(self.paths):
            if self.digests[i] is None:
                p.unlink(missing_ok=True)


class PackWriter:
    """What a per-tensor task is given as its store: reads go to the store, each tensor it
    writes goes to its slot in a pack (``quantize_entry`` and ``dataaware.quantize_entry``
    write through ``put_row_blocks``)."""

    def __init__(self, store, slots: dict[str, tuple[str, int]]):
        self.store, self.slots = store, slots

    def __getattr__(self, name):  # iter_rows, read_tensor, header, ...: the store's own
        return getattr(self.store, name)

    def _write(self, name: str, dtype: str, shape, chunks: Iterable) -> dict:
        path, off = self.slots[name]
        if getattr(self.store, "detached", False):  # a worker without the client's disk
            return self._detached(name, dtype, shape, chunks, (path, off))
        want = nbytes(dtype, shape)
        h = keys.tensor_hasher(dtype, shape)
        done = 0
        with DirectRange(path, off, want, sync=SYNC_WRITES) as out:
            for c in chunks:
                data = memoryview(np.ascontiguousarray(c, dtype=DTYPES[dtype])).cast("B")
                if done + len(data) > want:
                    break
                h.update(data)
                out.write(data)
                done += len(data)
        if done != want:
            raise StoreError(
                f"tensor {name!r}: blocks add up to {done} bytes or more, expected {want} "
                f"for {dtype}{list(shape)}"
            )
        self.store.stats.add(written=done)
        # the pack's name is known once its last tensor is in: ``PackSet.entry`` fills it
        pack = {"file": None, "tensor": name}
        return {"dtype": dtype, "shape": list(shape), "digest": keys.finish(h), "pack": pack}

    def _detached(self, name: str, dtype: str, shape, chunks: Iterable, slot) -> dict:
        """On a worker that cannot reach the pack (``detached.py``): an object of its own, which
        the client puts in the slot."""
        e = self.store.put_tensor_chunks(dtype, shape, chunks)
        self.store.placed.append({**e, "slot": list(slot)})
        return {**e, "pack": {"file": None, "tensor": name}}

    def put_row_blocks(self, rows: int, blocks, stream: str) -> dict[str, dict]:
        """``store.row_blocks`` into their slots."""
        return row_blocks(
            rows,
            blocks,
            stream,
            self._write,
            lambda name, dtype, arr: self._write(name, dtype, list(arr.shape), [arr]),
        )

    def copy(self, name: str, entry: dict) -> dict:
        """A passthrough tensor into its slot, in blocks of rows (the bf16 lm_head is 1 GB)."""
        return self._write(name, entry["dtype"], entry["shape"], self.store.iter_rows(entry))
