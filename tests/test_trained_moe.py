"""The second trained fixture, ``fixture:trained=austen``: the real model's shape, in small.

Its shape is asserted from the checkpoint it writes; its figures (held-out perplexity, the MTP
head's depth-1 acceptance, routed tokens per expert) are recomputed here through mlx_lm from
the shipped files and compared with what training recorded in meta.json.
"""

from __future__ import annotations

import filecmp
import json
import math
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import Project
from mlx.utils import tree_map
from test_trained import Recorder, load_trunk_and_head
from tokenizers import Tokenizer

from buildkit.cli.main import main
from buildkit.fixtures.generated import PRESETS, FixtureSpec
from buildkit.fixtures.trained import FIXTURES, calibration_tokens, write_trained
from buildkit.formats.tensors import read_header
from buildkit.steps.fetch import FetchParams

AUSTEN = FIXTURES["austen"]
META = json.loads((AUSTEN.data / "meta.json").read_text())
WINDOW = 66  # training's rows: a 64-token context plus the two targets


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return write_trained(tmp_path_factory.mktemp("austen") / "ckpt", AUSTEN.data, spec=AUSTEN.spec)


def heldout_rows(ckpt: Path) -> mx.array:
    """heldout.txt's paragraphs as training measured them: joined by newlines, in rows of 66."""
    lines = (AUSTEN.data / "heldout.txt").read_text().splitlines()
    text = "\n".join(ln for ln in lines if ln.strip() and not ln.startswith("#"))
    ids = Tokenizer.from_file(str(ckpt / "tokenizer.json")).encode(text, add_special_tokens=False)
    n = len(ids.ids) // WINDOW * WINDOW
    return mx.array(ids.ids[:n]).reshape(-1, WINDOW)


def test_shape_is_the_real_models_in_small(ckpt):
    text = json.loads((ckpt / "config.json").read_text())["text_config"]
    assert text["num_experts"] >= 32 and text["num_experts_per_tok"] >= 4
    assert text["shared_expert_intermediate_size"] > 0
    assert text["full_attention_interval"] == 4 and text["layer_types"] == [
        "full_attention" if n % 4 == 3 else "linear_attention"
        for n in range(text["num_hidden_layers"])
    ]
    assert text["mtp_num_hidden_layers"] == 1
    sizes = {}
    for f in ckpt.glob("*.safetensors"):
        for name, info in read_header(f).tensors.items():
            sizes[name] = math.prod(info.shape)
    for name in (  # the head: one full-attention MoE decoder layer with a shared expert
        "mtp.fc.weight",
        "mtp.layers.0.self_attn.q_proj.weight",
        "mtp.layers.0.mlp.experts.gate_up_proj",
        "mtp.layers.0.mlp.shared_expert.down_proj.weight",
        "model.language_model.layers.0.linear_attn.in_proj_qkv.weight",
        "model.language_model.layers.0.mlp.shared_expert.gate_proj.weight",
    ):
        assert name in sizes, name
    text_w = {n: s for n, s in sizes.items() if not n.startswith("model.visual.")}
    trunk = {n: s for n, s in text_w.items() if not n.startswith("mtp.")}
    assert "lm_head.weight" in trunk and "model.language_model.embed_tokens.weight" in trunk
    for part in (text_w, trunk):  # with and without the head
        share = sum(s for n, s in part.items() if ".mlp.experts." in n) / sum(part.values())
        assert share >= 0.85, f"routed experts are {share:.3f} of the text weights"
    shipped = read_header(AUSTEN.data / "weights.safetensors")
    assert {i.dtype for i in shipped.tensors.values()} == {"BF16"}
    assert (AUSTEN.data / "weights.safetensors").stat().st_size <= 15_000_000


def figures(ckpt: Path, rows: mx.array) -> dict:
    """Held-out perplexity, depth-1 acceptance and routed tokens per expert, as meta.json's."""
    from mlx_lm.models.base import create_attention_mask

    model, head = load_trunk_and_head(ckpt)  # mlx_lm.load, then float32
    text = model.language_model.model
    eps = model.language_model.args.rms_norm_eps
    k = model.language_model.args.num_experts_per_tok
    text.norm = Recorder(text.norm, "in")  # h_t: the hidden state before the final norm
    routers = {
        f"layers.{n}": Recorder(layer.mlp.gate, "out") for n, layer in enumerate(text.layers)
    }
    for layer, r in zip(text.layers, routers.values()):
        layer.mlp.gate = r
    routers["mtp.layers.0"] = Recorder(head["layer"].mlp.gate, "out")
    head["layer"].mlp.gate = routers["mtp.layers.0"]
    nll = hits = positions = tokens = 0.0
    counts = {name: 0 for name in routers}
    for i in range(0, rows.shape[0], 8):
        x = rows[i : i + 8]
        for r in [text.norm, *routers.values()]:
            r.seen.clear()
        logits = model(x[:, :-1])
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        nll += float(-mx.take_along_axis(logp, x[:, 1:, None], axis=-1).sum())
        tokens += x[:, 1:].size
        emb = text.embed_tokens(x[:, 1:-1])
        h = text.norm.seen[0][:, :-1]
        g = mx.concatenate(
            [
                mx.fast.rms_norm(emb, head["pre_fc_norm_embedding.weight"], eps),
                mx.fast.rms_norm(h, head["pre_fc_norm_hidden.weight"], eps),
            ],
            axis=-1,
        )
        g = g @ head["fc"].T
        g = head["layer"](g, mask=create_attention_mask(g, None), cache=None)
        draft = model.language_model.lm_head(mx.fast.rms_norm(g, head["norm.weight"], eps))
        trunk_next = mx.argmax(logits[:, 1:], axis=-1)
        hits += float((mx.argmax(draft, axis=-1) == trunk_next).sum())
        positions += trunk_next.size
        for name, r in routers.items():
            top = np.array(mx.argpartition(-r.seen[0], kth=k - 1, axis=-1)[..., :k]).reshape(-1)
            counts[name] = counts[name] + np.bincount(top, minlength=AUSTEN.spec.experts)
    return {
        "perplexity": math.exp(nll / tokens),
        "acceptance": hits / positions,
        "expert_tokens": counts,
    }


