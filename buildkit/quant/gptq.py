"""GPTQ for routed experts: column-by-column rounding with error feedback, one Hessian per expert.

For an expert's weight W [out, in] and the inputs X [n, in] calibration routed to that
expert, GPTQ (Frantar et al., 2022) rounds W's columns one at a time and spreads each column's
rounding error over the columns not yet rounded, weighted by the inverse of H = XᵀX, so that
the output error ||X (W - Ŵ)ᵀ||² (not each weight's own error, as ``dataaware``'s diagonal
objective does) is small. Each group of ``group_size`` columns gets mx.quantize's affine
(scale, bias) of its columns as error feedback has left them, rounded to the dtype the scales
are stored in before any code is chosen against them.

mlx_lm's ``gptq`` sums one Hessian over all the experts of a layer; here each expert has its
own, from the rows routed to it (gate/up: the MoE input; down: that expert's own
``silu(gate x) * up x``), which measured lower KL divergence on the trained fixture
(bench/RESULTS.md, "Against mlx_lm's quantizers"). The inputs are the calibration stream's
routed rows, which the calibrate step keeps with ``params.keep_inputs = true``. Experts no
calibration token reached keep mx.quantize's result and are counted, as in ``dataaware``.

An expert's own rows are few beside its inputs on a real model (~128 rows an expert for 2048
gate/up inputs), so each Hessian is first shrunk toward a prior (``regularize``): gate/up's
toward the layer's pooled Hessian (every calibration row; itself shrunk toward its diagonal,
as a layer's rows may be fewer than its inputs too), down's toward its own diagonal.

GPTQ runs here on H's own factor, not on the factor of H⁻¹ the paper uses: with H = V Vᵀ
(V upper), column k rounds w_k + Σ_{m<k} (w_m - ŵ_m) V_mk / V_kk, the same values as the
paper's feedback (Babai's nearest plane), with no inverse to form. And H = P + XᵀX, P the
prior, which gate/up's experts of a layer share: where an expert's n rows are fewer than C / 4
(~128 rows for 2048 inputs on the real model) its V comes from the damped P's factor by one QR
update with its rows (LAPACK's tpqrt, 2nC² flops), else from H's own Cholesky (C³/3).

Cost, per expert with C inputs and n rows: the factor (above), and the feedback (out x C²/2,
sgemm between groups, a compiled loop inside one). A layer's gate_proj and up_proj read the
same rows, so one task quantizes both with one factor.
"""

from __future__ import annotations

import numba
import numpy as np

from buildkit.core.errors import StepError
from buildkit.formats.checkpoint import PROJS, SWITCH
from buildkit.formats.tensors import f32_to_bf16, to_float32, unpack
from buildkit.quant.dataaware import Tally, repack, stored_parts
from buildkit.quant.roles import Role
from buildkit.store.store import ROW_BLOCK_BYTES

METHOD = "gptq-per-expert/5"  # bump when the output bytes (or meta) change
# 4: gate/up's prior, the layer's pooled Hessian, itself shrunk toward its diagonal
#    (``pooled_prior``; bench/RESULTS.md, "Issue 37")
# 5: feedback through H's factor, the prior's factor updated by an expert's rows, the damping
#    from the prior's diagonal (bench/RESULTS.md, "GPTQ on H's factor")
DAMP = 0.01  # of H's mean diagonal, added to it (the prior's, where rows QR-update its factor)
QR_ROWS = 0.25  # rows per input under which an expert's factor is the prior's, QR-updated
# The prior's weight in pseudo-rows per input channel: an expert's Hessian from n rows gets the
# prior's second moment times PRIOR_ROWS * C, a share C / (n + C) of the sum at 1.0
# (bench/RESULTS.md, "GPTQ with few rows an expert")
PRIOR_ROWS = 1.0
PROJS_IN = ("gate_proj", "up_proj")  # what makes down_proj's inputs
# Hessians (and their factors) alive at once: 4 of the real model's 2048 x 2048, whatever the
# experts' shapes (a block of narrow experts would otherwise hold hundreds)
HESSIAN_BYTES = 64 << 20


def inputs_name(layer: str) -> str:
    return f"{layer}{SWITCH}.inputs"


def experts_name(layer: str) -> str:
    return f"{layer}{SWITCH}.experts"


