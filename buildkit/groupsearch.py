"""The activation-weighted affine search's inner loop (``dataaware.search``), compiled by numba.

Every candidate of a group is tried in one pass over its weights, ROWS rows of one group
column at a time with the rows on the innermost loop, so each sum runs in a fixed order and
the loop vectorises without reordering it: the bytes do not depend on the SIMD width. A pass
takes KC columns per row into registers before it stores its sums (the compiler cannot keep
them in registers across the columns itself: it cannot prove the arrays apart), and a block
of rows goes through every group column before the next, so its rows' pages stay at hand.
``error_model="numpy"`` (a division by zero is inf, not an exception) lets the per-row
least-squares solve vectorise too. Compiled on first use and cached on disk (numba's
``cache=True``, beside this file).
"""

from __future__ import annotations

import numba
import numpy as np

ROWS = 64  # rows searched together: a block of them, every candidate, stays in L1
KC = 8  # columns per register pass: divides every group size mx.quantize supports


@numba.njit(cache=True, nogil=True, error_model="numpy", inline="always")
def stored(v, storage):
    # v as it will be stored (storage 1: bf16, 2: f16, else float32), round-to-nearest-even,
    # read back; selects, not branches, so a loop over rows of it vectorises
    u = np.float32(v).view(np.uint32)
    a = u & np.uint32(0x7FFFFFFF)
    finite = a < np.uint32(0x7F800000)
    if storage == 1:
        r = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
        return np.uint32(r if finite else u).view(np.float32)
    if storage == 2:
        # f16 normal: 10 mantissa bits, overflowing to inf; subnormal: multiples of 2^-24
        h = (a + np.uint32(0xFFF) + ((a >> np.uint32(13)) & np.uint32(1))) & np.uint32(0xFFFFE000)
        h = h if h <= np.uint32(0x477FE000) else np.uint32(0x7F800000)
        normal = np.uint32((u & np.uint32(0x80000000)) | h).view(np.float32)
        sub = np.float32(np.rint(v * np.float32(2.0**24)) * np.float32(2.0**-24))
        return v if not finite else (normal if a >= np.uint32(0x38800000) else sub)
    return v


@numba.njit(cache=True, nogil=True)
def store_round(x, m, storage):
    # x[:m] in place as stored (``stored``)
    for j in range(m):
        x[j] = stored(x[j], storage)


