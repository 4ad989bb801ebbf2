"""The reference node: the bf16 source's pass, computed once and shared by every eval built from
that source; eval's figures against it are mlx_lm's on the trained fixtures."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import Project, cached, ran

from buildkit.fixtures.trained import FIXTURES, write_trained
from buildkit.grade import evaluate as ev
from buildkit.grade import forward as fw
from buildkit.grade import reference as rf
from buildkit.grade import texts
from buildkit.grade.weights import DirWeights
from buildkit.steps.reference import ReferenceParams


@pytest.fixture(scope="module", params=["kjv", "austen"])
def trained_xl(request, tmp_path_factory):
    """A trained fixture's source directory and its xl build, published."""
    fixture = FIXTURES[request.param]
    root = tmp_path_factory.mktemp(f"ref-{request.param}")
    src = write_trained(root / "src", fixture.data, spec=fixture.spec)
    p = Project(root / "project")
    # 128 tokens: mlx_lm's and eval's float32 arithmetic agree within 1e-3 of KL's mean there;
    # over the whole text (1638) a few tail positions (KL ~2) move it by ~2% (both ways agree
    # only within the interval, tests/grade/test_intervals.py)
    p.write_manifest("xl-128", 'extends = "xl"\n[steps.reference]\nparams.max_tokens = 128\n')
    p.build("xl-128", "--source", str(src))
    return p, Path(src)


def _mlx_lm_kl(src, mod, windows) -> np.ndarray:
    """KL(p_source || p_model) per position with a next token, both models as mlx_lm loads
    them, in float32, whole (no streaming, no numpy matmuls, no reference node)."""
    out = []
    for b in windows:
        for row in b:
            lp = [m(mx.array(row[None]))[0, :-1] for m in (src, mod)]
            lp = [x - mx.logsumexp(x, axis=-1, keepdims=True) for x in lp]
            out.append(np.array((mx.exp(lp[0]) * (lp[0] - lp[1])).sum(axis=-1)))
    return np.concatenate(out).astype(np.float64)


def test_kl_from_the_reference_is_mlx_lms_on_the_same_tokens(trained_xl):
    """The eval step's KL mean, its source side from the reference node, is what mlx_lm
    computes with both models run whole on the same windows."""
    from mlx_lm import load

    p, src_dir = trained_xl
    src, _ = load(str(src_dir))
    mod, _ = load(str(p.out / "xl-128"))
    for m in (src, mod):
        m.set_dtype(mx.float32)  # as eval runs them
    tok = (src_dir / "tokenizer.json").read_bytes()
    text = texts.read(texts.text_path(texts.DEFAULT, src_dir))
    windows = texts.windows(texts.heldout_tokens(text, 5, tok, 128), ReferenceParams().seq_len)
    want = _mlx_lm_kl(src, mod, windows)
    got = json.loads((p.out / "xl-128" / "eval.json").read_text())
    assert got["positions"] == len(want) and want.mean() > 0
    assert got["kld_mean"] == pytest.approx(want.mean(), rel=1e-3)
    assert got["kld_median"] == pytest.approx(np.median(want), rel=5e-2)  # small values: noisier


def test_the_reference_is_the_sources_own_figures(trained_xl):
    """Against itself the source has KL 0 and top-1 1, the source's perplexity is its own."""
    _, src_dir = trained_xl
    src = DirWeights(src_dir)
    windows, groups = rf.layout({"": list(range(3, 200))}, 64)
    ref = rf.compute(src, windows, groups)
    f = ev.position_figures(src, src, ref, fw.run_trunk(src, windows))
    assert f["kl"].max() < 1e-5 and f["agree"].all() and np.abs(f["delta_p"]).max() < 1e-5
    np.testing.assert_allclose(f["nll_model"], f["nll_source"], rtol=1e-5)


