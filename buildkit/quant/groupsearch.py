"""The activation-weighted affine search's loop (``dataaware.search``), compiled by numba.

ROWS rows of one group column are copied, transposed, into a block x [g, ROWS], so every loop
runs over the rows innermost: each sum over a group's columns runs in a fixed order and the
loop vectorises without reordering it (no fastmath), so the bytes do not depend on the SIMD
width, and they are the bytes this file's Python gives under the interpreter
(tests/scenarios/test_oq4e.py runs both). What keeps it near mx.quantize's time per weight (bench/
RESULTS.md "oq4e speed"):

- a pass over the block takes KC columns of a row into registers before it stores its sums
  (the compiler cannot keep them there itself: it cannot prove the arrays apart);
- per-row values are rows of a few arrays, one for what each loop writes: before it vectorises
  a loop the compiler checks at run time that the arrays it writes do not overlap those it
  reads, pair by pair, and gives up past a handful; the helpers are inlined (a call costs
  reference counting on every array view it is passed);
- selects, not branches, per row (bf16/f16 rounding; numpy's error model, so a division by
  zero is inf and needs no check), each selected value read into a local first: LLVM 22
  (numba 0.68) miscompiled a vectorised ``a[j] = v if c else a[j]`` insertion here;
- codes move 8 to a uint64 word, so the block transposes words, not bytes;
- a block of rows goes through every group column before the next: its pages stay at hand.

Compiled on first use and cached on disk (numba's ``cache=True``, beside this file).
"""

from __future__ import annotations

import numba
import numpy as np

from buildkit.quant.affine import pack_codes

ROWS = 64  # rows searched together: a block of them, every candidate, stays in L1
KC = 8  # columns per register pass, and codes per word: divides mx.quantize's group sizes


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


REFIT, FIRST, FIRST_CLIP = 0, 1, 2  # how ``code_sums`` finds the codes
LO, HI, SX, SXX, E0 = range(5)  # the block's min, max, Σ d x, Σ d x², data-agnostic error
S, B, INV, E = range(4)  # a candidate's (s, b, 1 / s) and, for the best, its exact error


@numba.njit(cache=True, nogil=True, error_model="numpy", inline="always")
def code_sums(x, dc, cur, n, how, acc):
    # per row j of x [g, m]: codes q against cur's (b, 1 / s) and their weighted sums Σ d q,
    # Σ d q², Σ d q x into acc, column by column: q = rint((x - b) / s) clipped to [0, n]; on a
    # first fit (b = lo <= x) q >= 0 already, and for a grid of at most 0.25 extra steps
    # (1 / s <= (n + 0.25) / (hi - lo)) q <= n too: FIRST clips neither end, FIRST_CLIP the top
    g, m = x.shape
    f = np.float32
    for j in range(m):
        acc[0, j], acc[1, j], acc[2, j] = 0.0, 0.0, 0.0
    for k0 in range(0, g, KC):  # KC columns of a row into registers, then stored
        if how == REFIT:
            for j in range(m):
                a0, a1, a2, bj, ij = acc[0, j], acc[1, j], acc[2, j], cur[B, j], cur[INV, j]
                for kk in range(KC):
                    xk = x[k0 + kk, j]
                    q = min(max(np.rint((xk - bj) * ij), f(0.0)), n)
                    dq = dc[k0 + kk] * q
                    a0, a1, a2 = a0 + dq, a1 + dq * q, a2 + dq * xk
                acc[0, j], acc[1, j], acc[2, j] = a0, a1, a2
        elif how == FIRST_CLIP:
            for j in range(m):
                a0, a1, a2, bj, ij = acc[0, j], acc[1, j], acc[2, j], cur[B, j], cur[INV, j]
                for kk in range(KC):
                    xk = x[k0 + kk, j]
                    q = min(np.rint((xk - bj) * ij), n)
                    dq = dc[k0 + kk] * q
                    a0, a1, a2 = a0 + dq, a1 + dq * q, a2 + dq * xk
                acc[0, j], acc[1, j], acc[2, j] = a0, a1, a2
        else:
            for j in range(m):
                a0, a1, a2, bj, ij = acc[0, j], acc[1, j], acc[2, j], cur[B, j], cur[INV, j]
                for kk in range(KC):
                    xk = x[k0 + kk, j]
                    q = np.rint((xk - bj) * ij)
                    dq = dc[k0 + kk] * q
                    a0, a1, a2 = a0 + dq, a1 + dq * q, a2 + dq * xk
                acc[0, j], acc[1, j], acc[2, j] = a0, a1, a2


