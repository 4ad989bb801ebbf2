"""Durable writes: atomic_write and write_temp leave whole files or none, DirectFile's exact
bytes, settle."""

from __future__ import annotations

import errno
import os
import time

import numpy as np
import pytest

from buildkit.store.fsio import (
    RACY_TICK_NS,
    DirectFile,
    DirectRange,
    _Buffers,
    atomic_write,
    drop_idle_write_buffers,
    file_ident,
    settle,
    write_temp,
)
from buildkit.store.store import Store

# ---- atomic_write and write_temp -------------------------------------------------------------


def test_atomic_write_leaves_no_temp_files(tmp_path):
    target = tmp_path / "d" / "entry"
    atomic_write(target, b"one", tmp_path / "tmp")
    assert target.read_bytes() == b"one"

    def chunks():
        yield b"half"
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(target, chunks(), tmp_path / "tmp")
    assert target.read_bytes() == b"one"  # the old entry or the new one, never a mix
    assert list((tmp_path / "tmp").iterdir()) == []
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["d", "entry", "tmp"]


def test_atomic_write_returns_the_size_and_replaces_whole(tmp_path):
    target = tmp_path / "a" / "b" / "entry"
    assert atomic_write(target, b"first version") == 13  # parents made
    assert (
        atomic_write(
            target, [b"se", memoryview(b"cond"), bytearray(b"!")], sync=False, sync_dir=False
        )
        == 7
    )
    assert target.read_bytes() == b"second!"
    assert atomic_write(target, b"") == 0 and target.read_bytes() == b""
    assert sorted(p.name for p in target.parent.iterdir()) == [
        "entry"
    ]  # temp files went beside it, and went


def test_atomic_write_over_a_directory_fails_and_leaves_no_temp_file(tmp_path):
    target = tmp_path / "entry"
    target.mkdir()
    (target / "inside").write_bytes(b"kept")
    with pytest.raises(OSError) as e:
        atomic_write(target, b"data", tmp_path / "tmp")
    assert e.value.errno in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST)
    assert list((tmp_path / "tmp").iterdir()) == [] and (target / "inside").read_bytes() == b"kept"


def test_write_temp_names_sizes_and_reports_chunks(tmp_path):
    seen = []
    path, size = write_temp(
        [b"ab", b"cde"], tmp_path / "t", "obj", sync=False, on_chunk=seen.append
    )
    assert size == 5 and path.read_bytes() == b"abcde" and seen == [b"ab", b"cde"]
    assert (
        path.parent == tmp_path / "t"
        and path.name.startswith(f".obj.{os.getpid()}.")
        and path.name.endswith(".tmp")
    )
    again, _ = write_temp(b"abcde", tmp_path / "t", "obj", sync=True, direct=True)
    assert again != path and again.read_bytes() == b"abcde"  # every writer its own temp file


@pytest.mark.parametrize("failure", [OSError("disk full"), KeyboardInterrupt()])
def test_write_temp_removes_its_file_when_the_producer_or_a_check_fails(tmp_path, failure):
    def chunks():
        yield b"x" * 5000
        raise failure

    with pytest.raises(type(failure)):
        write_temp(chunks(), tmp_path, "obj", sync=False, direct=True)
    assert list(tmp_path.iterdir()) == []

    def refuse(chunk):  # on_chunk, e.g. a digest check, refusing the second chunk
        if chunk == b"bad":
            raise failure

    with pytest.raises(type(failure)):
        write_temp([b"good", b"bad"], tmp_path, "obj", sync=False, on_chunk=refuse)
    assert list(tmp_path.iterdir()) == []


# ---- DirectFile ------------------------------------------------------------------------------


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 4097, (8 << 20) + 3])
def test_direct_file_writes_exact_bytes_around_block_boundaries(tmp_path, direct, size):
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    with DirectFile(tmp_path / "f", direct=direct) as f:
        assert f.write(data) == size
    assert (tmp_path / "f").stat().st_size == size and (tmp_path / "f").read_bytes() == data
    # the same bytes in pieces that straddle a small buffer's blocks
    with DirectFile(tmp_path / "g", size=8192, direct=direct, sync=False) as f:
        for i in range(0, size, 3001):
            f.write(data[i : i + 3001])
    assert (tmp_path / "g").read_bytes() == data


