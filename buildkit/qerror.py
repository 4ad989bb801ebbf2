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
