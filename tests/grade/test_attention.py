"""qwen3_5's attention modules in numpy against mlx_lm's own, on a small generated config."""

from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import qwen3_5
from mlx_lm.models.cache import KVCache

from buildkit.grade import attention
from buildkit.grade import forward as fw

ARGS = dict(
    model_type="qwen3_5_text",
    hidden_size=96,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=32,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    rms_norm_eps=1e-6,
    vocab_size=32,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10000000,
        "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10],
        "mrope_interleaved": True,
    },
)


def layer(index: int, seed: int = 0):
    """DecoderLayer ``index`` (3: full attention, else gated delta) with random weights: norms
    near 1, linears scaled to their width, decays and gates of both signs."""
    mx.random.seed(seed)
    rng = np.random.default_rng(seed)
    m = qwen3_5.DecoderLayer(qwen3_5.TextModelArgs(**ARGS), index)
    new = []
    for name, p in tree_flatten(m.parameters()):
        if p.ndim == 1 and name.split(".")[-2].endswith("norm"):
            a = 1 + 0.3 * rng.standard_normal(p.shape)
        elif p.ndim == 1:  # A_log, dt_bias
            a = rng.standard_normal(p.shape)
        else:
            a = rng.standard_normal(p.shape) * p.shape[-1] ** -0.5
        new.append((name, mx.array(a.astype(np.float32))))
    m.load_weights(new)
    mx.eval(m.parameters())
    return m


def hidden(B: int, L: int, seed: int = 1):
    return mx.array(np.random.default_rng(seed).standard_normal((B, L, 96)).astype(np.float32))


def attn_of(m):
    return m.linear_attn if m.is_linear else m.self_attn


def run(m, h):
    return np.array(attn_of(m)(m.input_layernorm(h), fw.layer_mask(m, h), None))


def rel_diff(ours, ref) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("index", [3, 0])
@pytest.mark.parametrize("B,L", [(1, 1), (1, 7), (2, 70), (1, 130)])
def test_matches_mlx_lm(index, B, L):
    """Ours, with mlx's linears and with our numpy ones, against mlx_lm's module: equal to
    float32 rounding (full attention over 1 token takes no mask; 130 spans chunks of 64)."""
    m, h = layer(index), hidden(B, L)
    ref = run(m, h)
    with attention.in_numpy():
        mixed = run(m, h)
        fw.linears_to_numpy(m)
        ours = run(m, h)
    assert ours.shape == ref.shape and np.isfinite(ours).all()
    assert not np.array_equal(mixed, ref)  # ours ran: the same figures, other rounding
    assert rel_diff(mixed, ref) < 1e-5
    assert rel_diff(ours, ref) < 1e-5


@pytest.mark.parametrize("positions", [512, 80])
def test_attend_runs_the_layers_in_numpy_and_matches_mlx_lm(positions, monkeypatch):
    """forward.attend (the residual added) over batches, a few sequences at a time (at 80
    positions a batch of three 40-token rows goes as two and one), against mlx_lm's layer."""
    monkeypatch.setattr(fw, "ATTEND_POSITIONS", positions)
    hs = [hidden(1, 128, seed=2), hidden(3, 40, seed=3)]
    for index in (3, 1):
        m = layer(index, seed=index)
        ref = [np.array(h) + run(m, h) for h in hs]
        fw.linears_to_numpy(m)
        got = [np.array(x) for x in fw.attend(m, hs)]
        for g, r in zip(got, ref, strict=True):
            assert g.shape == r.shape and rel_diff(g, r) < 1e-5
        # its parts on two threads: the bytes of the modules' own calls one after another
        with monkeypatch.context() as mp:
            mp.setattr(attention, "numpy_call", lambda attn, mask: None)
            serial = [np.array(x) for x in fw.attend(m, hs)]
        for g, s in zip(got, serial, strict=True):
            np.testing.assert_array_equal(g, s)


@pytest.mark.parametrize("index", [3, 0])
def test_a_real_clients_calls_keep_mlx_lms_own(index):
    """Outside the block, in another thread, with a cache or an array mask, mlx_lm's module
    runs its own arithmetic: the same bytes."""
    m, h = layer(index), hidden(1, 20)
    x, mask = m.input_layernorm(h), fw.layer_mask(m, h)
    exact = np.array(attn_of(m)(x, mask, None))
    seen = {}
    with attention.in_numpy():
        inside = np.array(attn_of(m)(x, mask, None))
        t = threading.Thread(target=lambda: seen.update(y=np.array(attn_of(m)(x, mask))))
        t.start()
        t.join()
        if not m.is_linear:
            tri = mx.tril(mx.ones((20, 20), mx.bool_))
            cached = np.array(attn_of(m)(x, mask, KVCache()))
            array_mask = np.array(attn_of(m)(x, tri, None))
    assert not np.array_equal(inside, exact)
    np.testing.assert_array_equal(np.array(attn_of(m)(x, mask, None)), exact)
    np.testing.assert_array_equal(seen["y"], exact)
    if not m.is_linear:
        np.testing.assert_array_equal(cached, np.array(attn_of(m)(x, mask, KVCache())))
        np.testing.assert_array_equal(array_mask, np.array(attn_of(m)(x, tri, None)))