def test_direct_file_truncates_an_existing_file_and_takes_any_buffer(tmp_path):
    (tmp_path / "f").write_bytes(b"y" * 10000)
    with DirectFile(tmp_path / "f") as f:
        f.write(np.arange(3, dtype=np.uint16))  # any buffer, counted in bytes
    assert (tmp_path / "f").read_bytes() == np.arange(3, dtype=np.uint16).tobytes()
    with pytest.raises(ValueError, match="buffer size 5000 is not a multiple of 4096"):
        DirectFile(tmp_path / "h", size=5000)


def test_buffers_keep_at_most_keep_idle_and_hand_back_one_of_the_size_asked():
    pool = _Buffers(keep=1)
    a, b = pool.take(4096), pool.take(4096)
    assert a is not b
    pool.release(a)
    pool.release(b)  # one too many: unmapped
    assert pool.idle == [a] and b.closed and not a.closed
    assert pool.take(8192) is not a and pool.take(4096) is a and pool.idle == []
    pool.release(a)
    pool.drop_idle()
    assert pool.idle == [] and a.closed


@pytest.mark.parametrize("direct", [True, False])
def test_direct_file_holds_exactly_the_bytes_written(tmp_path, direct):
    """Direct I/O writes whole blocks from an aligned buffer: the padding must not survive."""
    rnd = np.random.default_rng(0)
    for sizes in ([], [1], [4095], [4096, 1], [8 << 20], [100, (8 << 20) + 3, 5, 70000]):
        parts = [rnd.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]
        with DirectFile(tmp_path / "shard", direct=direct) as f:
            assert f.direct == (direct and hasattr(os, "O_DIRECT"))
            for b in parts:
                f.write(b)
        assert (tmp_path / "shard").read_bytes() == b"".join(parts), sizes


def test_direct_file_goes_on_through_the_page_cache_if_direct_writes_are_refused(
    tmp_path, monkeypatch
):
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT here")
    real_write, calls = os.write, []

    def write(fd, data):  # the second block is refused, as by a file system without direct I/O
        calls.append(len(data))
        if len(calls) == 2:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    data = (
        np.random.default_rng(1).integers(0, 256, (8 << 20) * 2 + 12345, dtype=np.uint8).tobytes()
    )
    with DirectFile(tmp_path / "shard") as f:
        monkeypatch.setattr(os, "write", write)
        f.write(data)
        assert not f.direct
    monkeypatch.undo()
    assert len(calls) >= 3 and (tmp_path / "shard").read_bytes() == data


def _ranges_file(tmp_path, seed: int):
    """A file like a pack: a header, then ranges of many sizes, unaligned, some inside one
    block; and each range's bytes, cut into chunks of any size."""
    rng = np.random.default_rng(seed)
    sizes = [1, 100, 4096, 5000, 9000, 3 << 20, 12345, (8 << 20) + 7, 300, 8192]
    header = rng.integers(0, 256, 77, dtype=np.uint8).tobytes()
    path = tmp_path / "pack"
    with open(path, "wb") as f:
        f.write(header)
        f.truncate(len(header) + sum(sizes))
    datas = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]
    offs = np.cumsum([len(header), *sizes[:-1]]).tolist()
    chunks = [[0, *sorted(rng.integers(0, n + 1, 3).tolist()), n] for n in sizes]
    return path, header, datas, offs, chunks


@pytest.mark.parametrize("seed", range(3))
def test_direct_ranges_fill_neighbouring_parts_of_one_file_at_once(tmp_path, seed):
    """A pack's tensors: neighbouring ranges of one file written by threads at once, in chunks
    of any size; the whole blocks inside a range go direct, the ends shared with a neighbour
    through the page cache, and the file ends up holding every range's bytes."""
    from concurrent.futures import ThreadPoolExecutor

    path, header, datas, offs, chunks = _ranges_file(tmp_path, seed)
    direct = {}

    def fill(i):
        data = memoryview(datas[i])
        with DirectRange(path, offs[i], len(data)) as out:
            direct[i] = out.dfd >= 0
            for a, b in zip(chunks[i], chunks[i][1:]):
                out.write(data[a:b])

    order = np.random.default_rng(seed).permutation(len(datas)).tolist()
    with ThreadPoolExecutor(4) as ex:
        list(ex.map(fill, order))
    assert path.read_bytes() == header + b"".join(datas)
    if hasattr(os, "O_DIRECT"):  # ext4 and xfs take direct I/O: the big ranges used it
        assert direct[5] and direct[7] and not direct[0] and not direct[1]


