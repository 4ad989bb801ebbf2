"""Streaming safetensors I/O that never holds more than one tensor.

Tensors travel as numpy arrays of their *storage* dtype: bf16 is carried as
uint16 bit patterns, so no value is ever rounded on the way through. Headers
are parsed and checked before anything is allocated: a header that claims more
bytes than the file holds, overlapping ranges or unknown dtypes are rejected
with the file and tensor named.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from buildkit.core.errors import SourceError
from buildkit.core.lazy import lazy

np = lazy("numpy", __name__)

# safetensors dtype -> numpy storage dtype (bf16 is stored as uint16 bit patterns)
_DTYPE_CODES = {
    "BF16": "<u2",
    "F16": "<f2",
    "F32": "<f4",
    "F64": "<f8",
    "U8": "u1",
    "I8": "i1",
    "U16": "<u2",
    "I16": "<i2",
    "U32": "<u4",
    "I32": "<i4",
    "U64": "<u8",
    "I64": "<i8",
    "BOOL": "?",
}
ITEMSIZE = {name: int(code[-1]) if code[-1].isdigit() else 1 for name, code in _DTYPE_CODES.items()}


class _Dtypes(Mapping):
    """``DTYPES[name]`` -> numpy dtype; numpy is imported when a dtype is first asked for."""

    def __getitem__(self, name: str):
        return np.dtype(_DTYPE_CODES[name])

    def __iter__(self):
        return iter(_DTYPE_CODES)

    def __len__(self) -> int:
        return len(_DTYPE_CODES)

    def __contains__(self, name) -> bool:
        return name in _DTYPE_CODES


DTYPES = _Dtypes()
MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit
MAX_DIM = 1 << 62  # no real dimension comes near; numpy cannot index past 2**63


def nbytes(dtype: str, shape) -> int:
    n = ITEMSIZE[dtype]
    for d in shape:
        n *= int(d)
    return n


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute file offset of the first byte
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Header:
    path: Path
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]


def read_header(path: str | Path) -> Header:
    """Parse and validate a safetensors header without reading tensor data."""
    path = Path(path)
    head, base, size = _header_json(path)
    metadata = head.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise SourceError(f"{path}: __metadata__ is not an object")
    tensors = {name: _tensor_info(path, name, info, base, size) for name, info in head.items()}
    spans = sorted((t.start, t.end, t.name) for t in tensors.values() if t.end > t.start)
    for (_, e0, n0), (s1, _, n1) in zip(spans, spans[1:]):
        if s1 < e0:
            raise SourceError(f"{path}: tensors {n0!r} and {n1!r} overlap")
    return Header(path, tensors, {str(k): str(v) for k, v in metadata.items()})


def _header_json(path: Path) -> tuple[dict, int, int]:
    """(the header's JSON object, where the data starts, the file's size)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise SourceError(f"{path}: not a safetensors file (shorter than 8 bytes)")
            (hlen,) = struct.unpack("<Q", raw)
            if hlen > MAX_HEADER or 8 + hlen > size:
                raise SourceError(
                    f"{path}: header claims {hlen} bytes but the file has {size}: "
                    "truncated or not a safetensors file"
                )
            blob = f.read(hlen)
    except OSError as e:
        raise SourceError(f"{path}: cannot read: {e.strerror}") from e
    try:
        head = json.loads(blob)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SourceError(f"{path}: header is not valid JSON ({e})") from e
    except RecursionError:
        raise SourceError(
            f"{path}: header is not a safetensors header (JSON nested too deeply)"
        ) from None
    if not isinstance(head, dict):
        raise SourceError(f"{path}: header is not a JSON object")
    return head, 8 + hlen, size


def _tensor_info(path: Path, name: str, info, base: int, size: int) -> TensorInfo:
    """One header entry, checked: a known dtype, a shape of ints, offsets inside the data
    spanning exactly the bytes of that dtype and shape."""
    where = f"{path}: tensor {name!r}"
    data_len = size - base
    if not isinstance(info, dict):
        raise SourceError(f"{where}: entry is not an object")
    dtype, shape, offs = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise SourceError(f"{where}: unsupported dtype {dtype!r}")
    if not (isinstance(shape, list) and all(type(d) is int and 0 <= d < MAX_DIM for d in shape)):
        raise SourceError(f"{where}: shape must be a list of non-negative ints, got {shape!r}")
    if not (
        isinstance(offs, list)
        and len(offs) == 2
        and all(type(o) is int for o in offs)
        and 0 <= offs[0] <= offs[1] <= data_len
    ):
        raise SourceError(
            f"{where}: data_offsets {offs!r} fall outside the {data_len} data bytes "
            "(truncated or corrupt file)"
        )
    want = nbytes(dtype, shape)
    if offs[1] - offs[0] != want:
        raise SourceError(
            f"{where}: {dtype}{shape} needs {want} bytes but data_offsets span {offs[1] - offs[0]}"
        )
    return TensorInfo(name, dtype, tuple(shape), base + offs[0], base + offs[1])


