"""The published xl in mlx_vlm (what the published family's users and LM Studio run): it loads
with its vision tower quantized as the recipe says, and the tower's image features stay close to
the bf16 tower's."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import Project
from mlx_vlm import load

QUANTIZED_VISION = ("attn.qkv", "attn.proj", "mlp.linear_fc1")  # in every block; merger fc1/fc2 too
MIN_COSINE = 0.99  # 6-bit g64 weights; measured 0.9988 on the fixture


@pytest.fixture(scope="module")
def loaded(seed: Project):
    model, _ = load(str(seed.out / "xl"))
    return seed, model


def features(model, pixels: mx.array, grid: mx.array) -> np.ndarray:
    out = model.vision_tower(pixels, grid)
    out = out[0] if isinstance(out, tuple) else out
    return np.array(out.astype(mx.float32))


def test_mlx_vlm_loads_the_vision_tower_quantized_by_the_recipe(loaded):
    seed, model = loaded
    tower = model.vision_tower
    for block in tower.blocks:
        for path in QUANTIZED_VISION:
            m = block
            for part in path.split("."):
                m = getattr(m, part)
            assert isinstance(m, nn.QuantizedLinear) and (m.bits, m.group_size) == (6, 64), path
        # the real model's linear_fc2 takes 4304 inputs (not a multiple of 64): bf16
        assert (
            type(block.mlp.linear_fc2) is nn.Linear
            and block.mlp.linear_fc2.weight.dtype == mx.bfloat16
        )
    assert isinstance(tower.merger.linear_fc1, nn.QuantizedLinear) and isinstance(
        tower.merger.linear_fc2, nn.QuantizedLinear
    )
    assert type(tower.pos_embed) is nn.Embedding  # position embedding and conv patch embedding bf16
    assert tower.patch_embed.proj.weight.dtype == mx.bfloat16


def test_every_quantized_module_has_the_bits_the_config_gives_its_path(loaded):
    """publish's per-path entries are module paths as mlx_vlm's class predicate reads them."""
    seed, model = loaded
    cfg = json.loads((seed.out / "xl" / "config.json").read_text())["quantization"]
    default = (cfg["bits"], cfg["group_size"])
    per_path = {k: v for k, v in cfg.items() if isinstance(v, dict)}
    modules = dict(model.named_modules())
    assert per_path and set(per_path) <= set(modules)
    seen = 0
    for path, m in modules.items():
        if hasattr(m, "bits"):
            want = per_path.get(path, {"bits": default[0], "group_size": default[1]})
            assert (m.bits, m.group_size) == (want["bits"], want["group_size"]), path
            seen += 1
    assert seen == len(per_path) + 12 + 8  # 8-bit entries + routed experts and vision linears at 6


def test_quantized_image_features_are_close_to_the_bf16_towers(loaded):
    seed, model = loaded
    src = next((seed.store / "fixtures").iterdir())  # the bf16 source, loaded by mlx_vlm itself
    ref, _ = load(str(src))
    assert type(ref.vision_tower.blocks[0].attn.qkv) is nn.Linear
    rng = np.random.default_rng(0)
    grid = mx.array([[1, 8, 8]])  # one frame of 8 x 8 patches of 16 px: a 128 x 128 image
    patch = 3 * 2 * 16 * 16  # channels x temporal patch x patch x patch
    pixels = mx.array(rng.standard_normal((64, patch)).astype(np.float32)).astype(mx.bfloat16)
    a, b = features(model, pixels, grid), features(ref, pixels, grid)
    assert a.shape == b.shape == (16, 128)  # 2 x 2 patches merged into one token of the text width
    a, b = a.ravel(), b.ravel()
    cosine = float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))
    print(f"vision features cosine similarity, xl vs bf16: {cosine:.5f}")
    assert MIN_COSINE < cosine < 1.0