def test_a_direct_range_goes_on_through_the_page_cache_if_direct_writes_are_refused(
    tmp_path, monkeypatch
):
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT here")
    path, header, datas, offs, _ = _ranges_file(tmp_path, 0)
    real_pwrite, refused = os.pwrite, []

    def pwrite(fd, data, at):  # the first direct write is refused, as by a file system
        if fd == out.dfd and not refused:
            refused.append(at)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, at)

    for i, data in enumerate(datas):
        with DirectRange(path, offs[i], len(data), size=1 << 20) as out:
            monkeypatch.setattr(os, "pwrite", pwrite)
            out.write(data)
            monkeypatch.undo()
    assert refused and path.read_bytes() == header + b"".join(datas)


@pytest.mark.skipif(
    not hasattr(os, "O_DIRECT"), reason="DirectFile buffers only for O_DIRECT writes"
)
def test_direct_writes_reuse_their_page_aligned_buffer(tmp_path):
    """Objects written past the page cache go through one buffer, not a fresh mapping each:
    twenty 2 MB objects fault in far fewer pages than the 512 a fresh buffer would take each."""
    import resource

    store = Store(tmp_path / "store")
    blocks = [np.full(1 << 19, i, np.float32) for i in range(21)]  # made (and faulted) first
    entries = [store.put_tensor_chunks("F32", [1 << 19], [blocks[0]])]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    entries += [store.put_tensor_chunks("F32", [1 << 19], [b]) for b in blocks[1:]]
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert faults < 20 * 512 // 4, f"{faults} page faults for 20 objects of 2 MB"
    for b, e in zip(blocks, entries):  # and each object holds its own bytes
        assert np.array_equal(store.read_tensor(e), b)


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads VmRSS")
def test_idle_write_buffers_stay_resident_until_dropped(tmp_path):
    """The buffer kept for the next direct write is memory the process holds; publish lets it
    go before its load check (the build's peak)."""

    def rss() -> int:
        line = next(x for x in open("/proc/self/status") if x.startswith("VmRSS:"))
        return int(line.split()[1]) * 1024

    with DirectFile(tmp_path / "probe") as f:
        if not f.direct:
            pytest.skip("this file system refuses O_DIRECT: no buffer to keep")
        f.write(b"x")
    drop_idle_write_buffers()
    store = Store(tmp_path / "store")
    store.put_tensor_chunks(
        "F32", [1 << 21], [np.ones(1 << 21, np.float32)]
    )  # fills a whole 8 MB buffer
    before = rss()
    drop_idle_write_buffers()
    assert before - rss() > 6 << 20, f"RSS {before >> 20} -> {rss() >> 20} MB"


# ---- stat identities and settle ----------------------------------------------------------------


def test_settle_moves_a_fresh_mtime_two_ticks_into_the_past_and_leaves_an_old_one(tmp_path):
    p = tmp_path / "f"
    p.write_bytes(b"data")
    before = time.time_ns()
    settle(p)
    st = p.stat()
    assert before - st.st_mtime_ns >= 2 * RACY_TICK_NS - 10_000_000  # timestamps may be coarse
    assert st.st_mtime_ns <= time.time_ns() - 2 * RACY_TICK_NS
    assert p.read_bytes() == b"data"
    old = 1_000_000_000 * 10**9
    os.utime(p, ns=(old, old))
    settle(p)
    assert p.stat().st_mtime_ns == old  # already in the past: not moved forward


