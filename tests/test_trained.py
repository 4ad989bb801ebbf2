"""The trained fixture (buildkit/data/trained): layout, determinism, and that it learnt something.

Figures are computed here from the Hugging Face layout files with a forward written from
DESIGN's definitions, not with training/train_fixture.py's code.
"""

from __future__ import annotations

import filecmp
import json
import math
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import Project
from mlx.utils import tree_map
from tokenizers import Tokenizer

from buildkit.cli.main import main
from buildkit.fixtures.generated import FixtureSpec, generate
from buildkit.fixtures.trained import DATA, SPEC, write_trained


def heldout_text() -> str:
    lines = (DATA / "heldout.txt").read_text().splitlines()
    return "\n".join(ln for ln in lines if ln.strip() and not ln.startswith("#"))


def heldout_ids(ckpt: Path, window: int = 66) -> mx.array:
    """Held-out token ids as rows of ``window``: the training's 64-token context plus two
    targets."""
    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    ids = tok.encode(heldout_text(), add_special_tokens=False).ids
    return mx.array(ids[: len(ids) // window * window]).reshape(-1, window)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return write_trained(tmp_path_factory.mktemp("trained") / "ckpt")


def test_layout_matches_the_generator_and_is_deterministic(ckpt, tmp_path):
    again = write_trained(tmp_path / "again")
    random = generate(tmp_path / "random", SPEC, tokenizer=(DATA / "tokenizer.json").read_text())
    names = sorted(p.name for p in ckpt.iterdir())
    assert (
        names == sorted(p.name for p in again.iterdir()) == sorted(p.name for p in random.iterdir())
    )
    assert not filecmp.cmpfiles(ckpt, again, names, shallow=False)[1]  # byte-identical
    # same config, tokenizer and index as the generator writes; other tensor values
    for same in (
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "model.safetensors.index.json",
    ):
        assert (ckpt / same).read_bytes() == (random / same).read_bytes()
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    assert {f for k, f in index.items() if k.startswith("mtp.")} == {
        "model-00002-of-00002.safetensors"
    }
    assert (ckpt / "model-00001-of-00002.safetensors").read_bytes() != (
        random / "model-00001-of-00002.safetensors"
    ).read_bytes()
    config = json.loads((ckpt / "config.json").read_text())
    assert (
        config["text_config"]["vocab_size"]
        == SPEC.vocab
        == Tokenizer.from_file(str(ckpt / "tokenizer.json")).get_vocab_size()
    )
    with pytest.raises(FileExistsError, match="not empty"):
        write_trained(ckpt)


def test_cli_writes_the_same_checkpoint(ckpt, tmp_path, capsys):
    assert main(["fixture", "--trained", str(tmp_path / "cli")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "cli")
    names = sorted(p.name for p in ckpt.iterdir())
    assert not filecmp.cmpfiles(ckpt, tmp_path / "cli", names, shallow=False)[1]
    assert main(["fixture", "--trained", "--layers", "8", str(tmp_path / "x")]) == 2
    assert "fixed shape" in capsys.readouterr().err


def test_xl_build_from_fixture_trained_predicts_heldout_text(tmp_path):
    import mlx_lm

    p = Project(tmp_path)
    assert (
        p.cli("build", "xl", "--source", "fixture:trained", "--out", str(p.out / "xl"), "-q") == 0
    )
    model, _ = mlx_lm.load(str(p.out / "xl"))
    ids = heldout_ids(p.out / "xl")[:16]  # ~1000 tokens: mlx's quantized CPU kernels are slow
    logits = model(ids[:, :-1]).astype(mx.float32)
    nll = -mx.take_along_axis(
        logits - mx.logsumexp(logits, -1, keepdims=True), ids[:, 1:, None], -1
    )
    ppl = math.exp(float(nll.mean()))
    assert ppl < SPEC.vocab / 20, (
        f"xl held-out perplexity {ppl:.1f} (uniform would be {SPEC.vocab})"
    )


# ---- the MTP head, from the HF-layout weights --------------------------------------------


def load_trunk_and_head(ckpt: Path):
    """mlx_lm's trunk (its own load and sanitize) and the head's tensors, float32."""
    import mlx_lm
    from mlx_lm.models.qwen3_5 import DecoderLayer

    model, _ = mlx_lm.load(str(ckpt))
    model.update(tree_map(lambda a: a.astype(mx.float32), model.parameters()))
    raw = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        raw.update(
            {
                k[4:]: v.astype(mx.float32)
                for k, v in mx.load(str(f)).items()
                if k.startswith("mtp.")
            }
        )
    args = model.language_model.args
    layer = DecoderLayer(args, layer_idx=args.full_attention_interval - 1)  # full attention + MoE
    p = "layers.0."
    gate_up = raw[p + "mlp.experts.gate_up_proj"]
    mid = gate_up.shape[1] // 2
    weights = {
        k[len(p) :]: v + 1.0 if k.endswith("norm.weight") else v  # HF stores offset norms
        for k, v in raw.items()
        if k.startswith(p) and ".experts." not in k
    }
    weights |= {
        "mlp.switch_mlp.gate_proj.weight": gate_up[:, :mid],
        "mlp.switch_mlp.up_proj.weight": gate_up[:, mid:],
        "mlp.switch_mlp.down_proj.weight": raw[p + "mlp.experts.down_proj"],
    }
    layer.load_weights(list(weights.items()), strict=True)
    head = {
        k: raw[k] + 1.0
        for k in ("pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "norm.weight")
    }
    head["fc"], head["layer"] = raw["fc.weight"], layer
    return model, head


class Recorder(nn.Module):
    """Calls the wrapped module and keeps its input (``which='in'``) or output."""

    def __init__(self, inner, which: str):
        super().__init__()
        self.inner, self.which, self.seen = inner, which, []

    def __call__(self, x):
        y = self.inner(x)
        self.seen.append(x if self.which == "in" else y)
        return y


def test_head_drafts_and_experts_specialise(ckpt):
    from mlx_lm.models.base import create_attention_mask

    model, head = load_trunk_and_head(ckpt)
    text = model.language_model.model
    eps = model.language_model.args.rms_norm_eps
    text.norm = Recorder(text.norm, "in")  # h_t: the trunk's hidden state before the final norm
    routers = [Recorder(layer.mlp.gate, "out") for layer in text.layers]
    for layer, r in zip(text.layers, routers):
        layer.mlp.gate = r
    ids = heldout_ids(ckpt)
    logits = model(ids)
    h = text.norm.seen[0]

    # head at position t: fc(cat([norm_e(embed(t+1)), norm_h(h_t)])) -> layer -> norm -> lm_head
    emb = text.embed_tokens(ids[:, 1:])
    x = mx.concatenate(
        [
            mx.fast.rms_norm(emb, head["pre_fc_norm_embedding.weight"], eps),
            mx.fast.rms_norm(h[:, :-1], head["pre_fc_norm_hidden.weight"], eps),
        ],
        axis=-1,
    )
    x = x @ head["fc"].T
    x = head["layer"](x, mask=create_attention_mask(x, None), cache=None)
    draft = model.language_model.lm_head(mx.fast.rms_norm(x, head["norm.weight"], eps))
    trunk_next = mx.argmax(logits[:, 1:-1], -1)
    # a model that always says " the" would agree with itself: the trunk's choices must vary
    assert len(set(np.array(trunk_next).ravel().tolist())) >= 100
    accepted = mx.argmax(draft[:, :-1], -1) == trunk_next  # head's t+2 vs the trunk's argmax at t+1
    acceptance = float(accepted.astype(mx.float32).mean())
    assert acceptance >= 0.40, f"teacher-forced depth-1 acceptance {acceptance:.3f}"

    k = model.language_model.args.num_experts_per_tok
    for n, r in enumerate(routers):
        top = np.array(mx.argpartition(-r.seen[0], kth=k - 1, axis=-1)[..., :k]).reshape(-1)
        share = np.bincount(top, minlength=SPEC.experts) / top.size
        assert share.std() > 0.01, f"layer {n}: routing is uniform {share.round(3)}"
        assert share.max() < 0.5 and (share > 0.02).sum() >= SPEC.experts // 2, (
            f"layer {n}: routing collapsed {share.round(3)}"
        )


def test_spec_is_a_valid_fixture_spec():
    assert FixtureSpec(**SPEC.model_dump()) == SPEC and SPEC.vocab == 2048
