"""Safetensors I/O: header validation (file and tensor named), reads and slices, bf16 bits,
sizes, dequantization."""

from __future__ import annotations

import json
import struct
import tracemalloc

import numpy as np
import pytest

from buildkit.core.errors import SourceError
from buildkit.formats.tensors import (
    ITEMSIZE,
    bf16_to_f32,
    f32_to_bf16,
    from_float32,
    header_bytes,
    nbytes,
    non_finite,
    read_header,
    read_slice,
    read_tensor,
    to_float32,
)


def write_st(path, tensors: dict[str, tuple[str, np.ndarray]], metadata=None):
    """A safetensors file written with buildkit's own header serializer."""
    with open(path, "wb") as f:
        f.write(header_bytes([(k, d, a.shape) for k, (d, a) in tensors.items()], metadata or {}))
        for _, a in tensors.values():
            f.write(np.ascontiguousarray(a).tobytes())
    return path


def raw_st(path, head: dict, data: bytes = b""):
    blob = json.dumps(head).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)
    return path


# ---- headers ---------------------------------------------------------------------------------


def test_header_round_trips_offsets_metadata_and_alignment(tmp_path):
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.arange(5, dtype=np.uint16)
    p = write_st(tmp_path / "m.safetensors", {"a": ("F32", a), "b": ("BF16", b)}, {"format": "mlx"})
    hlen = struct.unpack("<Q", p.read_bytes()[:8])[0]
    assert hlen % 8 == 0  # padded with spaces so tensor data is 8-byte aligned
    h = read_header(p)
    assert h.metadata == {"format": "mlx"} and list(h.tensors) == ["a", "b"]
    ta, tb = h.tensors["a"], h.tensors["b"]
    assert (ta.dtype, ta.shape, ta.start, ta.end, ta.nbytes) == (
        "F32",
        (2, 3),
        8 + hlen,
        8 + hlen + 24,
        24,
    )
    assert (tb.start, tb.end, tb.nbytes) == (ta.end, ta.end + 10, 10)
    assert np.array_equal(read_tensor(ta, p), a) and read_tensor(tb, p).dtype == np.uint16
    assert np.array_equal(read_tensor(tb, p), b)
    assert header_bytes([], {}) == struct.pack("<Q", 8) + b"{}      "


