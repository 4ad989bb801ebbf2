"""The chunked gated delta rule against mlx_lm's own (its CPU ops, token by token)."""

from __future__ import annotations

import threading

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import gated_delta as gd

from buildkit.grade import deltanet


def inputs(T: int, Hk: int = 2, Hv: int = 4, D: int = 16, a_scale: float = 1.0, seed: int = 0):
    rng = np.random.default_rng(seed)
    q, k = (rng.standard_normal((1, T, Hk, D)).astype(np.float32) for _ in range(2))
    q, k = gd.normalize_qk(mx.array(q), mx.array(k), inv_scale=D**-0.5, eps=1e-6)
    v = mx.array(rng.standard_normal((1, T, Hv, D)).astype(np.float32))
    a = mx.array(a_scale * rng.standard_normal((1, T, Hv)).astype(np.float32))
    b = mx.array(rng.standard_normal((1, T, Hv)).astype(np.float32))
    A_log = mx.array(rng.standard_normal(Hv).astype(np.float32))
    dt_bias = mx.array(rng.standard_normal(Hv).astype(np.float32))
    return q, k, v, a, b, A_log, dt_bias


def mlx_lm_ops(q, k, v, a, b, A_log, dt_bias, state=None):
    g, beta = gd.compute_g(A_log, a, dt_bias), mx.sigmoid(b)
    if state is None:
        state = mx.zeros((1, v.shape[2], v.shape[3], q.shape[3]), mx.float32)
    y, s = gd.gated_delta_ops(q, k, v, g, beta, state)
    return np.array(y), np.array(s)


def chunked(q, k, v, a, b, A_log, dt_bias, state=None, chunk=deltanet.CHUNK):
    log_g = -mx.exp(A_log) * nn.softplus(a + dt_bias)
    args = [np.array(t) for t in (q, k, v, log_g, mx.sigmoid(b))]
    return deltanet.gated_delta(*args, None if state is None else np.array(state), chunk=chunk)


@pytest.mark.parametrize("T,chunk", [(1, 64), (5, 4), (64, 64), (130, 64), (100, 16)])
def test_matches_mlx_lm_token_by_token(T, chunk):
    x = inputs(T)
    y0, s0 = mlx_lm_ops(*x)
    y1, s1 = chunked(*x, chunk=chunk)
    assert y1.shape == y0.shape and s1.shape == s0.shape
    np.testing.assert_allclose(y1, y0, rtol=0, atol=2e-5 * np.abs(y0).max())
    np.testing.assert_allclose(s1, s0, rtol=0, atol=2e-5 * np.abs(s0).max())


def test_from_a_state_and_with_decays_that_underflow():
    """A state carried in, and gates so strong that the decay is 0 in float32 (exp of -1e4):
    the chunked form works in log decays, so no 0/0."""
    x = inputs(70, seed=1)
    state = mx.array(np.random.default_rng(2).standard_normal((1, 4, 16, 16)).astype(np.float32))
    y0, s0 = mlx_lm_ops(*x, state=state)
    y1, s1 = chunked(*x, state=state)
    np.testing.assert_allclose(y1, y0, rtol=0, atol=2e-5 * np.abs(y0).max())
    x = inputs(70, a_scale=300.0, seed=3)
    y0, _ = mlx_lm_ops(*x)
    y1, _ = chunked(*x)
    assert np.isfinite(y1).all()
    np.testing.assert_allclose(y1, y0, rtol=0, atol=2e-5 * np.abs(y0).max())


def test_decays_too_small_for_float32_are_zero_not_subnormal(monkeypatch):
    """Gates of ~-30 a token take a chunk's decays through float32's subnormal range, where
    the CPU multiplies tens of times slower: below 2^-60 they are 0, and the outputs are
    mlx_lm's, and within 2^-30 of the chunked form's own with every decay kept."""
    x = inputs(130, a_scale=30.0, seed=4)
    log_g = np.array(-mx.exp(x[5]) * nn.softplus(x[3] + x[6]), np.float64)
    tiny = np.finfo(np.float32).tiny
    kept = np.exp(np.cumsum(log_g, axis=1)).astype(np.float32)
    assert ((kept > 0) & (kept < tiny)).any()  # the case at hand: subnormal decays
    got = deltanet.decays(np.cumsum(log_g, axis=1))
    assert not ((got > 0) & (got < 2.0**-60)).any()
    y0, _ = mlx_lm_ops(*x)
    y1, s1 = chunked(*x)
    np.testing.assert_allclose(y1, y0, rtol=0, atol=2e-5 * np.abs(y0).max())
    monkeypatch.setattr(deltanet, "LOG_FLOOR", -np.inf)
    y2, s2 = chunked(*x)
    np.testing.assert_allclose(y1, y2, rtol=0, atol=2.0**-30 * np.abs(y2).max())
    np.testing.assert_allclose(s1, s2, rtol=0, atol=2.0**-30 * np.abs(s2).max())


def test_only_inside_the_block_and_only_in_its_thread():
    """mlx_lm's function is ours only within ``chunked()`` and in that thread: a real client
    running beside our forward pass keeps mlx_lm's own arithmetic."""
    from mlx_lm.models import qwen3_5

    x = inputs(40)
    exact = np.array(gd.gated_delta_update(*x)[0])
    with deltanet.chunked():
        inside = np.array(qwen3_5.gated_delta_update(*x)[0])
        seen = {}
        t = threading.Thread(
            target=lambda: seen.update(y=np.array(qwen3_5.gated_delta_update(*x)[0]))
        )
        t.start()
        t.join()
    outside = np.array(qwen3_5.gated_delta_update(*x)[0])
    np.testing.assert_array_equal(outside, exact)
    np.testing.assert_array_equal(seen["y"], exact)
    assert not np.array_equal(inside, exact)  # ours ran: the same figures, other rounding
    np.testing.assert_allclose(inside, exact, rtol=0, atol=2e-5 * np.abs(exact).max())