def test_file_ident_changes_when_the_file_is_rewritten(tmp_path):
    p = tmp_path / "f"
    p.write_bytes(b"one")
    st = p.stat()
    ident = file_ident(p)
    assert ident == [st.st_dev, st.st_ino, 3, st.st_mtime_ns, st.st_ctime_ns]
    settle(p)
    settled = file_ident(p)
    assert settled[:3] == ident[:3] and settled[3] < ident[3]
    with open(p, "r+b") as f:  # same size, same inode: only the times tell
        f.write(b"two")
    assert file_ident(p)[3] > settled[3]


# ---- readahead ------------------------------------------------------------------------------


def _resident(path, n: int) -> int:
    """How many pages of a file's first n bytes the page cache holds (Linux mincore)."""
    import ctypes
    import mmap

    from buildkit.core.allocator import libc

    with open(path, "rb") as f, mmap.mmap(f.fileno(), n, access=mmap.ACCESS_COPY) as m:
        vec = (ctypes.c_ubyte * -(-n // mmap.PAGESIZE))()
        base = ctypes.addressof(ctypes.c_char.from_buffer(m))
        assert libc().mincore(ctypes.c_void_p(base), ctypes.c_size_t(n), vec) == 0
        resident = sum(v & 1 for v in vec)
        del base  # the mmap closes only with no pointer into it left
        return resident


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="Linux page cache checks")
def test_readahead_leaves_the_ranges_in_the_page_cache_and_skips_what_it_cannot_read(tmp_path):
    """The next layer's bytes are read ahead while this one computes: after readahead they are
    in memory (they were not: dropped first), and a missing file or a range past the end is
    left to the real read to report."""
    from buildkit.store.fsio import readahead

    path = tmp_path / "blob"
    data = np.random.default_rng(0).integers(0, 255, 8 << 20, np.uint8).tobytes()
    path.write_bytes(data)
    with open(path, "rb") as f:
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    pages = len(data) // os.sysconf("SC_PAGE_SIZE")
    if _resident(path, len(data)) > pages // 4:
        pytest.skip("this file system keeps the pages (no DONTNEED)")
    readahead([(tmp_path / "missing", 0, 10), (path, 4 << 20, 8 << 20), (path, 0, 4 << 20)])
    assert _resident(path, len(data)) == pages
    assert path.read_bytes() == data


def test_data_extents_leave_out_a_sparse_files_holes_and_keep_its_data(tmp_path):
    """A sparse source's holes read as zeros the kernel makes on the CPU: readahead reads only
    the data. Where the file system cannot tell holes apart, the whole range is data."""
    from buildkit.store.fsio import data_extents

    path, mb = tmp_path / "sparse", 1 << 20
    with open(path, "wb") as f:
        f.write(b"a" * mb)
        f.seek(64 * mb)
        f.write(b"b" * mb)
        f.truncate(128 * mb)
    with open(path, "rb") as f:
        if os.lseek(f.fileno(), 0, os.SEEK_HOLE) != mb:
            pytest.skip("this file system reports no holes")
        assert list(data_extents(f.fileno(), 0, 128 * mb)) == [(0, mb), (64 * mb, 65 * mb)]
        assert list(data_extents(f.fileno(), mb // 2, 64 * mb + 10)) == [
            (mb // 2, mb),
            (64 * mb, 64 * mb + 10),
        ]
        assert list(data_extents(f.fileno(), 66 * mb, 128 * mb)) == []
        assert list(data_extents(f.fileno(), 2 * mb, 3 * mb)) == []


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="Linux page cache checks")
def test_the_store_reads_a_tensor_ahead_by_its_entry_and_skips_one_it_does_not_hold(tmp_path):
    store = Store(tmp_path / "store")
    entry = store.put_tensor("F32", np.random.default_rng(0).standard_normal(1 << 20, np.float32))
    path = store.object_path(entry["digest"])
    with open(path, "rb") as f:
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    size, pages = path.stat().st_size, -(-path.stat().st_size // os.sysconf("SC_PAGE_SIZE"))
    if _resident(path, size) > pages // 4:
        pytest.skip("this file system keeps the pages (no DONTNEED)")
    gone = {**entry, "digest": "xxh3_128:" + "0" * 32}
    store.prefetch([gone, entry]).result()
    assert _resident(path, size) == pages
    store.prefetch([gone]).result()  # a missing object: left to the real read to report