@numba.njit(cache=True, nogil=True, error_model="numpy", inline="always")
def fit(sw, st, acc, storage, cur, est):
    # per row: the weighted least-squares (s, b) for the codes summed, rounded as stored, 1 / s,
    # and the weighted error of those codes under (s, b) from the sums (float64: it is a small
    # difference of large terms); codes re-fit to (s, b) can only do better, so it ranks
    # candidates for free. NaN (from a degenerate row) ranks last
    f = np.float32
    m = len(est)
    for j in range(m):
        sq, sqq, sqx, sx = acc[0, j], acc[1, j], acc[2, j], st[SX, j]
        det = sw * sqq - sq * sq
        ok = det > f(1e-9) * sw * max(sqq, f(1e-30))
        safe = det if ok else f(1.0)
        cur[S, j] = (sw * sqx - sq * sx) / safe if ok else f(0.0)
        cur[B, j] = (sqq * sx - sq * sqx) / safe if ok else sx / sw
    if storage == 1:  # a loop per storage: each vectorises
        for j in range(m):
            cur[S, j], cur[B, j] = stored(cur[S, j], 1), stored(cur[B, j], 1)
    elif storage == 2:
        for j in range(m):
            cur[S, j], cur[B, j] = stored(cur[S, j], 2), stored(cur[B, j], 2)
    for j in range(m):
        s, b = cur[S, j], cur[B, j]
        cur[INV, j] = f(1.0) / s if s > 0 else f(0.0)
        s64, b64 = np.float64(s), np.float64(b)
        e = (
            s64 * s64 * acc[1, j]
            + 2.0 * s64 * b64 * acc[0, j]
            + b64 * b64 * sw
            - 2.0 * s64 * acc[2, j]
            - 2.0 * b64 * st[SX, j]
            + st[SXX, j]
        )
        est[j] = e if e == e else np.inf


INLINE = {"cache": True, "nogil": True, "error_model": "numpy", "inline": "always"}