BAD_HEADERS = {
    "shorter than 8 bytes": (
        lambda p: p.write_bytes(b"\x01\x02"),
        "not a safetensors file (shorter than 8 bytes)",
    ),
    "truncated header": (
        lambda p: p.write_bytes(struct.pack("<Q", 100) + b'{"a": 1}'),
        "header claims 100 bytes but the file has 16: truncated or not a safetensors file",
    ),
    "not json": (
        lambda p: p.write_bytes(struct.pack("<Q", 4) + b"\xff\xfe{]"),
        "header is not valid JSON",
    ),
    "not an object": (lambda p: raw_st(p, [1, 2]), "header is not a JSON object"),
    "metadata not an object": (
        lambda p: raw_st(p, {"__metadata__": [1]}),
        "__metadata__ is not an object",
    ),
    "entry not an object": (lambda p: raw_st(p, {"w": 3}), "tensor 'w': entry is not an object"),
    "unknown dtype": (
        lambda p: raw_st(p, {"w": {"dtype": "F8", "shape": [1], "data_offsets": [0, 1]}}, b"\0"),
        "tensor 'w': unsupported dtype 'F8'",
    ),
    "negative dim": (
        lambda p: raw_st(p, {"w": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 0]}}),
        "tensor 'w': shape must be a list of non-negative ints, got [-1]",
    ),
    "float dim": (
        lambda p: raw_st(
            p, {"w": {"dtype": "U8", "shape": [2.0], "data_offsets": [0, 2]}}, b"\0\0"
        ),
        "tensor 'w': shape must be a list of non-negative ints, got [2.0]",
    ),
    "offsets past the data": (
        lambda p: raw_st(
            p, {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4
        ),
        "tensor 'w': data_offsets [0, 8] fall outside the 4 data bytes (truncated or corrupt file)",
    ),
    "offsets reversed": (
        lambda p: raw_st(
            p, {"w": {"dtype": "U8", "shape": [0], "data_offsets": [4, 0]}}, b"\0" * 4
        ),
        "tensor 'w': data_offsets [4, 0] fall outside",
    ),
    "size disagrees with shape": (
        lambda p: raw_st(
            p, {"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 12
        ),
        "tensor 'w': F32[3] needs 12 bytes but data_offsets span 8",
    ),
    "overlap": (
        lambda p: raw_st(
            p,
            {
                "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
            },
            b"\0" * 12,
        ),
        "tensors 'a' and 'b' overlap",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_HEADERS))
def test_bad_header_is_refused_naming_the_file_and_what_is_wrong(tmp_path, case):
    make, message = BAD_HEADERS[case]
    path = tmp_path / "bad.safetensors"
    make(path)
    with pytest.raises(SourceError) as e:
        read_header(path)
    assert str(e.value).startswith(f"{path}: "), str(e.value)
    assert message in str(e.value)


def test_missing_file_is_a_source_error_naming_it(tmp_path):
    with pytest.raises(SourceError, match=r"absent\.safetensors: cannot read: No such file"):
        read_header(tmp_path / "absent.safetensors")


def test_header_claiming_absurd_sizes_is_rejected_before_allocating(tmp_path):
    path = tmp_path / "x.safetensors"
    cases = [
        struct.pack("<Q", (1 << 64) - 1) + b"{}",  # header length
        struct.pack("<Q", 90 << 20) + b"{",  # under the header limit, but not in the file
    ]
    for huge in (1 << 40, 1 << 62):
        blob = json.dumps(
            {"w": {"dtype": "F32", "shape": [huge], "data_offsets": [0, 4 * huge]}}
        ).encode()
        cases.append(struct.pack("<Q", len(blob)) + blob + b"\0" * 16)
    for data in cases:
        path.write_bytes(data)
        tracemalloc.start()
        with pytest.raises(SourceError, match="x.safetensors"):
            read_header(path)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < 1 << 20, peak


# ---- reads and slices ------------------------------------------------------------------------


def test_read_slice_equals_slicing_the_whole_tensor(tmp_path):
    rng = np.random.default_rng(0)
    arr = rng.integers(0, 1 << 16, (4, 6, 10), dtype=np.uint16)
    p = write_st(
        tmp_path / "s.safetensors", {"pad": ("U8", np.ones(3, np.uint8)), "w": ("BF16", arr)}
    )
    info = read_header(p).tensors["w"]
    assert np.array_equal(read_tensor(info, p), arr)
    for axis in range(3):
        n = arr.shape[axis]
        for start, stop in ((0, n), (1, n - 1), (2, 3), (n, n)):
            want = np.take(arr, range(start, stop), axis=axis)
            got = read_slice(info, p, axis, start, stop)
            assert got.shape == want.shape and np.array_equal(got, want), (axis, start, stop)
    with pytest.raises(
        SourceError, match=r"s\.safetensors: tensor 'w' \[4, 6, 10\] has no slice 1:2:7"
    ):
        read_slice(info, p, 1, 2, 7)
    with pytest.raises(SourceError, match="has no slice 3:0:1"):
        read_slice(info, p, 3, 0, 1)


def test_a_file_cut_short_after_its_header_was_read_fails_naming_the_offset(tmp_path):
    p = write_st(tmp_path / "t.safetensors", {"w": ("F32", np.arange(8, dtype=np.float32))})
    info = read_header(p).tensors["w"]
    p.write_bytes(p.read_bytes()[:-4])
    with pytest.raises(
        SourceError, match=rf"t\.safetensors: unexpected end of file at {info.end - 4}"
    ):
        read_tensor(info, p)


# ---- bf16 and sizes --------------------------------------------------------------------------


def test_every_bf16_pattern_round_trips_through_float32_and_nan_stays_nan():
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    f = bf16_to_f32(bits)
    assert f.dtype == np.float32
    assert np.array_equal(f.view(np.uint32), bits.astype(np.uint32) << 16)  # exact widening
    back = f32_to_bf16(f)
    nan = np.isnan(f)
    assert nan.sum() == 2 * 127  # exponent all ones, mantissa non-zero, either sign
    assert np.array_equal(back[~nan], bits[~nan])
    assert set(back[nan].tolist()) == {0x7FC0}
    assert np.array_equal(to_float32(bits, "BF16").view(np.uint32), f.view(np.uint32))
    assert np.array_equal(from_float32(f[~nan], "BF16"), bits[~nan])


def test_f32_to_bf16_rounds_to_nearest_even():
    one, ulp = 1.0, 2.0**-7  # bf16 keeps 7 mantissa bits: 1.0 and 1.0 + 2**-7 are neighbours
    x = np.array(
        [one + ulp / 2, one + 3 * ulp / 2, one + ulp / 2 + 2**-20, -(one + ulp / 2), np.inf],
        np.float32,
    )
    assert f32_to_bf16(x).tolist() == [
        0x3F80,
        0x3F82,
        0x3F81,
        0xBF80,
        0x7F80,
    ]  # ties to even; inf stays inf


def test_nbytes_and_itemsizes():
    assert nbytes("BF16", [2, 3]) == 12 and nbytes("F32", (4,)) == 16 and nbytes("F64", []) == 8
    assert nbytes("BOOL", [5]) == 5 and nbytes("I8", [0, 7]) == 0 and nbytes("U64", [2, 2]) == 32
    assert ITEMSIZE == {
        "BF16": 2,
        "F16": 2,
        "F32": 4,
        "F64": 8,
        "U8": 1,
        "I8": 1,
        "U16": 2,
        "I16": 2,
        "U32": 4,
        "I32": 4,
        "U64": 8,
        "I64": 8,
        "BOOL": 1,
    }


def test_non_finite_checks_bf16_exponent_bits_and_floats():
    finite = f32_to_bf16(np.array([0.0, -1.5, 3.0e38], np.float32))
    assert not non_finite(finite, "BF16")
    assert non_finite(np.append(finite, np.uint16(0x7F80)), "BF16")  # +inf
    assert non_finite(np.append(finite, np.uint16(0xFFC1)), "BF16")  # a negative NaN
    assert not non_finite(np.array([1.0, 2.0], np.float32), "F32")
    assert non_finite(np.array([1.0, np.nan], np.float16), "F16")
    assert not non_finite(np.array([0x7F80], np.uint16), "U16")  # integers are never non-finite


# ---- dequantization ----------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_numpy_dequantize_matches_mlx(bits):
    """verify's own dequantization agrees with mx.dequantize (which rounds its output to bf16)."""
    import mlx.core as mx

    from buildkit.formats.tensors import dequantize

    w = mx.random.normal((3, 16, 256), key=mx.random.key(bits)).astype(mx.bfloat16)
    wq, s, b = mx.quantize(w, group_size=64, bits=bits)
    want = np.array(mx.dequantize(wq, s, b, group_size=64, bits=bits).astype(mx.float32))
    got = dequantize(
        np.array(wq), np.array(s.astype(mx.float32)), np.array(b.astype(mx.float32)), bits, 64
    )
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= np.abs(want).max() * 2**-7  # one bf16 rounding


@pytest.mark.parametrize("slc", [None, (2, 2, 6)])
def test_row_blocks_with_a_pick_do_not_read_the_blocks_that_hold_none_of_it(tmp_path, slc):
    """A forward pass reads only the experts some token is routed to (the picked rows' blocks)
    of a source file: the file cut short after the last picked block still reads, the rows
    picked are the file's, and every block keeps its shape. Without a pick it fails."""
    from buildkit.formats.tensors import read_row_blocks

    w = np.arange(16 * 4 * 8, dtype=np.float32).reshape(16, 4, 8)
    path = tmp_path / "m.safetensors"
    write_st(path, {"w": ("F32", w)})
    info = read_header(path).tensors["w"]
    with open(path, "r+b") as f:
        f.truncate(info.start + 12 * w[0].nbytes)  # rows 12..15 are gone
    want = w if slc is None else w[:, :, 2:6]
    pick = np.array([3, 9])
    blocks = list(read_row_blocks(info, path, 16, 4, slc, pick))
    assert [b.shape for b in blocks] == [want[:4].shape] * 4
    assert np.array_equal(blocks[0][3], want[3]) and np.array_equal(blocks[2][1], want[9])
    with pytest.raises(SourceError, match="end of file"):
        list(read_row_blocks(info, path, 16, 4, slc))
