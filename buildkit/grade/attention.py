"""qwen3_5's two attention modules in numpy, for our forward pass on the CPU.

Our pass runs mlx_lm's modules with their linears as numpy matmuls (``forward``), but the
arithmetic between the linears stayed mlx's, whose CPU path runs it at a few GFLOP/s against
numpy's sgemm at ~320: at the 35B shapes (2,048 tokens in windows of 128) 1.4 s of a
full-attention layer's 2.2 s went to its q/k norms, RoPE, scores, mixing and output gate,
and 0.57 s of a gated-delta layer's to its depthwise convolution and norms (bench/RESULTS.md).
Within ``in_numpy()`` (this thread only), qwen3_5's full attention and gated delta net run
here for the call our pass makes (whole sequences, no cache, float32), the delta rule as
``deltanet.gated_delta``; any other call, and anything else in the process (a real client
included), keeps mlx_lm's own.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

from buildkit.core.lazy import lazy
from buildkit.grade import deltanet

np = lazy("numpy", __name__)

_local = threading.local()
_lock = threading.Lock()
_installed = False


def linear(m, a: np.ndarray) -> np.ndarray:
    """A bias-free linear over rows a [..., in]: our numpy linear's own matmul
    (``forward.np_linear``), else the module itself."""
    if hasattr(m, "matmul"):
        return m.matmul(a)
    import mlx.core as mx

    return np.array(m(mx.array(a)))


def rms_norm(x: np.ndarray, weight, eps: float) -> np.ndarray:
    """``mx.fast.rms_norm`` over the last axis (float32)."""
    y = x / np.sqrt(np.mean(np.square(x), axis=-1, keepdims=True) + np.float32(eps))
    return y if weight is None else y * np.asarray(weight, np.float32)


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 + 0.5 * np.tanh(0.5 * x)  # no overflow where exp(-x) would


def silu(x: np.ndarray) -> np.ndarray:
    return x * sigmoid(x)


def rope(r, x: np.ndarray) -> np.ndarray:
    """``nn.RoPE`` ``r`` over x [B, heads, L, d] at positions 0..L-1: the first ``r.dims`` of
    each head rotated (as halves, or as pairs if ``traditional``), the rest as they are."""
    half = r.dims // 2
    theta = (np.arange(x.shape[-2])[:, None] * r.scale) * r.base ** (-np.arange(half) / half)
    cos, sin = np.cos(theta).astype(np.float32), np.sin(theta).astype(np.float32)
    out = x.copy()
    if r.traditional:
        a, b = slice(0, r.dims, 2), slice(1, r.dims, 2)
    else:
        a, b = slice(0, half), slice(half, r.dims)
    x1, x2 = x[..., a], x[..., b]
    out[..., a] = x1 * cos - x2 * sin
    out[..., b] = x1 * sin + x2 * cos
    return out


def sdpa(q, k, v, scale: float, causal: bool) -> np.ndarray:
    """``mx.fast.scaled_dot_product_attention`` for q [B, H, L, d] over k, v [B, Hkv, L, d]
    (query head h reads kv head h // (H / Hkv)): each kv head's queries in one matmul, the
    softmax in float32 with its maximum subtracted."""
    B, H, L, d = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    qs = (q * np.float32(scale)).reshape(B, Hkv, H // Hkv * L, d)
    s = (qs @ np.swapaxes(k, -1, -2)).reshape(B, Hkv, H // Hkv, L, S)
    if causal:  # query i sees keys j <= i + S - L (aligned at the end, as mlx's "causal")
        s[..., ~np.tri(L, S, S - L, dtype=bool)] = -np.inf
    s -= s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    return (s.reshape(B, Hkv, H // Hkv * L, S) @ v).reshape(B, H, L, -1)


def full_attention(attn, x: np.ndarray, causal: bool) -> np.ndarray:
    """qwen3_5's (Qwen3Next's) gated full attention over x [B, L, hidden], no cache."""
    B, L, _ = x.shape
    H, Hkv, d = attn.num_attention_heads, attn.num_key_value_heads, attn.head_dim
    qg = linear(attn.q_proj, x).reshape(B, L, H, 2 * d)  # per head: query, then gate
    q = rms_norm(qg[..., :d], attn.q_norm.weight, attn.q_norm.eps)
    k = linear(attn.k_proj, x).reshape(B, L, Hkv, d)
    k = rms_norm(k, attn.k_norm.weight, attn.k_norm.eps)
    v = linear(attn.v_proj, x).reshape(B, L, Hkv, d)
    q, k = (rope(attn.rope, np.swapaxes(t, 1, 2)) for t in (q, k))
    v = np.ascontiguousarray(np.swapaxes(v, 1, 2))
    o = np.swapaxes(sdpa(q, k, v, attn.scale, causal), 1, 2).reshape(B, L, H * d)
    return linear(attn.o_proj, o * sigmoid(qg[..., d:].reshape(B, L, H * d)))


def causal_conv(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """mlx's depthwise Conv1d (weight [C, K, 1], no bias) over x [B, S, C] after K - 1 zeros."""
    K, S = w.shape[1], x.shape[1]
    xp = np.concatenate([np.zeros((x.shape[0], K - 1, x.shape[2]), x.dtype), x], axis=1)
    out = xp[:, :S] * w[:, 0, 0]
    for j in range(1, K):
        out += xp[:, j : j + S] * w[:, j, 0]
    return out