def regularize(h: np.ndarray, prior: np.ndarray, rows: float = PRIOR_ROWS) -> np.ndarray:
    """Hessians h [e, C, C] (sums over each expert's routed rows) shrunk toward ``prior`` [e or
    1, C, C], a second moment per row: h + rows * C * prior, the prior counted as ``rows * C``
    pseudo-rows. An expert with few rows for its C inputs has a rank-deficient XᵀX, and error
    feedback then pushes rounding error into the directions its rows never reach but held-out
    rows do; the prior fills them. Its weight fades as the expert's own rows grow."""
    return np.asarray(h, dtype=np.float32) + weighted(prior)


def weighted(prior: np.ndarray, rows: float = PRIOR_ROWS) -> np.ndarray:
    """The prior as ``regularize`` adds it: ``rows * C`` pseudo-rows of it."""
    return np.float32(rows * prior.shape[-1]) * np.asarray(prior, np.float32)


def pooled_prior(x: np.ndarray, rows: float = PRIOR_ROWS) -> np.ndarray:
    """The layer's second moment per row of its calibration rows x [n, C], itself shrunk
    toward its own diagonal by ``rows * C`` pseudo-rows: with fewer rows than inputs (the
    real model's calibration gives a layer ~2 per input, a fixture at its rows per expert
    fewer) it is rank-deficient too, and the prior it lends each expert must not be."""
    n, c = x.shape
    m = (x.T @ x) / np.float32(n)
    k = np.float32(rows * c / (n + rows * c))
    return (1 - k) * m + k * np.diag(np.diag(m))


def damped(h: np.ndarray) -> np.ndarray:
    """A copy of Hessians [e, C, C] after GPTQ's treatment: a channel no row ever used gets a
    unit diagonal (its weights then round on their own) and every diagonal is raised by DAMP
    of the mean."""
    h = np.array(h, dtype=np.float32)
    diag = np.einsum("ecc->ec", h)  # a view: writes go to h
    diag[diag <= 0] = 1.0
    diag += DAMP * diag.mean(-1, keepdims=True)
    return h


def factor(h: np.ndarray, treat: bool = True) -> np.ndarray:
    """V upper with H = V Vᵀ for a batch of Hessians [e, C, C] (``damped`` first, unless
    ``treat`` is False): JHJ = L Lᵀ (J the reversal; LAPACK's float32 potrf) gives V = J L J."""
    from scipy.linalg import lapack  # potrf here is faster than numpy's cholesky

    h = damped(h) if treat else np.asarray(h, np.float32)
    v = np.empty(h.shape, np.float32)
    for x in range(len(h)):
        low, info = lapack.spotrf(h[x, ::-1, ::-1].T, lower=1, clean=1)  # Fortran order
        if info:
            raise StepError(f"GPTQ: a Hessian is not positive definite (LAPACK: {info})")
        v[x] = low[::-1, ::-1]
    return v


def prior_factor(p: np.ndarray) -> np.ndarray:
    """R upper, Fortran order, with Rᵀ R = J P J: what ``factor_rows`` updates (``p``: one
    damped prior [C, C])."""
    from scipy.linalg import lapack

    r, info = lapack.spotrf(np.asfortranarray(p[::-1, ::-1]), lower=0, clean=1)
    if info:
        raise StepError(f"GPTQ: a prior is not positive definite (LAPACK: {info})")
    return r


def factor_rows(r: np.ndarray, x: np.ndarray) -> np.ndarray:
    """V upper with P + xᵀx = V Vᵀ, from P's ``prior_factor`` r and an expert's rows x [n, C]:
    the QR of [r; x J] (LAPACK's tpqrt) has R with Rᵀ R = J (P + xᵀx) J, so V = J Rᵀ J. Its
    rows' signs may flip; V's columns with them, which GPTQ's feedback and weights do not see
    (each column enters divided by its own diagonal, or squared)."""
    from scipy.linalg import lapack

    nb = min(64, r.shape[0])  # tpqrt's block of columns
    got, _, _, info = lapack.stpqrt(
        0, nb, np.array(r, order="F"), np.asfortranarray(x[:, ::-1]), overwrite_a=1, overwrite_b=1
    )
    if info:
        raise StepError(f"GPTQ: the QR update of a prior's factor failed (LAPACK: {info})")
    return np.ascontiguousarray(got.T[::-1, ::-1])


