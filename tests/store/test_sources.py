"""The source index: digests of files outside the store by stat, files by digest, hard links,
forgetting."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from buildkit.core import keys
from buildkit.core.errors import SourceError
from buildkit.store.layout import fan
from buildkit.store.store import Store


def old(path, seconds: float = 10) -> None:
    """Age a file's mtime past the racy window, so a stat record of it is trusted."""
    t = time.time() - seconds
    os.utime(path, (t, t))


def test_source_files_hashed_together_are_remembered_and_resolvable(tmp_path):
    """digest_files hashes several files at once: each gets its content digest, the next call
    trusts the stat cache (no bytes read), and two files with the same bytes both resolve.
    Its caller hears (``on_hash``) before any bytes are read, and only then."""
    src = tmp_path / "src"
    src.mkdir()
    rng = np.random.default_rng(0)
    blobs = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in (0, 1, 5 << 20, 3 << 20)]
    blobs.append(blobs[2])  # same content as another file
    files = []
    for i, b in enumerate(blobs):
        files.append(src / f"f{i}")
        files[-1].write_bytes(b)
        t = time.time() - 10  # older than the racy-timestamp window, so the cache is trusted
        os.utime(files[-1], (t, t))
    store = Store(tmp_path / "cache")
    want = [keys.blob_digest(b) for b in blobs]
    told = []  # (bytes to hash, bytes read so far), each time digest_files is about to hash

    def tell(n):
        told.append((n, store.stats.bytes_read))

    assert store.sources.digest_files(files, on_hash=tell) == want
    hashed = store.stats.bytes_read
    assert hashed == sum(map(len, blobs)) and told == [(hashed, 0)]
    again = Store(tmp_path / "cache")
    assert again.sources.digest_files(reversed(files), on_hash=tell) == want[::-1]
    assert again.stats.bytes_read == 0 and told == [(hashed, 0)]  # remembered by stat, not re-read
    assert store.sources.digest_files(files, rehash=True, on_hash=tell) == want
    assert store.stats.bytes_read == 2 * hashed and told == [(hashed, 0), (hashed, hashed)]
    files[2].unlink()  # one of the two same-content files goes: the other still resolves
    assert Store(tmp_path / "cache").sources.resolve(want[2]) == files[4]
    files[2].write_bytes(blobs[3][:1] + blobs[2][1:])  # back, changed: the other is found unread
    fresh = Store(tmp_path / "cache")
    assert fresh.sources.resolve(want[2]) == files[4] and fresh.stats.bytes_read == 0
    files[4].write_bytes(b"")  # both changed: each is hashed again, and neither has the bytes
    assert fresh.sources.find(want[2]) is None and fresh.stats.bytes_read == len(blobs[2])


def test_gc_forgets_the_records_of_deleted_files(tmp_path):
    """Hashed files that are gone leave no record: neither their path's nor a place in the
    list of paths with their content; files still there keep theirs."""
    store = Store(tmp_path / "store")
    a, b, c = (tmp_path / n for n in "abc")
    a.write_bytes(b"same")
    b.write_bytes(b"same")
    c.write_bytes(b"other")
    same, _, other = store.sources.digest_files([a, b, c])
    a.unlink()
    c.unlink()

    def mentions(path) -> int:
        return sum(
            str(path) in f.read_text() for f in (store.root / "sources").rglob("*") if f.is_file()
        )

    dry = store.gc(dry_run=True)
    assert dry["files"] == 2 and mentions(a) == 2 and mentions(c) == 2
    records = {f: f.stat().st_size for f in (store.root / "sources").rglob("*") if f.is_file()}
    done = store.gc()
    assert done == dry and done["files"] == 2
    # the bytes freed: a's and c's path records and c's emptied list (a's list still names b)
    assert done["bytes"] == sum(n for f, n in records.items() if not f.exists())
    assert sum(1 for f in records if not f.exists()) == 3
    assert mentions(a) == mentions(c) == 0 and mentions(b) == 2
    assert store.sources.find(same) == b and store.sources.find(other) is None
    assert store.gc()["files"] == 0


def test_fan_splits_the_hex_digest_after_two_characters(tmp_path):
    d = keys.blob_digest(b"x")
    h = d.removeprefix("xxh3_128:")
    assert fan(tmp_path, d) == tmp_path / h[:2] / h[2:]
    assert fan(tmp_path, h) == fan(tmp_path, d)


