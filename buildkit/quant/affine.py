"""mlx's affine quantization of bf16 weights, byte for byte, fused with its error (numba).

``mx.quantize`` on the CPU is a scalar loop (mlx/backend/cpu/quantized.cpp): per group of
``group`` weights along the last axis, float32 min and max, ``scale = max((max - min) / n_bins,
1e-7)`` signed toward the larger magnitude, the edge snapped to a whole code, codes
``rint((w - bias) / scale)`` clamped to ``[0, n_bins]``, packed as little-endian bit fields, the
scale and bias stored as bf16 (round to nearest even). This is the same arithmetic in the same
float32 operations (no fastmath, so no reassociation or contraction), and in the same pass it
takes verify's figure: ``sum |scale * code + bias - w|`` and ``sum |w|`` with the scale and
bias as stored, in ``qerror``'s order. Quantizing and then measuring was two passes over the
block; this is one (``bench/kernel_bench.py``, 2026-12-08: 5.5-6.5 ns a weight, against
mx.quantize's 7.6-8.9 and 9.4-13.3 with ``qerror``'s sums). Its bytes are
checked against ``mx.quantize`` in tests; a block with a non-finite weight or scale is left
to ``mx.quantize`` (``quantize`` returns None), whose handling of those this does not copy.
Compiled on first use and cached on disk (``cache=True``).
"""

from __future__ import annotations

import numba
import numpy as np

BITS = (2, 3, 4, 5, 6, 8)


@numba.njit(cache=True, nogil=True)
def group_params(w_min, w_max, n_bins):
    """mlx's (scale, bias) of a group from its float32 min and max (finite)."""
    mask = abs(w_min) > abs(w_max)
    scale = (w_max - w_min) / n_bins
    eps = np.float32(1e-7)
    scale = eps if scale < eps else scale  # std::max(scale, eps)
    if not mask:
        scale = -scale
    edge = w_min if mask else w_max
    q0 = np.rint(edge / scale)
    bias = np.float32(0.0)
    if q0 != np.float32(0.0):
        scale = edge / q0
        bias = edge
    return scale, bias


@numba.njit(cache=True, nogil=True)
def run_params(v, n_bins):
    """mlx's float32 (scale, bias) of one group's values v (float32, min and max folded as
    std::min and std::max do), and False if a value or the scale is not finite."""
    w_min = np.float32(np.inf)
    w_max = np.float32(-np.inf)
    for x in v:
        if x != x:  # NaN: std::max and std::min would pass over it
            return w_min, w_max, False
        w_max = x if w_max < x else w_max  # std::max(w_max, x)
        w_min = x if x < w_min else w_min  # std::min(w_min, x)
    if not (np.isfinite(w_min) and np.isfinite(w_max)):
        return w_min, w_max, False
    scale, bias = group_params(w_min, w_max, n_bins)
    return scale, bias, bool(np.isfinite(scale))


@numba.njit(cache=True, nogil=True)
def rows_params(v, bits, scales, biases):
    """mlx's float32 (scale, bias) of each row of a group v [R, group] (float32, any strides),
    before they are rounded to the stored dtype; False if a value or scale is not finite."""
    n_bins = np.float32((1 << bits) - 1)
    for r in range(v.shape[0]):
        s, b, ok = run_params(v[r], n_bins)
        if not ok:
            return False
        scales[r] = s
        biases[r] = b
    return True


