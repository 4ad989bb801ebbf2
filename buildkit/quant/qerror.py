"""A quantized block's dequantization error in one compiled pass (numba).

``sum |scale * code + bias - source|`` and ``sum |source|`` over a block of rows, reading the
packed codes, the scales and biases as stored and the bf16 source as it lies: no float32
copies of the block. The same arithmetic as ``tensors.dequantize`` (float32, per group); the
numpy version of it costs about as much as ``mx.quantize`` itself, this a fraction.
Compiled on first use and cached on disk (``cache=True``).
"""

from __future__ import annotations

import numba
import numpy as np

from buildkit.formats.tensors import dequantize, to_float32


@numba.njit(cache=True, nogil=True)
def _sums(packed, scales, biases, src, bits, group):
    # packed [R, C * bits / 8] uint8, scales/biases [R, C / group] float32, src [R, C] uint16
    # (bf16 bit patterns); one row at a time, float32 sums per row, float64 across rows
    R, C = src.shape
    mask = np.uint32((1 << bits) - 1)
    nb = packed.shape[1]
    wide = np.empty(C, np.uint32)
    xf = wide.view(np.float32)  # the row's source in float32: bf16 is its top 16 bits
    num = 0.0
    den = 0.0
    for r in range(R):
        pr, sr, br, xr = packed[r], scales[r], biases[r], src[r]
        for c in range(C):
            wide[c] = np.uint32(xr[c]) << 16
        rn = np.float32(0.0)
        rd = np.float32(0.0)
        for gi in range(C // group):
            s, b = sr[gi], br[gi]
            for c in range(gi * group, (gi + 1) * group):
                off = c * bits
                byte = off >> 3
                shift = off & 7
                v = np.uint32(pr[byte])
                if shift + bits > 8 and byte + 1 < nb:
                    v |= np.uint32(pr[byte + 1]) << 8
                q = (v >> shift) & mask
                rn += abs(np.float32(q) * s + b - xf[c])
                rd += abs(xf[c])
        num += rn
        den += rd
    return num, den


def block_sums(
    packed: np.ndarray,
    scales: np.ndarray,
    biases: np.ndarray,
    src: np.ndarray,
    bits: int,
    group: int,
) -> tuple[float, float]:
    """(sum |dequantized - source|, sum |source|) of a block of a bf16 tensor: ``packed`` the
    uint32 codes as mlx stores them, ``scales`` and ``biases`` float32, ``src`` the bf16 block
    as uint16, all with the same leading rows."""
    cols = src.shape[-1]
    rows = src.size // cols
    p = np.ascontiguousarray(packed).view(np.uint8).reshape(rows, -1)
    return _sums(
        p,
        np.ascontiguousarray(scales, np.float32).reshape(rows, -1),
        np.ascontiguousarray(biases, np.float32).reshape(rows, -1),
        np.ascontiguousarray(src).reshape(rows, cols),
        bits,
        group,
    )


def block_error(
    block: np.ndarray, dtype: str, packed, scales, biases, scales_dtype: str, bits: int, group: int
) -> tuple[float, float]:
    """(sum |dequantized - source|, sum |source|) of a block of rows as stored (``packed``
    codes, ``scales`` and ``biases`` in ``scales_dtype``): verify's rel-L1, measured by the
    step that writes them while the source block is in memory instead of by reading both
    again. buildkit's own float32 dequantization, independent of mlx's kernels; for bf16 (every
    weight of the real model) one compiled pass without float32 copies, faster on the CPU
    than ``mx.dequantize`` (measured before RESULTS.md kept only the latest: ``git log -S
    mx.dequantize bench/RESULTS.md``)."""
    s32, b32 = to_float32(scales, scales_dtype), to_float32(biases, scales_dtype)
    if dtype == "BF16":
        return block_sums(packed, s32, b32, block, bits, group)
    got = dequantize(packed, s32, b32, bits, group)
    src = to_float32(block, dtype).reshape(got.shape)
    den = float(np.abs(src).sum(dtype=np.float32))
    np.subtract(got, src, out=got)
    np.abs(got, out=got)
    return float(got.sum(dtype=np.float32)), den


REL_L1 = "rel_l1"  # a task's figure beside its weight's entry; the quantizing step moves it to meta


def put_measured(
    store, rows: int, blocks, base: str, dtype: str, bits: int, group: int
) -> dict[str, dict]:
    """``store.put_row_blocks`` of a quantized weight's blocks, each ``(source block, {name:
    (array, dtype)})``, with the weight's rel-L1 over every row under ``REL_L1`` in its entry.
    A block may come with its sums already taken, ``(source, outputs, (sum |error|, sum
    |source|))``, by a quantizer that measured them in its own pass (``affine``)."""
    sums = []

    def measured():
        for src, out, *known in blocks:
            if known:
                sums.append(known[0])
                yield out
                continue
            (packed, _), (scales, sdt), (biases, _) = (
                out[f"{base}.{k}"] for k in ("weight", "scales", "biases")
            )
            sums.append(block_error(src, dtype, packed, scales, biases, sdt, bits, group))
            yield out

    entries = store.put_row_blocks(rows, measured(), f"{base}.weight")
    num, den = np.sum(sums, axis=0, dtype=np.float64)
    entries[f"{base}.weight"][REL_L1] = float(num / max(den, 1e-30))
    return entries