def test_a_digest_is_remembered_by_stat_and_hashed_again_after_a_change(tmp_path):
    f = tmp_path / "src.bin"
    f.write_bytes(b"a" * 1000)
    old(f)
    store = Store(tmp_path / "cache")
    first = store.sources.digest_file(f)
    assert first == keys.blob_digest(b"a" * 1000) and store.stats.bytes_read == 1000
    assert store.sources.remembered(f.absolute()) == first
    assert (
        store.sources.digest_file(f) == first and store.stats.bytes_read == 1000
    )  # by stat: not read
    with open(f, "r+b") as fh:  # same size, same inode, new bytes: only the mtime tells
        fh.write(b"b")
    t = time.time() - 5
    os.utime(f, (t, t))  # a new mtime, still old enough not to be racy
    assert store.sources.remembered(f.absolute()) is None
    second = store.sources.digest_file(f)
    assert second == keys.blob_digest(b"b" + b"a" * 999) != first and store.stats.bytes_read == 2000
    assert store.sources.digest_file(f) == second and store.stats.bytes_read == 2000
    assert store.sources.digest_file(f, rehash=True) == second and store.stats.bytes_read == 3000


def test_a_file_written_within_the_racy_window_is_not_vouched_for_by_its_stat(tmp_path):
    """A write in the same timestamp tick as the hash could go unseen: such a record is kept but
    not trusted, so the file is hashed again until its mtime is safely older than the record."""
    f = tmp_path / "fresh.bin"
    f.write_bytes(b"new")
    store = Store(tmp_path / "cache")
    d = store.sources.digest_file(f)
    assert store.sources.remembered(f.absolute()) is None
    assert store.sources.digest_file(f) == d and store.stats.bytes_read == 6  # read twice


def test_find_resolves_by_digest_and_resolve_says_what_to_do(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(b"payload")
    b.write_bytes(b"other")
    old(a)
    old(b)
    store = Store(tmp_path / "cache")
    da, db = store.sources.digest_files([a, b])
    assert store.sources.find(da) == a and store.sources.resolve(db) == b
    assert Store(tmp_path / "cache").sources.find(da) == a  # from the records, in a new process
    missing = keys.blob_digest(b"never seen")
    assert store.sources.find(missing) is None
    with pytest.raises(SourceError) as e:
        store.sources.resolve(missing)
    assert str(e.value) == (
        f"no local file has content {keys.short(missing)} any more (the source changed "
        "or moved since it was fetched); run the build again to re-fetch"
    )
    a.write_bytes(b"changed")  # the only file with da's bytes: found out on the next find
    assert store.sources.find(da) is None


def test_a_hard_link_shares_the_record_of_its_inode(tmp_path):
    """Linking changes the inode's ctime, so the first name's record stops vouching; hashing the
    new name moves both records to the new stat, and neither is read again."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(np.arange(5000, dtype=np.uint8).tobytes())
    old(a)
    store = Store(tmp_path / "cache")
    d = store.sources.digest_file(a)
    os.link(a, b)
    assert store.sources.remembered(a.absolute()) is None  # ctime moved
    assert store.sources.digest_file(b) == d and store.stats.bytes_read == 2 * 5000
    assert store.sources.remembered(a.absolute()) == d == store.sources.remembered(b.absolute())
    assert store.sources.digest_files([a, b]) == [d, d] and store.stats.bytes_read == 2 * 5000
    listed = (fan(store.root / "sources", d)).read_text()
    assert str(a.absolute()) in listed and str(b.absolute()) in listed


def test_forget_gone_drops_the_records_of_deleted_files_only(tmp_path):
    a, b, c = (tmp_path / n for n in "abc")
    a.write_bytes(b"same")
    b.write_bytes(b"same")
    c.write_bytes(b"other")
    store = Store(tmp_path / "cache")
    same, _, other = store.sources.digest_files([a, b, c])
    records = sorted((store.root / "sources").glob("*/*"))
    assert len(records) == 5  # three path records, two digest lists
    a.unlink()
    c.unlink()
    gone, freed = store.sources.forget_gone(dry_run=True)
    assert (
        gone == 2 and sorted((store.root / "sources").glob("*/*")) == records
    )  # dry run: nothing removed
    assert store.sources.forget_gone(dry_run=False) == (2, freed)
    left = sorted((store.root / "sources").glob("*/*"))
    assert len(left) == 2 and not fan(store.root / "sources", other).exists()
    assert fan(store.root / "sources", same).read_text() == f'["{b.absolute()}"]'
    assert store.sources.find(same) == b.absolute()
    assert store.sources.forget_gone(dry_run=False) == (0, 0)