@numba.njit(cache=True, nogil=True)
def _round_group(base, w, vt, inv_d, s, b, n_bins, codes, dq):
    # One expert's group: base [O, g], each column with its share of the earlier groups'
    # feedback (z_k / V_kk, ``quantize``); w [O, g], the columns as given; vt [g, g], the
    # group's block of V transposed (vt[k, m] = V[m, k]); inv_d [g], 1 / V_kk; s, b [O] as
    # stored. Column k rounds base[:, k] + sum over m < k of dq[:, m] V[m, k] / V[k, k], and
    # dq[:, k] = w[:, k] - its dequantized value.
    # Column-major copies so that each step runs down a contiguous column of O rows.
    rows, g = base.shape
    d_t = np.empty((g, rows), np.float32)
    acc = np.empty(rows, np.float32)
    inv = np.empty(rows, np.float32)
    zero = np.float32(0.0)
    for r in range(rows):
        inv[r] = np.float32(1.0) / s[r] if s[r] != zero else zero
    for k in range(g):
        for r in range(rows):
            acc[r] = zero
        for m in range(k):
            c = vt[k, m]
            dm = d_t[m]
            for r in range(rows):
                acc[r] += dm[r] * c
        dk = d_t[k]
        ik = inv_d[k]
        for r in range(rows):
            v = base[r, k] + acc[r] * ik
            q = np.rint((v - b[r]) * inv[r])
            q = zero if q < zero else q
            q = n_bins if q > n_bins else q
            codes[r, k] = np.uint8(q)
            dk[r] = w[r, k] - (s[r] * q + b[r])
    for r in range(rows):
        for k in range(g):
            dq[r, k] = d_t[k, r]