@numba.njit(cache=True, nogil=True, error_model="numpy")
def search_groups(w, d, grid, n, refine, storage, bq, bs, bb, q_out, s_out, b_out, won):
    # w [R, G, g] float32, d [G, g], base codes bq [R, G, g] uint8, scales/biases [R, G];
    # ROWS rows of one group column at a time, copied to x [g, ROWS]: rows innermost
    R, G, g = w.shape
    m = ROWS
    f = np.float32
    x, x0, xq = np.empty((g, m), f), np.empty((g, m), np.uint8), np.empty((g, m), np.uint8)
    cs, cb, sxx = np.empty(m, f), np.empty(m, f), np.empty(m, f)
    lo, hi, sc = np.empty(m, f), np.empty(m, f), np.empty(m, f)
    sx, e0, e = np.empty(m, f), np.empty(m, f), np.empty(m, f)
    sq, sqq, sqx = np.empty(m, f), np.empty(m, f), np.empty(m, f)
    s, b, inv = np.empty(m, f), np.empty(m, f), np.empty(m, f)
    bs_, bb_, be = np.empty(m, f), np.empty(m, f), np.empty(m, np.float64)
    sws = np.empty(G, f)
    for c in range(G):
        sws[c] = 0.0
        for k in range(g):
            sws[c] += d[c, k]
    for r0 in range(0, R, m):  # a block of rows across every group column: few pages at a time
        rows = min(m, R - r0)
        for c in range(G):
            dc, sw = d[c], sws[c]
            for j in range(rows):  # the block, rows innermost
                wr, qr = w[r0 + j, c], bq[r0 + j, c]
                for k in range(g):
                    x[k, j] = wr[k]
                    x0[k, j] = qr[k]
                cs[j], cb[j] = bs[r0 + j, c], bb[r0 + j, c]
            for j in range(rows, m):  # zeros past the last row
                for k in range(g):
                    x[k, j] = 0.0
                    x0[k, j] = 0
                cs[j], cb[j] = 0.0, 0.0
            for j in range(m):
                lo[j], hi[j], sx[j], sxx[j], e0[j] = x[0, j], x[0, j], 0.0, 0.0, 0.0
            for k in range(g):
                dk, xk, x0k = dc[k], x[k], x0[k]
                for j in range(m):
                    lo[j] = min(lo[j], xk[j])
                    hi[j] = max(hi[j], xk[j])
                    sx[j] += dk * xk[j]
                    sxx[j] += dk * (xk[j] * xk[j])
                    r = cs[j] * f(x0k[j]) + cb[j] - xk[j]
                    e0[j] += dk * (r * r)
            for j in range(m):
                be[j] = np.inf
            for t in grid:
                for j in range(m):
                    span = hi[j] - lo[j] if hi[j] > lo[j] else f(1.0)
                    sc[j] = (n + t) / span
                    b[j], inv[j] = lo[j], sc[j]
                for _ in range(refine + 1):
                    # codes against (b, inv), then the weighted least-squares (s, b) for
                    # them, rounded as stored
                    for j in range(m):
                        sq[j], sqq[j], sqx[j] = 0.0, 0.0, 0.0
                    for k0 in range(0, g, KC):
                        for j in range(m):  # KC columns into registers, then stored
                            a0, a1, a2, bj, ij = sq[j], sqq[j], sqx[j], b[j], inv[j]
                            for kk in range(KC):
                                xk = x[k0 + kk, j]
                                q = min(max(np.rint((xk - bj) * ij), f(0.0)), n)
                                dq = dc[k0 + kk] * q
                                a0 += dq
                                a1 += dq * q
                                a2 += dq * xk
                            sq[j], sqq[j], sqx[j] = a0, a1, a2
                    for j in range(m):
                        det = sw * sqq[j] - sq[j] * sq[j]
                        ok = det > f(1e-9) * sw * max(sqq[j], f(1e-30))
                        safe = det if ok else f(1.0)
                        sj = (sw * sqx[j] - sq[j] * sx[j]) / safe if ok else f(0.0)
                        bj = (sqq[j] * sx[j] - sq[j] * sqx[j]) / safe if ok else sx[j] / sw
                        s[j], b[j] = stored(sj, storage), stored(bj, storage)
                        inv[j] = f(1.0) / s[j] if s[j] > 0 else f(0.0)
                for j in range(m):
                    # the weighted error of the last codes under the final (s, b), from the
                    # sums (float64: it is a small difference of large terms); the codes
                    # re-fit to (s, b) can only do better, so it ranks the grids for free
                    s64, b64 = np.float64(s[j]), np.float64(b[j])
                    est = (
                        s64 * s64 * sqq[j]
                        + 2.0 * s64 * b64 * sq[j]
                        + b64 * b64 * sw
                        - 2.0 * s64 * sqx[j]
                        - 2.0 * b64 * sx[j]
                        + sxx[j]
                    )
                    better = est < be[j]  # the first of equal estimates
                    be[j] = est if better else be[j]
                    bs_[j] = s[j] if better else bs_[j]
                    bb_[j] = b[j] if better else bb_[j]
            for j in range(m):
                e[j] = 0.0
                inv[j] = f(1.0) / bs_[j] if bs_[j] > 0 else f(0.0)
            for k in range(g):  # the best grid's codes re-fit to its (s, b), and their error
                dk, xk, xqk = dc[k], x[k], xq[k]
                for j in range(m):
                    q = min(max(np.rint((xk[j] - bb_[j]) * inv[j]), f(0.0)), n)
                    xqk[j] = np.uint8(q)
                    r = bs_[j] * q + bb_[j] - xk[j]
                    e[j] += dk * (r * r)
            for j in range(rows):
                i = r0 + j
                w_ = e[j] < e0[j]  # never worse than data-agnostic on the objective
                won[i, c] = w_
                s_out[i, c], b_out[i, c] = (bs_[j], bb_[j]) if w_ else (cs[j], cb[j])
                for k in range(g):
                    q_out[i, c, k] = xq[k, j] if w_ else x0[k, j]


@numba.njit(cache=True, nogil=True)
def pack_rows(codes, bits, out):
    # codes [rows, n] uint8 -> out [rows, n * bits / 32] uint32, LSB first (mx.quantize's
    # layout): a 64-bit accumulator takes each code and hands on every full 32-bit word
    for r in range(codes.shape[0]):
        acc, have, w = np.uint64(0), 0, 0
        for k in range(codes.shape[1]):
            acc |= np.uint64(codes[r, k]) << np.uint64(have)
            have += bits
            if have >= 32:
                out[r, w] = np.uint32(acc & np.uint64(0xFFFFFFFF))
                acc >>= np.uint64(32)
                have -= 32
                w += 1