def read_tensor(
    info: TensorInfo, path: str | Path | None = None, fd: int | None = None
) -> np.ndarray:
    """Read one tensor as a numpy array of its storage dtype."""
    out = np.empty(info.shape, DTYPES[info.dtype])
    _pread_into(byte_view(out), info.start, path, fd)
    return out


def read_row_blocks(
    info: TensorInfo,
    path: str | Path,
    n: int,
    step: int,
    slc: tuple | None = None,
    pick: np.ndarray | None = None,
) -> Iterator[np.ndarray]:
    """Rows ``[a, a + step)`` of a tensor's first ``n`` rows in turn, each read alone from the
    file (of ``tensor[..., start:stop, ...]`` along ``slc = (axis, start, stop)`` if given).
    With ``pick`` (sorted row ids), a block holding none of them is not read: it is handed out
    unfilled, its shape kept (a forward pass's experts no token is routed to)."""
    stride = info.nbytes // info.shape[0]
    for a in range(0, n, step):
        b = min(n, a + step)
        part = replace(
            info,
            shape=(b - a, *info.shape[1:]),
            start=info.start + a * stride,
            end=info.start + b * stride,
        )
        if not block_read(pick, a, b - a):
            shape = list(part.shape)
            if slc is not None:
                shape[slc[0]] = slc[2] - slc[1]
            yield np.empty(shape, DTYPES[info.dtype])
            continue
        yield read_slice(part, path, *slc) if slc is not None else read_tensor(part, path)


def picked_rows(pick: np.ndarray | None, a: int, n: int) -> np.ndarray:
    """The rows of a block ``[a, a + n)`` among ``pick`` (sorted row ids; None: every row),
    counted from the block's first."""
    if pick is None:
        return np.arange(n)
    return pick[(pick >= a) & (pick < a + n)] - a


def block_read(pick: np.ndarray | None, a: int, n: int) -> bool:
    """Whether ``read_row_blocks`` reads the block of rows ``[a, a + n)`` with ``pick``: it
    holds a picked row (every block without a pick)."""
    return pick is None or bool(len(picked_rows(pick, a, n)))


def read_slice(info: TensorInfo, path: str | Path, axis: int, start: int, stop: int) -> np.ndarray:
    """Read ``tensor[..., start:stop, ...]`` along ``axis`` without reading the rest."""
    shape = list(info.shape)
    if not (0 <= axis < len(shape) and 0 <= start <= stop <= shape[axis]):
        raise SourceError(
            f"{path}: tensor {info.name!r} {shape} has no slice {axis}:{start}:{stop}"
        )
    inner = ITEMSIZE[info.dtype]
    for d in shape[axis + 1 :]:
        inner *= d
    outer = 1
    for d in shape[:axis]:
        outer *= d
    row, run = shape[axis] * inner, (stop - start) * inner
    shape[axis] = stop - start
    out = np.empty(shape, DTYPES[info.dtype])
    view = byte_view(out)
    fd = os.open(path, os.O_RDONLY)
    try:
        for o in range(outer):
            _pread_into(
                view[o * run : (o + 1) * run], info.start + o * row + start * inner, path, fd
            )
    finally:
        os.close(fd)
    return out


def byte_view(arr: np.ndarray) -> memoryview:
    """A C-contiguous array's memory as bytes, to read into (no zero-filling, no copy)."""
    return memoryview(arr.reshape(-1).view(np.uint8))


def _pread_into(view: memoryview, offset: int, path=None, fd=None) -> None:
    """Fill ``view`` from the file at ``offset`` (the GIL is released while the kernel copies)."""
    own = fd is None
    if own:
        fd = os.open(path, os.O_RDONLY)
    try:
        got, length = 0, len(view)
        while got < length:
            n = os.preadv(fd, [view[got:]], offset + got)
            if n == 0:
                raise SourceError(f"{path or fd}: unexpected end of file at {offset + got}")
            got += n
    finally:
        if own:
            os.close(fd)