@numba.njit(**INLINE)
def load_block(w, bq, bs, bb, r0, rows, c, x, x0, base):
    # rows r0 .. r0 + rows of group column c into x [g, m], rows innermost, with their
    # data-agnostic codes (8 to a word) and (s, b); zeros past the last row
    g, m = x.shape
    for j in range(rows):
        for k in range(g):
            x[k, j] = w[r0 + j, c, k]
        for k in range(g // 8):
            x0[k, j] = bq[r0 + j, c, k]
        base[0, j], base[1, j] = bs[r0 + j, c], bb[r0 + j, c]
    for j in range(rows, m):
        for k in range(g):
            x[k, j] = 0.0
        for k in range(g // 8):
            x0[k, j] = 0
        base[0, j], base[1, j] = 0.0, 0.0


@numba.njit(**INLINE)
def block_stats(x, x0, base, dc, st):
    # per row of the block: min, max, Σ d x, Σ d x² and data-agnostic's error into st
    g, m = x.shape
    f = np.float32
    for j in range(m):
        st[LO, j], st[HI, j] = x[0, j], x[0, j]
        st[SX, j], st[SXX, j], st[E0, j] = 0.0, 0.0, 0.0
    for k0 in range(0, g, KC):
        for j in range(m):
            lo, hi, a0, a1, a2 = st[LO, j], st[HI, j], st[SX, j], st[SXX, j], st[E0, j]
            s0, b0, q0 = base[0, j], base[1, j], x0[k0 // 8, j]
            for kk in range(KC):
                dk, xk = dc[k0 + kk], x[k0 + kk, j]
                lo, hi = min(lo, xk), max(hi, xk)
                a0 += dk * xk
                a1 += dk * (xk * xk)
                r = s0 * f((q0 >> np.uint64(8 * kk)) & np.uint64(0xFF)) + b0 - xk
                a2 += dk * (r * r)
            st[LO, j], st[HI, j], st[SX, j], st[SXX, j], st[E0, j] = lo, hi, a0, a1, a2


@numba.njit(**INLINE)
def keep(i, est, cur, be, best, e1, s1, b1):
    # candidate i's estimate against the best's; a grid's first fit kept for the ranking
    m = len(est)
    for j in range(m):
        e_, s_, b_ = be[j], best[S, j], best[B, j]
        into = est[j] < e_
        be[j] = est[j] if into else e_
        best[S, j] = cur[S, j] if into else s_
        best[B, j] = cur[B, j] if into else b_
    if i < len(e1):
        for j in range(m):
            e1[i, j], s1[i, j], b1[i, j] = est[j], cur[S, j], cur[B, j]


@numba.njit(**INLINE)
def rank_grids(e1, rank):
    # each grid's rank by estimate, the earlier first among equals
    T, m = rank.shape
    for t_ in range(T):
        for j in range(m):
            rank[t_, j] = 0
        for u in range(t_):
            for j in range(m):
                rank[t_, j] += 1 if e1[u, j] <= e1[t_, j] else 0
        for u in range(t_ + 1, T):
            for j in range(m):
                rank[t_, j] += 1 if e1[u, j] < e1[t_, j] else 0


@numba.njit(**INLINE)
def refit_best(x, dc, n, best, xq):
    # the best's codes re-fit to its (s, b) into xq, 8 to a word, and their exact error
    g, m = x.shape
    f = np.float32
    for j in range(m):
        best[E, j] = 0.0
        best[INV, j] = f(1.0) / best[S, j] if best[S, j] > 0 else f(0.0)
    for k0 in range(0, g, KC):
        for j in range(m):
            s, b, ij, e = best[S, j], best[B, j], best[INV, j], best[E, j]
            word = np.uint64(0)
            for kk in range(KC):
                xk = x[k0 + kk, j]
                q = min(max(np.rint((xk - b) * ij), f(0.0)), n)
                word |= np.uint64(q) << np.uint64(8 * kk)
                r = s * q + b - xk
                e += dc[k0 + kk] * (r * r)
            xq[k0 // 8, j], best[E, j] = word, e


@numba.njit(**INLINE)
def store_best(r0, rows, c, best, base, st, x0, xq, q_out, s_out, b_out, won):
    # each row's best where it beats data-agnostic on the objective, else data-agnostic's
    for j in range(rows):
        i = r0 + j
        won_ = best[E, j] < st[E0, j]
        won[i, c] = won_
        s_out[i, c] = best[S, j] if won_ else base[0, j]
        b_out[i, c] = best[B, j] if won_ else base[1, j]
        for k in range(xq.shape[0]):
            q_out[i, c, k] = xq[k, j] if won_ else x0[k, j]


@numba.njit(cache=True, nogil=True, error_model="numpy")
def search_groups(w, d, grid, n, top, refine, storage, bq, bs, bb, q_out, s_out, b_out, won):
    # w [R, G, g] float32, d [G, g], base codes bq [R, G, g / 8] (uint8 codes, 8 to a uint64
    # word, little-endian), scales/biases [R, G]; the codes out (q_out) alike;
    # ROWS rows of one group column at a time, copied to x [g, ROWS]: rows innermost.
    # Candidates: each grid's fit (the codes of its min-max range stretched by t steps); the
    # ``top`` of them with the smallest estimates (the earlier first among equals) fit once
    # more, then the best of all ``refine`` times more; the best's codes re-fit to its (s, b),
    # and their exact error against data-agnostic's
    R, G, g = w.shape
    T = len(grid)
    top = min(top, T)
    m = ROWS
    f = np.float32
    x = np.empty((g, m), f)
    x0, xq = np.empty((g // 8, m), np.uint64), np.empty((g // 8, m), np.uint64)
    base, st, acc = np.empty((2, m), f), np.empty((5, m), f), np.empty((3, m), f)
    cur, best = np.empty((3, m), f), np.empty((4, m), f)
    est, be = np.empty(m, np.float64), np.empty(m, np.float64)
    e1, s1, b1 = np.empty((T, m), np.float64), np.empty((T, m), f), np.empty((T, m), f)
    rank = np.empty((T, m), np.int64)
    sws = np.empty(G, f)
    for c in range(G):
        sws[c] = 0.0
        for k in range(g):
            sws[c] += d[c, k]
    for r0 in range(0, R, m):  # a block of rows across every group column: few pages at a time
        rows = min(m, R - r0)
        for c in range(G):
            dc, sw = d[c], sws[c]
            load_block(w, bq, bs, bb, r0, rows, c, x, x0, base)
            block_stats(x, x0, base, dc, st)
            for j in range(m):
                be[j], best[S, j], best[B, j] = np.inf, base[0, j], base[1, j]
            for i in range(T + top + refine):
                if i < T:
                    t = grid[i]
                    for j in range(m):
                        span = st[HI, j] - st[LO, j] if st[HI, j] > st[LO, j] else f(1.0)
                        cur[B, j], cur[INV, j] = st[LO, j], (n + t) / span
                    how = FIRST if t <= 0.25 else FIRST_CLIP
                else:
                    if i < T + top:  # the grid ranked i - T
                        for t_ in range(T):
                            for j in range(m):
                                take, s_, b_ = rank[t_, j] == i - T, cur[S, j], cur[B, j]
                                cur[S, j] = s1[t_, j] if take else s_
                                cur[B, j] = b1[t_, j] if take else b_
                    else:  # the best so far
                        for j in range(m):
                            cur[S, j], cur[B, j] = best[S, j], best[B, j]
                    for j in range(m):
                        cur[INV, j] = f(1.0) / cur[S, j] if cur[S, j] > 0 else f(0.0)
                    how = REFIT
                code_sums(x, dc, cur, n, how, acc)
                fit(sw, st, acc, storage, cur, est)
                keep(i, est, cur, be, best, e1, s1, b1)
                if i == T - 1:
                    rank_grids(e1, rank)
            refit_best(x, dc, n, best, xq)
            store_best(r0, rows, c, best, base, st, x0, xq, q_out, s_out, b_out, won)


@numba.njit(cache=True, nogil=True)
def pack_rows(codes, bits, out):
    # codes [rows, n] uint8 -> out [rows, n * bits / 32] uint32, LSB first (mx.quantize's
    # layout): each row's bytes as affine's kernel packs its groups (little-endian words)
    by = out.view(np.uint8)
    for r in range(codes.shape[0]):
        pack_codes(codes[r], bits, by[r], 0)
