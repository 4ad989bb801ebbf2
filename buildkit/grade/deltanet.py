"""The gated delta rule of qwen3_5's linear-attention layers, in chunks, for the CPU.

mlx_lm runs the recurrence ``S_t = g_t S_{t-1} + β_t (v_t - g_t S_{t-1} k_t) k_tᵀ``,
``o_t = S_t q_t`` with a Metal kernel, or on the CPU one token at a time in mlx ops
(``gated_delta_ops``): six passes over a 2 MB state per token, most of a 35B layer's time
(bench/RESULTS.md). Here a chunk of C tokens is one set of matmuls (the WY form of the
Gated DeltaNet paper, as flash-linear-attention's ``chunk_gated_delta_rule``): with Γ_i the
decay accumulated over the chunk and S0 the state entering it,

    U = (I + L)⁻¹ (βV - βΓ K S0ᵀ),   L_ij = β_i (Γ_i / Γ_j) k_iᵀ k_j  (j < i)
    O = Γ Q S0ᵀ + (Q Kᵀ ⊙ D) U,      D_ij = Γ_i / Γ_j  (j <= i)
    S = Γ_C S0 + Uᵀ (Γ_C / Γ) K

every ratio of decays at most 1 (computed from log decays, so none underflows to 0/0). Our
forward pass runs it in place of mlx_lm's CPU path while it runs a layer (``chunked``);
anything else in the process, a real client included, keeps mlx_lm's own.
"""

from __future__ import annotations

import math
import threading
from contextlib import contextmanager

from buildkit.core.lazy import lazy

np = lazy("numpy", __name__)

CHUNK = 64
# a decay below 2^-60 is taken as 0: what it scales is below 2^-36 of any float32 sum it
# enters, and left in, it and its products are subnormal floats, which the CPU multiplies tens
# of times slower (strong gates make half a chunk's decays subnormal: bench/RESULTS.md)
LOG_FLOOR = -60 * math.log(2)
_local = threading.local()
_lock = threading.Lock()
_original = None


def gated_delta(q, k, v, log_g, beta, state=None, chunk: int = CHUNK):
    """The recurrence over q, k [B, T, Hk, Dk], v [B, T, Hv, Dv], log decays and betas
    [B, T, Hv] (numpy float32), from ``state`` [B, Hv, Dv, Dk] (zeros if None); returns the
    outputs [B, T, Hv, Dv] and the last state, as mlx_lm's ``gated_delta_ops``."""
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    if Hv > Hk:
        q, k = (np.repeat(a, Hv // Hk, axis=2) for a in (q, k))
    n = -(-T // chunk)
    pad = n * chunk - T

    def chunks(a):  # [B, T, H, ...] -> [B, H, n, C, ...], zero-padded past T
        a = np.moveaxis(a, 2, 1)
        a = np.pad(a, [(0, 0), (0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 3))
        return a.reshape(B, Hv, n, chunk, *a.shape[3:])

    q, k, v, lg, beta = (chunks(np.asarray(a, np.float32)) for a in (q, k, v, log_g, beta))
    # log Γ_i within each chunk, in float64: a ratio of decays is a difference of these sums,
    # which in float32 keeps only ~4 digits once strong gates make them large
    gc = np.cumsum(lg, axis=-1, dtype=np.float64)
    lower = np.tril(np.ones((chunk, chunk), bool))
    diff = np.where(lower, gc[..., :, None] - gc[..., None, :], -np.inf)
    D = decays(diff)  # Γ_i / Γ_j for j <= i, else 0
    kk = k @ np.swapaxes(k, -1, -2)
    L = beta[..., None] * kk * D * ~np.eye(chunk, dtype=bool)
    W = np.linalg.inv(np.eye(chunk, dtype=np.float32) + L)  # unit lower triangular
    gamma = decays(gc)
    vt = W @ (beta[..., None] * v)  # [B, H, n, C, Dv]
    kt = W @ ((beta * gamma)[..., None] * k)  # [B, H, n, C, Dk]
    qd = gamma[..., None] * q
    qk = (q @ np.swapaxes(k, -1, -2)) * D
    last = decays(gc[..., -1:] - gc)[..., None] * k  # (Γ_C / Γ_j) k_j
    S = np.zeros((B, Hv, Dv, Dk), np.float32) if state is None else np.asarray(state, np.float32)
    out = np.empty((B, Hv, n, chunk, Dv), np.float32)
    for c in range(n):
        St = np.swapaxes(S, -1, -2)  # [B, H, Dk, Dv]
        u = vt[:, :, c] - kt[:, :, c] @ St
        out[:, :, c] = qd[:, :, c] @ St + qk[:, :, c] @ u
        decay = decays(gc[:, :, c, -1])[..., None, None]
        S = decay * S + np.swapaxes(u, -1, -2) @ last[:, :, c]
    y = np.moveaxis(out.reshape(B, Hv, n * chunk, Dv)[:, :, :T], 1, 2)
    return np.ascontiguousarray(y), S


def decays(log: np.ndarray) -> np.ndarray:
    """exp of log decays (float64) as float32, those below ``LOG_FLOOR`` as 0."""
    return np.exp(np.where(log < LOG_FLOOR, -np.inf, log)).astype(np.float32)


def _update(q, k, v, a, b, A_log, dt_bias, state=None, mask=None, **kw):
    """mlx_lm's ``gated_delta_update``, chunked where it would run its CPU ops one token at a
    time (inside ``chunked``, no mask, plain gates); otherwise mlx_lm's own."""
    import mlx.core as mx
    import mlx.nn as nn

    on_cpu = mx.default_device() != mx.gpu or not mx.metal.is_available()
    plain = mask is None and kw.get("lower_bound") is None and not kw.get("allow_neg_eigval")
    if not (getattr(_local, "on", False) and on_cpu and plain):
        return _original(q, k, v, a, b, A_log, dt_bias, state, mask, **kw)
    log_g = -mx.exp(A_log.astype(mx.float32)) * nn.softplus(a + dt_bias)
    beta = mx.sigmoid(b)
    mx.eval(log_g, beta)
    y, s = gated_delta(
        *(np.asarray(t.astype(mx.float32)) for t in (q, k, v, log_g, beta)),
        None if state is None else np.asarray(state),
    )
    return mx.array(y).astype(q.dtype), mx.array(s)


@contextmanager
def chunked():
    """Within this block (this thread only), qwen3_5's linear attention runs ``gated_delta``."""
    global _original
    from mlx_lm.models import qwen3_5

    with _lock:  # one wrapper installed, for the process's life: it defers outside a block
        if _original is None:
            _original = qwen3_5.gated_delta_update
            qwen3_5.gated_delta_update = _update
    before = getattr(_local, "on", False)
    _local.on = True
    try:
        yield
    finally:
        _local.on = before