def test_a_head_scan_of_several_models_gives_each_its_own_pairs_bytes(trained_xl):
    """Sensitivity grades many models against the source in one scan, the source's logits made
    once: each model's figures are exactly those of a scan of the source and it alone."""
    p, src_dir = trained_xl
    src, mod = DirWeights(src_dir), DirWeights(p.out / "xl-128")
    windows, _ = rf.layout({"": list(range(3, 200))}, 64)
    hn, hm = (fw.final_norm(w, fw.run_trunk(w, windows).h) for w in (src, mod))
    noisy = hn + 0.05 * np.random.default_rng(0).standard_normal(hn.shape).astype(np.float32)
    targets = rf.next_tokens(windows)
    many = fw.HeadScan([src, mod, src], [hn, hm, noisy], targets)
    for j, (w, h) in enumerate([(mod, hm), (src, noisy)], start=1):
        pair = fw.HeadScan([src, w], [hn, h], targets)
        assert pair.kl().mean() > 1e-4  # a model apart from the source, not a trivial zero
        for got, want in [
            (many.kl(j), pair.kl()),
            (many.delta_p(j), pair.delta_p()),
            (many.arg[j], pair.arg[1]),
            (many.nll(j), pair.nll(1)),
            (many.nll(0), pair.nll(0)),
        ]:
            np.testing.assert_array_equal(got, want)


def test_a_model_with_the_sources_head_is_graded_against_the_references_summary(trained_xl):
    """xl's lm_head is the source's (bf16, passed through): its scan alone, against the
    reference's summary of the source's head, gives what the two-head scan gives: the same
    bytes but KL, which is as close to float64's as that scan's."""
    p, src_dir = trained_xl
    src, mod = DirWeights(src_dir), DirWeights(p.out / "xl-128")
    windows, groups = rf.layout({"": list(range(3, 200))}, 64)
    ref = rf.compute(src, windows, groups)
    hn, hm = fw.final_norm(src, ref.trunk.h), fw.final_norm(mod, fw.run_trunk(mod, windows).h)
    targets = ref.targets()
    pair = fw.HeadScan([src, mod], [hn, hm], targets)
    alone = ref.head.scan(mod, hm, hn, targets)
    assert pair.kl().mean() > 1e-3  # the quantized trunk moves the distributions
    # each within ~5e-7 of KL in float64; without the top ids' float32 (a - b), ~7e-6 apart
    np.testing.assert_allclose(ref.head.kl(alone), pair.kl(), rtol=1e-5, atol=1.5e-6)
    for got, want in [
        (ref.head.delta_p(alone), pair.delta_p()),
        (ref.head.arg, pair.arg[0]),
        (alone.arg[0], pair.arg[1]),
        (ref.head.nll(), pair.nll(0)),
        (alone.nll(0), pair.nll(1)),
    ]:
        np.testing.assert_array_equal(got, want)


def test_heads_are_the_same_only_when_their_stored_bytes_are(tmp_path):
    """Only stored tensors with equal digests count as the same head: a quantized head, a
    directory's tensors (no digest known) or a missing one do not."""
    from buildkit.grade.weights import StoreWeights, same_tensors
    from buildkit.store.artifact import Artifact
    from buildkit.store.store import Store

    store = Store(tmp_path / "store")
    w = np.arange(12, dtype=np.uint16).reshape(3, 4)

    def weights(**tensors):
        art = Artifact()
        art.tensors.update({k: store.put_tensor("BF16", v) for k, v in tensors.items()})
        return StoreWeights(store, [art], {}, None)

    a = weights(**{"lm_head.weight": w, "norm.weight": w[0]})
    assert same_tensors(a, weights(**{"lm_head.weight": w.copy()}), "lm_head.")
    assert not same_tensors(a, weights(**{"lm_head.weight": w + 1}), "lm_head.")
    assert not same_tensors(a, weights(**{"lm_head.weight": w, "lm_head.scales": w}), "lm_head.")
    assert not same_tensors(a, weights(**{"other.weight": w}), "lm_head.")
    assert not same_tensors(a, a, "missing.")