def test_figures_match_meta_and_show_learning(ckpt):
    rows = heldout_rows(ckpt)
    # heldout.txt starts the held-out stream training measured: most of meta's rows
    assert rows.size >= 0.8 * META["figures"]["heldout_tokens"]
    got, want = figures(ckpt, rows), META["figures"]
    assert got["perplexity"] == pytest.approx(want["perplexity"], rel=0.03)
    assert got["acceptance"] == pytest.approx(want["acceptance"], abs=0.01)
    assert got["perplexity"] < AUSTEN.spec.vocab / 20  # learnt: far below uniform's 1024
    assert got["acceptance"] > 0.5  # the head drafts: chance is ~1/vocab
    assert set(got["expert_tokens"]) == set(want["expert_tokens"])
    for name, c in got["expert_tokens"].items():
        share, meta_share = c / c.sum(), np.array(want["expert_tokens"][name])
        meta_share = meta_share / meta_share.sum()
        assert np.abs(share - meta_share).max() < 0.003, name
        # experts specialise without collapsing: uneven, yet most of them in use
        assert share.std() > 0.002 and share.max() < 5 / len(share), (name, share.round(3))
        assert (share > 0.2 / len(share)).sum() >= 0.75 * len(share), (name, share.round(3))


def test_cli_names_the_fixture_and_says_the_calibration_length(ckpt, tmp_path, capsys):
    assert main(["fixture", "--trained", "austen", str(tmp_path / "cli")]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == str(tmp_path / "cli")
    assert f"params.max_tokens = {calibration_tokens(AUSTEN.spec)}" in err
    names = sorted(p.name for p in ckpt.iterdir())
    assert not filecmp.cmpfiles(ckpt, tmp_path / "cli", names, shallow=False)[1]
    assert main(["fixture", "--trained", "nosuch", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "no trained fixture 'nosuch'" in err and all(n in err for n in FIXTURES)
    assert not (tmp_path / "x").exists()
    assert main(["fixture", "--trained", "austen"]) == 2
    assert "needs an output directory" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["fixture", "--help"])
    help_text = capsys.readouterr().out
    assert "fixture:trained=NAME" in help_text and all(n in help_text for n in FIXTURES)


def test_a_source_names_a_trained_fixture(tmp_path, capsys):
    assert FetchParams(source="fixture:trained=austen").source == "fixture:trained=austen"
    with pytest.raises(ValueError, match=r"known ones: fixture:trained=kjv .*fixture:trained="):
        FetchParams(source="fixture:trained=nosuch")
    p = Project(tmp_path)
    assert p.cli("plan", "xl", "--source", "fixture:trained=nosuch") == 2
    err = capsys.readouterr().err
    assert "no trained fixture 'nosuch'" in err and "fixture:trained=austen" in err
    # estimate reads the named fixture's shape
    assert p.cli("estimate", "xl", "--source", "fixture:trained=austen", "--json") == 0
    roles = {r["role"]: r for r in json.loads(capsys.readouterr().out)["roles"]}
    s = AUSTEN.spec
    assert roles["routed_expert"]["params"] == s.layers * s.experts * 3 * s.hidden * 64


def test_calibration_tokens_give_the_real_models_rows_per_input():
    real = FixtureSpec(**PRESETS["qwen3.6-35b-a3b"])
    assert calibration_tokens(real) == 4096  # calibrate's default on the real model
    s = AUSTEN.spec
    assert calibration_tokens(s) == META["calibration_tokens_real_regime"] == 96
    assert 96 * s.experts_per_tok / s.experts / s.hidden == 4096 * 8 / 256 / 2048


def test_xl_build_from_the_named_source_keeps_its_predictions(ckpt, tmp_path):
    import mlx_lm

    p = Project(tmp_path)
    out = p.out / "xl"
    assert p.cli("build", "xl", "--source", "fixture:trained=austen", "--out", str(out), "-q") == 0
    rows = heldout_rows(ckpt)[:16]  # ~1000 tokens: mlx's quantized CPU kernels are slow

    def ppl(path: Path) -> float:
        model, _ = mlx_lm.load(str(path))
        if path == ckpt:  # mlx on CPU has no bf16 gather_mm
            model.update(tree_map(lambda a: a.astype(mx.float32), model.parameters()))
        logits = model(rows[:, :-1]).astype(mx.float32)
        logp = logits - mx.logsumexp(logits, -1, keepdims=True)
        return math.exp(float(-mx.take_along_axis(logp, rows[:, 1:, None], -1).mean()))

    bf16, xl = ppl(ckpt), ppl(out)
    assert xl == pytest.approx(bf16, rel=0.05), (xl, bf16)  # 6-bit experts, 8-bit attention