def _stored(v: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values rounded to the dtype scales and biases are stored in."""
    if dtype == "BF16":
        return (f32_to_bf16(v).astype(np.uint32) << 16).view(np.float32)
    if dtype == "F16":
        return v.astype(np.float16).astype(np.float32)
    return v


def _searched(base, d, s, b, bits: int, dtype: str):
    """(scales, biases) [e, O] of a group's columns base [e, O, g] as feedback has left them, by
    ``dataaware.search`` from mx.quantize's (s, b), each column weighted by d [e, g] = V_kk² =
    1 / [H⁻¹]_kk (of the columns from k on), what an error left in that column costs once
    feedback has spread it (OBQ's)."""
    from buildkit.quant.dataaware import search

    s, b = s.copy(), b.copy()
    n = 2**bits - 1
    for x in range(len(base)):
        inv = np.where(s[x] != 0, 1.0 / np.where(s[x] != 0, s[x], 1.0), 0.0)
        codes = np.clip(np.rint((base[x] - b[x][:, None]) * inv[:, None]), 0, n).astype(np.uint8)
        start = (codes[:, None, :], s[x][:, None], b[x][:, None])
        _, sx, bx, _ = search(base[x][:, None, :], d[x][None, None, :], bits, dtype, start)
        s[x], b[x] = sx[:, 0], bx[:, 0]
    return s, b


def quantize(
    w: np.ndarray, v: np.ndarray, bits: int, group_size: int, dtype: str, search: bool = True
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """GPTQ of a batch of weights w [e, O, C] with their Hessians' factors v [e, C, C]
    (``factor``, ``factor_rows``): codes uint8 [e, O, C], scales and biases float32 [e, O, C /
    g]. Each group's (scale, bias) is chosen for its columns as error feedback has left them,
    rounded to ``dtype`` before any code is chosen against it: by the data-aware search
    (``search``), or mx.quantize's min-max as GPTQ's paper has it. The earlier groups'
    feedback into a group is one product (sgemm); inside a group it is a compiled loop.

    The search's scales matter where inputs are near isotropic (the bench fixture's deep
    layers): there error feedback has no correlation to use, and what wins is the better grid
    (bench/RESULTS.md, "GPTQ with few rows an expert")."""
    from buildkit.quant.affine import rows_params

    w = np.ascontiguousarray(w, dtype=np.float32)
    e, rows, cols = w.shape
    n = np.float32(2**bits - 1)
    diag = np.einsum("ecc->ec", v)
    inv_d = (1.0 / diag).astype(np.float32)
    codes = np.empty(w.shape, np.uint8)
    dq = np.empty(w.shape, np.float32)  # each column less its dequantized value
    groups = cols // group_size
    scales = np.empty((e, rows, groups), np.float32)
    biases = np.empty_like(scales)
    s32, b32 = np.empty(e * rows, np.float32), np.empty(e * rows, np.float32)
    for gi in range(groups):
        i, j = gi * group_size, (gi + 1) * group_size
        # the earlier groups' feedback: z = Σ_{m<i} dq_m V_m,group. The group as it leaves
        # it (what its scales fit) is w + z V_GG⁻¹; column k's own share of it is z_k / V_kk
        base, fit = w[..., i:j].copy(), w[..., i:j].copy()
        if i:
            z = dq[..., :i] @ v[:, :i, i:j]
            base += z * inv_d[:, None, i:j]
            fit += z @ np.linalg.inv(v[:, i:j, i:j])
        if not rows_params(fit.reshape(-1, group_size), bits, s32, b32):
            raise StepError("GPTQ met a weight or scale that is not finite")
        s = _stored(s32, dtype).reshape(e, rows)
        b = _stored(b32, dtype).reshape(e, rows)
        if search:  # each group's (scale, bias) by dataaware's search, not min-max
            s, b = _searched(fit, np.square(diag[:, i:j]), s, b, bits, dtype)
        scales[..., gi], biases[..., gi] = s, b
        for x in range(e):
            vt = np.ascontiguousarray(v[x, i:j, i:j].T)
            args = (vt, inv_d[x, i:j], s[x], b[x], n, codes[x, :, i:j], dq[x, :, i:j])
            _round_group(base[x], w[x, :, i:j], *args)
    return codes, scales, biases


def _routed(calibration, layer: str) -> tuple[np.ndarray, np.ndarray]:
    x, ex = (
        calibration.tensors.get(inputs_name(layer)),
        calibration.tensors.get(experts_name(layer)),
    )
    if x is None or ex is None:
        raise StepError(
            f"GPTQ needs the calibration stream's routed inputs of {layer}, which the calibrate "
            "step keeps only with params.keep_inputs = true: set it on the calibrate step"
        )
    return x, ex


def pairs(names: list[str]) -> dict[str, str]:
    """gate_proj -> up_proj weight names of the same layers among ``names``: tensors that share
    their inputs, so one task quantizes both with one Hessian and one factor per expert."""
    have = set(names)
    out = {}
    for n in names:
        layer, sep, rest = n.partition(f"{SWITCH}.")
        up = f"{layer}{SWITCH}.up_proj.weight"
        if sep and rest == "gate_proj.weight" and up in have:
            out[n] = up
    return out


def checked_parts(items: list[tuple[str, dict]], g: int) -> list[tuple[str, str, str, dict]]:
    """(module, layer, projection, entry) of each weight ``quantize_entries`` is given, once
    each is known to be a routed-expert weight GPTQ can quantize (and a pair, a layer's
    gate_proj and up_proj of one shape)."""
    parts = []
    for name, entry in items:
        module, shape = name.removesuffix(".weight"), entry["shape"]
        layer, sep, proj = module.partition(SWITCH + ".")
        if not sep or len(shape) != 3 or proj not in PROJS:
            raise StepError(
                f"GPTQ role matches {name!r} {shape}, which is not a routed-expert weight; "
                "give this tensor a role without method = 'gptq'"
            )
        if shape[-1] % g:
            raise StepError(
                f"tensor {name!r}: last dimension {shape[-1]} is not a multiple of group_size {g}"
            )
        parts.append((module, layer, proj, entry))
    if len(parts) > 1 and (
        [p[2] for p in parts] != list(PROJS_IN)
        or {p[1] for p in parts} != {parts[0][1]}
        or parts[0][3]["shape"] != parts[1][3]["shape"]
    ):
        raise StepError(f"GPTQ quantizes together only a layer's {PROJS_IN}, not {items}")
    return parts


class Experts:
    """One layer's routed experts under GPTQ: the calibration rows routed to each, and their
    weights quantized a block of experts at a time (``blocks``)."""

    def __init__(self, store, parts: list[tuple], role: Role, calibration, model, block_bytes):
        self.store, self.parts, self.role, self.block_bytes = store, parts, role, block_bytes
        layer, proj = parts[0][1], parts[0][2]
        xe, ee = _routed(calibration, layer)
        self.x = to_float32(store.read_tensor(xe), xe["dtype"])
        chosen = store.read_tensor(ee)
        self.dtype, self.count = parts[0][3]["dtype"], parts[0][3]["shape"][0]
        self.rows_of = [np.flatnonzero((chosen == e).any(-1)) for e in range(self.count)]
        self.reached = np.array([len(r) > 0 for r in self.rows_of])
        # down_proj's inputs are each expert's activations: gate and up, read in the same blocks
        self.sw = f"{layer}{SWITCH}"
        self.gate_up = (
            zip(*(store.iter_rows(model[f"{self.sw}.{p}.weight"], block_bytes) for p in PROJS_IN))
            if proj == "down_proj"
            else None
        )
        # gate/up's prior: the layer's pooled Hessian per row, every calibration row (mlx_lm's
        # one Hessian a layer), damped and factored once for all its experts; down's inputs
        # differ by expert, and pooling them measured worse
        self.prior = self.prior_r = None
        if proj != "down_proj":
            self.prior = pooled_prior(self.x)
            self.prior_r = prior_factor(damped(weighted(self.prior)[None])[0])

    def inputs(self, e: int, gate_up) -> np.ndarray:
        """Expert ``e``'s input rows, float32 (``gate_up``: its gate and up weights, for
        down's)."""
        xs = self.x[self.rows_of[e]]
        if gate_up is not None:  # down's input: silu(gate x) * up x, as mlx_lm's SwitchGLU
            gw, uw = (to_float32(a, self.dtype) for a in gate_up)
            gx = xs @ gw.T
            xs = gx / (1.0 + np.exp(-gx)) * (xs @ uw.T)
        return xs

    def factors(self, e0: int, hit: list[int], gate_up) -> np.ndarray:
        """H's factor V (``factor``) of each reached expert ``e0 + j``, ``j`` in ``hit``
        (``gate_up``: those experts' gate and up weights, in ``hit``'s order): its damped
        prior's factor updated by its rows where they are few (the damping then the prior's,
        within n / (C + n) < 20% of H's), else H's own Cholesky."""
        c = self.parts[0][3]["shape"][-1]
        v = np.empty((len(hit), c, c), np.float32)
        for i, j in enumerate(hit):
            xs = self.inputs(e0 + j, None if gate_up is None else (gate_up[0][i], gate_up[1][i]))
            prior, r = self.prior, self.prior_r
            if prior is None:  # down: each expert's own diagonal (its inputs are its own)
                prior = np.diag(np.einsum("nc,nc->c", xs, xs) / np.float32(len(xs)))
            if len(xs) < QR_ROWS * c:
                r = prior_factor(damped(weighted(prior)[None])[0]) if r is None else r
                v[i] = factor_rows(r, xs)
            else:
                v[i] = factor(regularize((xs.T @ xs)[None], prior[None]))[0]
        return v

    def rounded(self, e0: int, hit: list[int], gate_up, raws: list, s_dtype: str) -> list:
        """Per tensor of the block, GPTQ's (codes, scales, biases) of the reached experts
        ``hit``, their Hessians made and factored a few at a time (``HESSIAN_BYTES``): memory is
        those few experts' Hessians, whatever the block or the layer holds."""
        c = raws[0].shape[-1]
        per = max(1, HESSIAN_BYTES // (4 * c * c))
        got: list[list] = [[] for _ in raws]
        for a in range(0, len(hit), per):
            part = hit[a : a + per]
            sub = None if gate_up is None else (gate_up[0][part], gate_up[1][part])
            v = self.factors(e0, part, sub)
            for t, raw in enumerate(raws):
                w = to_float32(raw[part], self.dtype)
                got[t].append(quantize(w, v, self.role.bits, self.role.group_size, s_dtype))
            del v
        return [tuple(np.concatenate(x) for x in zip(*chunks, strict=True)) for chunks in got]

    def quantized(self, raw: np.ndarray, module: str, hit: list[int], mxq, q_hit) -> tuple:
        """(source block, stored parts, rel-L1 sums) of one tensor's block of experts, from
        mx.quantize's result ``mxq`` and GPTQ's of the reached experts ``q_hit``."""
        from buildkit.quant import qerror

        bits, g, dtype = self.role.bits, self.role.group_size, self.dtype
        ((packed, _), (s_np, s_dtype), (b_np, _)), sums = mxq
        if hit:  # the reached experts by GPTQ, the rest keep mx.quantize's
            q, s, b = q_hit
            codes = unpack(packed, bits).copy()
            s32, b32 = to_float32(s_np, s_dtype).copy(), to_float32(b_np, s_dtype).copy()
            codes[hit], s32[hit], b32[hit] = q, s, b
            packed, s_np, b_np = repack(codes, s32, b32, bits, s_dtype, s_np.dtype)
        if hit or sums is None:  # else the kernel's sums are these bytes' already
            sums = qerror.block_error(raw, dtype, packed, s_np, b_np, s_dtype, bits, g)
        return raw, stored_parts(module, packed, s_np, b_np, s_dtype), sums

    def blocks(self):
        """Per block of experts, each tensor's (source block, stored parts, (rel-L1 sums))."""
        from buildkit.quant import affine

        e0 = 0
        for raws in zip(*(self.store.iter_rows(p[3], self.block_bytes) for p in self.parts)):
            n = len(raws[0])
            gate_up = next(self.gate_up) if self.gate_up is not None else None
            if gate_up is not None and len(gate_up[0]) != n:
                raise StepError(f"{self.sw}: gate/up blocks of {len(gate_up[0])} experts, not {n}")
            hit = [j for j in range(n) if self.reached[e0 + j]]
            bits, g = self.role.bits, self.role.group_size
            mxq = [affine.like_mx(raw, self.dtype, bits, g) for raw in raws]
            s_dtype = mxq[0][0][1][1]  # the dtype scales are stored in
            q_hit = (
                self.rounded(e0, hit, gate_up, list(raws), s_dtype) if hit else [None] * len(raws)
            )
            got = [
                self.quantized(raw, m, hit, a, q)
                for raw, (m, *_), a, q in zip(raws, self.parts, mxq, q_hit, strict=True)
            ]
            e0 += n
            yield got


def quantize_entries(
    store,
    items: list[tuple[str, dict]],
    role: Role,
    calibration,
    model: dict[str, dict],
    tally: Tally,
    block_bytes: int = ROW_BLOCK_BYTES,
) -> dict[str, dict]:
    """Routed-expert weights [E, out, in] of one layer -> weight/scales/biases by per-expert
    GPTQ, a few experts at a time: one tensor, or gate_proj and up_proj together (``pairs``),
    which read the same inputs and so share each expert's Hessian and its factor (at the real
    model's 2048 inputs the factor is most of GPTQ's cost). ``model`` holds the layer's bf16
    gate/up: down's inputs are made from them."""
    from buildkit.quant import qerror

    parts = checked_parts(items, role.group_size)
    experts = Experts(store, parts, role, calibration, model, block_bytes)
    # The first tensor streams into the store as its blocks are made; the second's blocks
    # (quantized: a quarter of its bf16 size or less) wait in memory until it is done.
    later: list[tuple] = []

    def first():
        for got in experts.blocks():
            later.extend((None, p, sums) for _, p, sums in got[1:])
            yield got[0]

    args = (experts.dtype, role.bits, role.group_size)
    out = qerror.put_measured(store, experts.count, first(), parts[0][0], *args)
    if len(parts) > 1:
        out.update(qerror.put_measured(store, experts.count, iter(later), parts[1][0], *args))
    layer, reached = parts[0][1], experts.reached
    with tally.lock:
        tally.tensors += len(parts)
        tally.expert_slices += int(reached.sum()) * len(parts)
        tally.fallback.setdefault(layer, set()).update(np.flatnonzero(~reached).tolist())
    return out


def key() -> dict:
    """What, besides the recipe, fixes GPTQ's bytes: its version and the numpy and scipy
    (LAPACK) it runs on."""
    from importlib.metadata import version

    return {"method": METHOD, "numpy": version("numpy"), "scipy": version("scipy")}
