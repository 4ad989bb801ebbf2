"""The source index: content digests of files outside the store (sources, published shards).

A file is hashed once and its digest remembered under its stat (device, inode, size, mtime,
ctime); a later stat that matches vouches for the digest (the racy-git rule guards the
tick in which a write could go unseen). The index also answers the reverse question, which
local file has a given content, so artifacts name source bytes by digest, never by path.

Layout under ``sources/``: ``<fan(path digest)>`` holds a path's record and
``<fan(content digest)>`` the list of paths known to have that content.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from buildkit.core import keys
from buildkit.core.errors import SourceError
from buildkit.store.fsio import RACY_TICK_NS, atomic_write, stat_ident
from buildkit.store.layout import fan

HASH_CHUNK = 4 << 20  # source files are hashed through a buffer of this size
HASH_READERS = 4  # files hashed at once: a disk serves several streams faster than one


class SourceIndex:
    """Digests of local files by stat, and local files by digest."""

    def __init__(self, root: Path, tmp: Path, lock: Callable, stats=None):
        self.root, self.tmp, self._lock, self.stats = root, tmp, lock, stats
        self._threads = threading.Lock()
        self._resolved: dict[str, tuple[Path, list[int]]] = {}

    def digest_file(self, path: str | Path, rehash: bool = False) -> str:
        """Content digest of a file, remembered by its stat and re-hashed when that changes."""
        return self.digest_files([path], rehash)[0]

    def digest_files(
        self,
        paths: Iterable[str | Path],
        rehash: bool = False,
        on_hash: Callable[[int], None] | None = None,
    ) -> list[str]:
        """``digest_file`` of each path; files not remembered are hashed ``HASH_READERS`` at a
        time. ``on_hash(bytes)`` is called once with their total size before the first is read."""
        paths = [Path(p).absolute() for p in paths]
        known = {p: None if rehash else self.remembered(p) for p in paths}
        todo = [p for p, d in known.items() if d is None]
        if todo and on_hash is not None:
            on_hash(sum(p.stat().st_size for p in todo))
        if len(todo) == 1:
            known[todo[0]] = self._hash_file(todo[0])
        elif todo:
            with ThreadPoolExecutor(min(HASH_READERS, len(todo)), thread_name_prefix="hash") as ex:
                known.update(zip(todo, ex.map(self._hash_file, todo)))
        return [known[p] for p in paths]

    def remembered(self, path: Path) -> str | None:
        """The remembered digest of ``path`` if its stat still vouches for it, else None."""
        st = path.stat()
        with contextlib.suppress(FileNotFoundError, ValueError, KeyError):
            e = json.loads(self._entry(path).read_text())
            if e["stat"] == stat_ident(st) and e["recorded_ns"] - st.st_mtime_ns > RACY_TICK_NS:
                return e["digest"]
        return None

    def _entry(self, path: Path) -> Path:
        return fan(self.root, keys.digest_json("path", str(path)))

    def _hash_file(self, path: Path) -> str:
        """Hash a file and remember its digest under its stat (taken before reading)."""
        ident = stat_ident(path.stat())
        h = keys.blob_hasher()
        buf = bytearray(HASH_CHUNK)  # one buffer, refilled: no fresh pages for every chunk
        view = memoryview(buf)
        with open(path, "rb", buffering=0) as f:
            if hasattr(os, "posix_fadvise"):  # read once, front to back: a larger readahead
                with contextlib.suppress(OSError):
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
            while n := f.readinto(buf):
                h.update(view[:n])
                if self.stats is not None:
                    self.stats.add(read=n)
        digest = keys.finish(h)
        self.remember(path, digest, ident)
        return digest

    def remember(self, path: str | Path, digest: str, ident: list[int]) -> None:
        """Record ``path``'s digest under its stat (``fsio.file_ident``).

        Files that share its inode (hard links) share its bytes: their records move to the new
        stat too, since linking changes the inode's ctime. The path is listed under its digest
        before its own record is written, so a kill in between leaves a listed path that is
        merely hashed again, never a remembered one that cannot be found by digest."""
        path = Path(path).absolute()
        rec = {"path": str(path), "stat": ident, "digest": digest, "recorded_ns": time.time_ns()}
        by_digest = fan(self.root, digest)
        # The path list is read, extended and written back under both locks: threads and processes.
        with self._threads, self._lock(keys.digest_json("sources", digest)):
            paths = set()
            with contextlib.suppress(FileNotFoundError, ValueError):
                paths = set(json.loads(by_digest.read_text()))
            if str(path) not in paths:
                atomic_write(by_digest, keys.canonical_json(sorted(paths | {str(path)})), self.tmp)
            atomic_write(self._entry(path), keys.canonical_json(rec), self.tmp)
            for other in sorted(paths - {str(path)}):
                with contextlib.suppress(FileNotFoundError, ValueError, KeyError):
                    e = json.loads(self._entry(Path(other)).read_text())
                    if e["digest"] == digest and e["stat"][:2] == ident[:2]:
                        e["stat"] = ident
                        atomic_write(self._entry(Path(other)), keys.canonical_json(e), self.tmp)

    def find(self, digest: str) -> Path | None:
        """A local path whose current content has this digest, if one is known (its stat
        checked on every call). Files whose stat vouches come first; one whose stat changed is
        hashed again only if none does."""
        known = self._resolved.get(digest)
        if known is not None:
            path, ident = known
            with contextlib.suppress(OSError):
                if stat_ident(path.stat()) == ident:
                    return path
        paths: list[Path] = []
        with contextlib.suppress(FileNotFoundError, ValueError):
            paths = [Path(p) for p in json.loads(fan(self.root, digest).read_text())]
        for check in (self.remembered, self.digest_file):
            for p in paths:
                with contextlib.suppress(OSError):
                    if check(p) == digest:
                        self._resolved[digest] = (p, stat_ident(p.stat()))
                        return p
        return None

    def resolve(self, digest: str) -> Path:
        """``find``, or a SourceError saying what to do."""
        path = self.find(digest)
        if path is not None:
            return path
        raise SourceError(
            f"no local file has content {keys.short(digest)} any more (the source changed "
            "or moved since it was fetched); run the build again to re-fetch"
        )

    def forget_gone(self, dry_run: bool) -> tuple[int, int]:
        """Drop the records of files that no longer exist, and those paths from the digest
        lists (a list left empty goes). Returns how many path records go and their bytes."""
        gone = freed = 0
        with self._threads:
            for p in sorted(self.root.glob("*/*")):
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
                            atomic_write(p, keys.canonical_json(live), self.tmp)
                        continue
                else:
                    continue
                freed += p.stat().st_size
                if not dry_run:
                    p.unlink()
        return gone, freed
