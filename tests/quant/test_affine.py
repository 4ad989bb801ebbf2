"""buildkit's compiled affine quantization gives mx.quantize's bytes and qerror's figure."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from buildkit.formats.tensors import dequantize, from_mlx, to_float32, to_mlx
from buildkit.quant import affine, qerror

RNG = np.random.default_rng(0)
CASES = {  # float32 values, made bf16 below: the spreads a checkpoint and its edges have
    "normal": RNG.standard_normal((64, 2048)),
    "3d": RNG.standard_normal((4, 32, 512)),
    "tiny": RNG.standard_normal((16, 1024)) * 1e-6,
    "subnormal": RNG.standard_normal((8, 256)) * 1e-39,
    "huge": RNG.standard_normal((8, 512)) * 1e30,
    "wide range": RNG.standard_normal((8, 512)) * np.exp(RNG.uniform(-20, 20, (8, 512))),
    "all positive": RNG.random((16, 512)) + 1,
    "all negative": -RNG.random((16, 512)) - 1,
    "constant": np.full((8, 256), 0.37),
    "zeros": np.zeros((8, 256)),
    "few values": RNG.integers(-2, 3, (8, 512)) * 0.5,
}


def bf16(x) -> np.ndarray:
    return (np.asarray(x, np.float32).view(np.uint32) >> 16).astype(np.uint16)  # truncation


@pytest.mark.parametrize("bits", affine.BITS)
@pytest.mark.parametrize("case", CASES)
def test_the_bytes_and_the_error_are_mx_quantize_and_qerror(case, bits):
    block = bf16(CASES[case])
    want = [from_mlx(a) for a in mx.quantize(to_mlx(block, "BF16"), group_size=64, bits=bits)]
    parts, (num, den) = affine.quantize(block, bits, 64)
    for (got, gdt), (ref, rdt) in zip(parts, want, strict=True):
        assert gdt == rdt and got.dtype == ref.dtype and got.shape == ref.shape
        assert np.array_equal(got, ref)
    (packed, _), (scales, sdt), (biases, _) = want
    sums = qerror.block_sums(
        packed, to_float32(scales, sdt), to_float32(biases, sdt), block, bits, 64
    )
    assert (num, den) == sums


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan, 3e38])
def test_a_block_it_does_not_copy_mlx_on_is_left_to_mx_quantize(bad):
    """A non-finite weight, or finite ones whose range overflows float32 (3e38 - -3e38), is
    not quantized here: quantize hands the block to mx.quantize."""
    x = RNG.standard_normal((4, 128)).astype(np.float32)
    x[2, 70] = bad
    x[2, 71] = -abs(bad)
    assert affine.quantize(bf16(x), 4, 64) is None
    assert affine.quantize(bf16(x[:2]), 4, 64) is not None  # the rows before it are fine


@pytest.mark.parametrize("bits", affine.BITS)
@pytest.mark.parametrize("case", CASES)
def test_dequantized_is_mx_quantize_dequantized(case, bits):
    # verify's data-agnostic reference: the stored bytes' values, without the bytes
    block = bf16(CASES[case])
    (w, _), (s, sdt), (b, _) = (
        from_mlx(a) for a in mx.quantize(to_mlx(block, "BF16"), group_size=64, bits=bits)
    )
    want = dequantize(w, to_float32(s, sdt), to_float32(b, sdt), bits, 64)
    got = affine.dequantized_like_mx(block, "BF16", bits, 64)
    assert got.dtype == np.float32 and got.shape == block.shape
    assert np.array_equal(got, want, equal_nan=True)