@numba.njit(cache=True, nogil=True)
def pack_codes(codes, bits, pr, pos):
    # codes [n] -> little-endian bit fields (mx.quantize's layout) in the bytes pr from pos: 8
    # codes are ``bits`` bytes; 4, 6 and 8 bits a byte or three at a time, without the 64-bit
    # word (~10%: RESULTS). n * bits a multiple of 8 (4 and 6 bits: n even, a multiple of 4)
    group = codes.size
    if bits == 4:
        for j in range(group // 2):
            pr[pos + j] = np.uint8(codes[2 * j] | (codes[2 * j + 1] << np.uint32(4)))
    elif bits == 8:
        for j in range(group):
            pr[pos + j] = np.uint8(codes[j])
    elif bits == 6:  # four codes in three bytes
        for j in range(group // 4):
            c0, c1, c2, c3 = codes[4 * j], codes[4 * j + 1], codes[4 * j + 2], codes[4 * j + 3]
            p = pos + 3 * j
            pr[p] = np.uint8((c0 | (c1 << np.uint32(6))) & np.uint32(0xFF))
            pr[p + 1] = np.uint8(((c1 >> np.uint32(2)) | (c2 << np.uint32(4))) & np.uint32(0xFF))
            pr[p + 2] = np.uint8(((c2 >> np.uint32(4)) | (c3 << np.uint32(2))) & np.uint32(0xFF))
    else:
        for j in range(0, group, 8):
            v = np.uint64(0)
            for k in range(8):
                v |= np.uint64(codes[j + k]) << np.uint64(k * bits)
            for k in range(bits):
                pr[pos + k] = np.uint8((v >> np.uint64(8 * k)) & np.uint64(0xFF))
            pos += bits


@numba.njit(cache=True, nogil=True)
def _quantize(src, bits, group, packed, scales, biases):
    # src [R, C] uint16 (bf16 bits); packed [R, C * bits / 8] uint8; scales, biases
    # [R, C / group] uint16 (bf16 bits). Returns (sum |dequantized - w|, sum |w|, finite).
    R, C = src.shape
    n_bins = np.float32((1 << bits) - 1)
    zero = np.float32(0.0)
    wide = np.empty(C, np.uint32)
    xf = wide.view(np.float32)  # the row in float32: bf16 is its top 16 bits
    codes = np.empty(group, np.uint32)
    fb = np.empty(1, np.float32)
    ub = fb.view(np.uint32)  # a float32's bits and back
    num = 0.0
    den = 0.0
    for r in range(R):
        xr, pr = src[r], packed[r]
        for c in range(C):
            wide[c] = np.uint32(xr[c]) << 16
        rn = zero
        rd = zero
        for gi in range(C // group):
            lo = gi * group
            scale, bias, ok = run_params(xf[lo : lo + group], n_bins)
            if not ok:
                return num, den, False
            # to bf16, round to nearest even (mlx's float -> bfloat16 for finite values)
            fb[0] = scale
            u = ub[0]
            sb = np.uint16((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16)
            fb[0] = bias
            u = ub[0]
            bb = np.uint16((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16)
            scales[r, gi] = sb
            biases[r, gi] = bb
            for j in range(group):
                q = np.rint((xf[lo + j] - bias) / scale)
                q = zero if q < zero else q
                q = n_bins if q > n_bins else q
                codes[j] = np.uint32(q)
            pack_codes(codes, bits, pr, lo * bits // 8)
            # the error with the scale and bias as stored, in qerror's order
            ub[0] = np.uint32(sb) << 16
            sf = fb[0]
            ub[0] = np.uint32(bb) << 16
            bf = fb[0]
            for j in range(group):
                x = xf[lo + j]
                rn += abs(np.float32(codes[j]) * sf + bf - x)
                rd += abs(x)
        num += rn
        den += rd
    return num, den, True


@numba.njit(cache=True, nogil=True)
def _dequantized(src, bits, group, out):
    # src [R, C] uint16 (bf16 bits) -> out [R, C] float32: what _quantize stores, dequantized
    # (codes from mlx's float32 scale and bias, then code * scale + bias with them as stored),
    # without packing codes to unpack them again. False if a weight or scale is not finite.
    R, C = src.shape
    n_bins = np.float32((1 << bits) - 1)
    zero = np.float32(0.0)
    wide = np.empty(C, np.uint32)
    xf = wide.view(np.float32)
    fb = np.empty(1, np.float32)
    ub = fb.view(np.uint32)
    for r in range(R):
        xr = src[r]
        for c in range(C):
            wide[c] = np.uint32(xr[c]) << 16
        for gi in range(C // group):
            lo = gi * group
            scale, bias, ok = run_params(xf[lo : lo + group], n_bins)
            if not ok:
                return False
            fb[0] = scale
            u = ub[0]
            ub[0] = ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16) << 16
            sf = fb[0]
            fb[0] = bias
            u = ub[0]
            ub[0] = ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16) << 16
            bf = fb[0]
            for j in range(lo, lo + group):
                q = np.rint((xf[j] - bias) / scale)
                q = zero if q < zero else q
                q = n_bins if q > n_bins else q
                out[r, j] = q * sf + bf
    return True


def quantize(block: np.ndarray, bits: int, group: int):
    """A bf16 block (uint16 bit patterns, any leading shape) quantized as ``mx.quantize`` does:
    ``(weight uint32, scales, biases)`` as (array, "BF16") pairs with mlx's shapes, and the
    block's ``(sum |dequantized - w|, sum |w|)``; None if a weight or scale is not finite."""
    cols = block.shape[-1]
    if group % 8 or cols % group or block.size == 0:  # whole bytes per 8 codes; mlx's own checks
        return None
    rows = block.size // cols
    src = np.ascontiguousarray(block).reshape(rows, cols)
    packed = np.empty((rows, cols * bits // 8), np.uint8)
    scales = np.empty((rows, cols // group), np.uint16)
    biases = np.empty((rows, cols // group), np.uint16)
    num, den, finite = _quantize(src, bits, group, packed, scales, biases)
    if not finite:
        return None
    lead = block.shape[:-1]
    weight = packed.view(np.uint32).reshape(*lead, -1)
    return (
        [
            (weight, "U32"),
            (scales.reshape(*lead, -1), "BF16"),
            (biases.reshape(*lead, -1), "BF16"),
        ],
        (num, den),
    )


def like_mx(block: np.ndarray, dtype: str, bits: int, group: int, mode: str = "affine"):
    """``mx.quantize`` of a block of rows in safetensors ``dtype``: its (weight, scales, biases)
    as (array, dtype) pairs, and the block's rel-L1 sums when this module's kernel made them
    (bf16, affine), else None. Every data-agnostic quantization goes through here, so each
    gets the kernel where it applies and mx.quantize where it does not."""
    if dtype == "BF16" and mode == "affine" and bits in BITS:
        done = quantize(block, bits, group)
        if done is not None:
            return done
    import mlx.core as mx

    from buildkit.formats.tensors import from_mlx, to_mlx

    q = mx.quantize(to_mlx(block, dtype), group_size=group, bits=bits, mode=mode)
    return [from_mlx(a) for a in q], None


def dequantized_like_mx(block: np.ndarray, dtype: str, bits: int, group: int, mode: str = "affine"):
    """``like_mx``'s weights dequantized to float32 [..., C] (verify's data-agnostic
    reference): for bf16 affine in one compiled pass, without packing and unpacking codes."""
    if dtype == "BF16" and mode == "affine" and bits in BITS and group % 8 == 0:
        cols = block.shape[-1]
        if cols % group == 0 and block.size:
            src = np.ascontiguousarray(block).reshape(-1, cols)
            out = np.empty(src.shape, np.float32)
            if _dequantized(src, bits, group, out):
                return out.reshape(block.shape)
    from buildkit.formats.tensors import dequantize, to_float32

    ((w, _), (s, sdt), (b, _)), _ = like_mx(block, dtype, bits, group, mode)
    return dequantize(w, to_float32(s, sdt), to_float32(b, sdt), bits, group)