def test_every_variant_from_one_source_shares_one_reference(seed, project, capsys):
    """xl and xl-mtp share it; oq4e-mtp-xl, planned in their store, finds it cached; a second
    variant's build runs its eval (one model's forward) and not the reference."""
    project.adopt(seed)
    refs = {
        v: json.loads((project.store / "refs" / f"{v}.json").read_text()) for v in ("xl", "xl-mtp")
    }
    assert refs["xl"]["keys"]["reference"] == refs["xl-mtp"]["keys"]["reference"]
    capsys.readouterr()
    assert project.cli("graph", "xl-mtp") == 0
    assert "reference (reference) <- source=sanitize:model\n" in capsys.readouterr().out
    assert project.cli("plan", "oq4e-mtp-xl") == 0
    out = capsys.readouterr().out
    assert f"fresh reference (reference) {refs['xl']['keys']['reference'][9:21]}\n" in out
    assert "stale reference_domains (reference)" in out  # its domain texts are its own
    b = project.build("xl-3bit")
    assert "eval" in ran(b) and "reference" in cached(b)
    # its lm_head is the source's: the eval makes its own logits, not the source's again
    assert "graded (the source's output head from the reference's summary)" in b.stderr, b.stderr
    xl3 = json.loads((project.out / "xl-3bit" / "eval.json").read_text())
    xl = json.loads((project.out / "xl" / "eval.json").read_text())
    assert xl3["ppl_source"] == xl["ppl_source"] and xl3["kld_mean"] > xl["kld_mean"]


def test_an_eval_without_a_reference_says_how_to_give_one(seed, project):
    project.adopt(seed)
    project.write_manifest(
        "xl-noref", 'extends = "xl"\n[steps.eval]\ninputs = { reference = [] }\n'
    )
    p = project.run("build", "xl-noref", "--target", "eval", check=False)
    assert p.returncode == 1 and ran(p) == ["eval"], p.stderr
    assert 'give input reference = ["reference"]' in p.stderr and "Traceback" not in p.stderr


def test_row_parts_cover_every_row_once_in_order_within_the_limit():
    seqs = [np.zeros((5, 64), np.int32), np.zeros((1, 30), np.int32), np.zeros((2, 200), np.int32)]
    parts = fw.row_parts(seqs, 128)
    rows = [(j, r) for part in parts for j, a, b in part for r in range(a, b)]
    assert rows == [(j, r) for j, s in enumerate(seqs) for r in range(s.shape[0])]
    sizes = [sum((b - a) * seqs[j].shape[1] for j, a, b in part) for part in parts]
    assert sizes == [128, 128, 94, 200, 200]  # a row longer than the limit: alone
    assert fw.row_parts(seqs, 10_000) == [[(0, 0, 5), (1, 0, 1), (2, 0, 2)]]


def test_the_trunk_in_parts_is_the_trunk_whole(trained_xl, monkeypatch):
    """A long text goes through the layers in parts of TRUNK_POSITIONS (memory bounded, the
    experts read once a part): the same hidden states as one pass, and, through mlx_lm's
    SparseMoeBlock (the k outputs summed in mlx), the streamed switch's sum expert by expert."""
    _, src_dir = trained_xl
    src = DirWeights(src_dir)
    windows, _ = rf.layout({"": [t % 200 for t in range(3, 300)], "b": list(range(7, 140))}, 64)
    whole = fw.run_trunk(src, windows)
    monkeypatch.setattr(fw, "TRUNK_POSITIONS", 100)
    assert len(fw.row_parts(windows, 100)) > 3
    parts = fw.run_trunk(src, windows)
    for a, b in zip(whole.x0, parts.x0, strict=True):
        np.testing.assert_array_equal(np.array(a), np.array(b))
    for a, b in zip(whole.h, parts.h, strict=True):  # matmuls over other row counts round
        assert a.shape == b.shape  # otherwise: ~30 float32 ulps after the layers
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-4, atol=2e-4)
    layer = fw.streamed_layer(src, "language_model.model.layers.0.", fw.text_args(src), 0)
    x = mx.array(np.random.default_rng(0).standard_normal((50, whole.h[0].shape[-1]), np.float32))
    inds, scores = fw.route(layer.mlp, x)
    summed = np.array(fw.routed_sum(layer.mlp.switch_mlp, x, inds, scores))
    per_choice = layer.mlp.switch_mlp(x, inds)  # [N, k, H], as mlx_lm's block sums them
    want = np.array((per_choice * scores[..., None]).sum(axis=-2))
    np.testing.assert_allclose(summed, want, rtol=1e-5, atol=1e-5)