def gated_delta_net(gdn, x: np.ndarray) -> np.ndarray:
    """qwen3_5's GatedDeltaNet over x [B, S, hidden] from a zero state, no cache."""
    B, S, _ = x.shape
    Hk, Hv, Dk, Dv = gdn.num_k_heads, gdn.num_v_heads, gdn.head_k_dim, gdn.head_v_dim
    conv = silu(causal_conv(linear(gdn.in_proj_qkv, x), np.asarray(gdn.conv1d.weight)))
    q, k, v = np.split(conv, [gdn.key_dim, 2 * gdn.key_dim], axis=-1)
    inv = Dk**-0.5  # mlx_lm's normalize_qk: l2 norms as rms norms, the readout scale in q
    q = inv**2 * rms_norm(q.reshape(B, S, Hk, Dk), None, 1e-6 * inv**2)
    k = inv * rms_norm(k.reshape(B, S, Hk, Dk), None, 1e-6 * inv**2)
    a = linear(gdn.in_proj_a, x) + np.asarray(gdn.dt_bias, np.float32)
    log_g = -np.exp(np.asarray(gdn.A_log, np.float32)) * np.logaddexp(a, np.float32(0))
    beta = sigmoid(linear(gdn.in_proj_b, x))
    y, _ = deltanet.gated_delta(q, k, v.reshape(B, S, Hv, Dv), log_g, beta)
    z = linear(gdn.in_proj_z, x).reshape(B, S, Hv, Dv)
    y = silu(z) * rms_norm(y, gdn.norm.weight, gdn.norm.eps)
    return linear(gdn.out_proj, y.reshape(B, S, -1))


def _forms() -> dict:
    """qwen3_5's module class -> (whether our numpy form takes a call, that form)."""
    from mlx_lm.models import qwen3_5

    return {
        qwen3_5.Attention: (
            _full_ok,
            lambda m, x, mask: full_attention(m, x, mask is not None),
        ),
        qwen3_5.GatedDeltaNet: (_delta_ok, lambda m, x, mask: gated_delta_net(m, x)),
    }


def numpy_call(attn, mask):
    """The numpy form of ``attn`` (a qwen3_5 full attention or gated delta net) for our pass's
    call with ``mask`` (whole sequences, no cache): a function of x [B, L, H] float32, pure
    numpy, so several may run at once on threads; None if this call would defer to mlx_lm's
    own."""
    for cls, (ok, fast) in _forms().items():
        if isinstance(attn, cls) and ok(attn, None, mask):
            return lambda x: fast(attn, x, mask)
    return None


def _full_ok(attn, x, mask) -> bool:
    import mlx.nn as nn

    causal = isinstance(mask, str) and mask == "causal"
    return (mask is None or causal) and type(attn.rope) is nn.RoPE


def _delta_ok(gdn, x, mask) -> bool:
    return mask is None and getattr(gdn, "sharding_group", None) is None


def _wrap(cls, ok, fast) -> None:
    own = cls.__call__

    def __call__(self, x, mask=None, cache=None):
        import mlx.core as mx

        if getattr(_local, "on", False) and cache is None and x.dtype == mx.float32:
            if ok(self, x, mask):
                return mx.array(fast(self, np.asarray(x), mask))
        return own(self, x, mask, cache)

    cls.__call__ = __call__


@contextmanager
def in_numpy():
    """Within this block (this thread only), qwen3_5's attention modules run in numpy (and
    its delta rule as ``deltanet.chunked``'s wherever they defer to mlx_lm's own)."""
    global _installed
    with _lock:  # wrappers installed once, for the process's life: they defer outside a block
        if not _installed:
            for cls, (ok, fast) in _forms().items():
                _wrap(cls, ok, fast)
            _installed = True
    before = getattr(_local, "on", False)
    _local.on = True
    try:
        with deltanet.chunked():
            yield
    finally:
        _local.on = before