def header_bytes(
    entries: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str]
) -> bytes:
    """Serialize a safetensors header for tensors written in the given order."""
    head: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    off = 0
    for name, dtype, shape in entries:
        n = nbytes(dtype, shape)
        head[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    blob = json.dumps(head, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    return struct.pack("<Q", len(blob)) + blob


# ---- bf16 helpers (bit-exact, platform independent) ----


def bf16_to_f32(u16: np.ndarray) -> np.ndarray:
    """bf16 bit patterns -> float32 (exact), widened and shifted in one pass."""
    return np.left_shift(u16, 16, dtype=np.uint32).view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even float32 -> bf16 bit patterns (NaN stays NaN)."""
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        rounded = np.where(nan, np.uint16(0x7FC0), rounded)
    return rounded


def to_float32(arr: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "BF16":
        return bf16_to_f32(arr)
    return arr.astype(np.float32)


def from_float32(x: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "BF16":
        return f32_to_bf16(x)
    return x.astype(DTYPES[dtype])


def to_mlx(arr: np.ndarray, dtype: str):
    import mlx.core as mx

    a = mx.array(arr)
    if dtype == "BF16":
        a = a.view(mx.bfloat16)
    return a


def from_mlx(a) -> tuple[np.ndarray, str]:
    """mlx array -> (numpy storage array, safetensors dtype)."""
    import mlx.core as mx

    if a.dtype == mx.bfloat16:
        return np.array(a.view(mx.uint16)), "BF16"
    arr = np.array(a)
    for name, dt in DTYPES.items():
        if name != "BF16" and arr.dtype == dt:
            return arr, name
    raise TypeError(f"no safetensors dtype for {a.dtype}")


def unpack(packed: np.ndarray, bits: int) -> np.ndarray:
    """mlx's affine packing undone: little-endian bit fields of ``bits`` bits -> uint8 codes.

    A period of ``bits / g`` bytes holds exactly ``8 / g`` codes (``g = gcd(8, bits)``). Each
    period is read into one little-endian lane of ``8 / g`` bytes and each code is moved to its
    own byte of that lane (shift, mask, or over whole arrays, contiguous, which numpy
    vectorizes; writes into strided outputs it does not); the lanes viewed as bytes are then
    the codes in order.
    """
    b = np.ascontiguousarray(packed).view(np.uint8)
    if bits == 8:
        return b
    lead, n = b.shape[:-1], b.shape[-1] * 8 // bits
    g = math.gcd(8, bits)
    per, codes = bits // g, 8 // g
    flat = b.reshape(-1)
    periods = flat.size // per
    word = np.dtype(f"<u{next(w for w in (1, 2, 4, 8) if w >= per)}")  # the read of one period
    lane = np.dtype(f"<u{codes}")
    # A period read as a word starts at its first byte; the last one's word would reach past
    # the buffer, so that one is read from a zero-padded copy.
    main = periods - 1 if word.itemsize > per else periods
    x = np.empty(periods, lane)
    x[:main] = np.ndarray((main,), word, flat, 0, (per,))
    if main < periods:
        tail = np.zeros(word.itemsize, np.uint8)
        tail[:per] = flat[main * per :]
        x[main:] = tail.view(word)
    mask = (1 << bits) - 1
    out = np.bitwise_and(x, lane.type(mask))
    tmp = np.empty_like(x)
    for k in range(1, codes):
        move = (8 - bits) * k  # code k: from bit bits * k up to bit 8 * k
        np.left_shift(x, lane.type(move), out=tmp)
        np.bitwise_and(tmp, lane.type(mask << 8 * k), out=tmp)
        np.bitwise_or(out, tmp, out=out)
    return out.view(np.uint8).reshape(*lead, n)


def dequantize(
    packed: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int, group_size: int
) -> np.ndarray:
    """Affine dequantization in float32 numpy: ``scale * code + bias`` per group.

    An implementation independent of mlx's kernels (and faster than ``mx.dequantize`` on
    CPU), so verify checks mlx's quantizer with arithmetic of its own.
    """
    return dequantize_codes(unpack(packed, bits), scales, biases, group_size)


def dequantize_codes(
    codes: np.ndarray, scales: np.ndarray, biases: np.ndarray, group_size: int
) -> np.ndarray:
    """``dequantize`` of codes already unpacked (uint8 [..., n]), in the same arithmetic."""
    lead, n = codes.shape[:-1], codes.shape[-1]
    q = codes.reshape(*lead, n // group_size, group_size).astype(np.float32)
    q *= scales[..., None]
    q += biases[..., None]
    return q.reshape(*lead, n)


def non_finite(arr: np.ndarray, dtype: str) -> bool:
    """Any NaN or Inf in a storage array (bf16 checked on its exponent bits, without converting)."""
    if dtype == "BF16":
        return bool(((arr & 0x7F80) == 0x7F80).any())
    if arr.dtype.kind == "f":
        return not bool(np.isfinite(arr).all())
    return False
