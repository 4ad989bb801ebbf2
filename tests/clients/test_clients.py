"""The clients of a published model: mlx_vlm (image prompts, the MTP drafter) and oMLX's rules.

Every default variant is built once for the module (xl and xl-mtp from the session's seed,
oq4e-mtp-xl here: ~90 s). The MTP head's draft logits in mlx_vlm are compared with the head's
forward computed from the bf16 source, and a head whose norms are shifted twice must not match.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import pytest
from conftest import HEAD_NORMS, Project

from buildkit.fixtures.generated import SPECIAL_TOKENS

VARIANTS = ("xl", "xl-mtp", "oq4e-mtp-xl")
HEAD = "language_model.mtp."
POSITIONS = 24


@pytest.fixture(scope="module")
def built(seed: Project, tmp_path_factory) -> Project:
    p = Project(tmp_path_factory.mktemp("clients")).adopt(seed)
    assert p.cli("build", "oq4e-mtp-xl", "-q") == 0
    return p


def fixture_dir(p: Project) -> Path:
    (src,) = (p.store / "fixtures").glob("trained-*")  # the default manifests' source
    return src


def an_image(side: int = 64):
    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:side, 0:side]
    return Image.fromarray((np.stack([x * 4, y * 4, (x + y) * 2], axis=-1) % 256).astype(np.uint8))


# --- the fixture carries what a real source carries, and publish passes it on ---------------


def test_the_fixture_carries_what_an_image_prompt_needs_and_publish_passes_it_on(built: Project):
    src = fixture_dir(built)
    cfg = json.loads((src / "config.json").read_text())
    vocab = json.loads((src / "tokenizer.json").read_text())["added_tokens"]
    ids = {t["content"]: t["id"] for t in vocab}
    assert set(SPECIAL_TOKENS) <= set(ids)
    assert (
        cfg["image_token_id"] == ids["<|image_pad|>"]
        and cfg["video_token_id"] == ids["<|video_pad|>"]
    )
    assert (
        cfg["vision_start_token_id"] == ids["<|vision_start|>"]
        and cfg["vision_end_token_id"] == ids["<|vision_end|>"]
    )
    side = (
        "chat_template.jinja",
        "preprocessor_config.json",
        "video_preprocessor_config.json",
        "generation_config.json",
    )
    pre = json.loads((src / "preprocessor_config.json").read_text())
    assert (pre["patch_size"], pre["merge_size"], pre["temporal_patch_size"]) == (16, 2, 2)
    for variant in VARIANTS:
        for name in side:
            assert (built.out / variant / name).read_bytes() == (src / name).read_bytes(), (
                variant,
                name,
            )


def test_hf_fetch_downloads_the_processor_files():
    from fnmatch import fnmatch

    from buildkit.steps.fetch import HF_PATTERNS

    for name in (
        "chat_template.jinja",
        "preprocessor_config.json",
        "video_preprocessor_config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ):
        assert any(fnmatch(name, pat) for pat in HF_PATTERNS), name


def test_a_vision_source_without_processor_files_is_warned_about(built: Project, tmp_path):
    src = shutil.copytree(fixture_dir(built), tmp_path / "src")
    (src / "preprocessor_config.json").unlink()
    (src / "chat_template.jinja").unlink()
    tok = json.loads((src / "tokenizer_config.json").read_text())
    del tok["chat_template"]
    (src / "tokenizer_config.json").write_text(json.dumps(tok))
    p = Project(tmp_path / "proj").adopt(built)
    res = p.build("xl", "--source", str(src))
    assert (
        "warning: the source has a vision tower (vision_config) "
        "but no preprocessor_config.json and no "
        "a chat template (chat_template.jinja)"
    ) in res.stderr
    assert (
        "client check (mlx_vlm, text prompt)" in res.stderr
    )  # the model still loads and runs text


# --- mlx_vlm ---------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_mlx_vlm_generates_from_an_image_prompt(built: Project, variant: str):
    from mlx_vlm import generate, load
    from mlx_vlm.prompt_utils import apply_chat_template
    from mlx_vlm.utils import prepare_inputs

    model, processor = load(str(built.out / variant))
    prompt = apply_chat_template(processor, model.config, "Describe the image.", num_images=1)
    inputs = prepare_inputs(
        processor,
        images=[an_image()],
        prompts=prompt,
        image_token_index=model.config.image_token_id,
    )
    assert (
        int((inputs["input_ids"] == model.config.image_token_id).sum().item()) == 4
    )  # 4x4 patches, 2x2 merge
    res = generate(
        model, processor, prompt, image=[an_image()], max_tokens=3, temperature=0.0, verbose=False
    )
    assert res.generation_tokens >= 1 and res.prompt_tokens == inputs["input_ids"].shape[1]


# --- the MTP head in oMLX and in mlx_vlm ------------------------------------------------------


def omlx_problems(d: Path) -> list[str]:
    """oMLX's rules for a model with an MTP head (docs/architecture.md), checked on a published
    directory."""
    cfg = json.loads((d / "config.json").read_text())
    tc = cfg.get("text_config", cfg)
    problems = []
    if not tc.get("mtp_num_hidden_layers", 0) > 0:
        problems.append("text_config.mtp_num_hidden_layers is not > 0")
    if not cfg.get("model_type", "").startswith("qwen3_5"):
        problems.append(f"model_type {cfg.get('model_type')!r} does not start with qwen3_5")
    wm = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    head = sorted(k for k in wm if k.startswith(HEAD))
    if not head:
        return problems + ["no language_model.mtp. keys in the index's weight_map"]
    weights = {}
    for shard in sorted({wm[k] for k in head}):
        weights |= mx.load(str(d / shard))
    q = cfg.get("quantization", {})
    default = {k: v for k, v in q.items() if not isinstance(v, dict)}
    for k in head:  # per-path quantization as mlx_lm reads it must fit the packed shapes
        if k.endswith(".scales"):
            path = k.removesuffix(".scales")
            spec = q.get(path, default)
            w, s = weights[path + ".weight"], weights[k]
            if s.shape[-1] * spec["group_size"] != w.shape[-1] * 32 // spec["bits"]:
                problems.append(
                    f"{path}: {spec} does not fit weight {w.shape} and scales {s.shape}"
                )
    norms = [HEAD + n + ".weight" for n in HEAD_NORMS]
    missing = [n for n in norms if n not in weights]
    problems += [f"head norm {n} missing" for n in missing]
    for n in set(norms) - set(missing):  # pre-shifted; an older oMLX re-shifts any with mean < 0.5
        if (mean := weights[n].astype(mx.float32).mean().item()) < 0.5:
            problems.append(
                f"{n} mean {mean:.3f} < 0.5: not pre-shifted (or re-shifted by older oMLX)"
            )
    return problems


def reference_logits(src: Path, tokens, hidden):
    """The head's forward from the bf16 source, in float32:
    fc(cat([norm_e(embed(t+1)), norm_h(h_t)])) -> one decoder layer -> norm -> the trunk's lm_head,
    norms as runtime weights 1 + w."""
    from mlx_lm.models.qwen3_5 import DecoderLayer, TextModelArgs

    w = {}
    for f in sorted(src.glob("*.safetensors")):
        w |= {
            k: v.astype(mx.float32)
            for k, v in mx.load(str(f)).items()
            if k.startswith("mtp.")
            or k in ("model.language_model.embed_tokens.weight", "lm_head.weight")
        }
    tc = json.loads((src / "config.json").read_text())["text_config"]
    args = TextModelArgs.from_dict(tc)
    layer = DecoderLayer(args, layer_idx=args.full_attention_interval - 1)  # a full-attention layer
    lw = {}
    for k, v in w.items():
        if not k.startswith("mtp.layers.0."):
            continue
        name = k.removeprefix("mtp.layers.0.")
        if name.endswith("experts.gate_up_proj"):
            i = v.shape[1] // 2
            lw["mlp.switch_mlp.gate_proj.weight"], lw["mlp.switch_mlp.up_proj.weight"] = (
                v[:, :i],
                v[:, i:],
            )
        elif name.endswith("experts.down_proj"):
            lw["mlp.switch_mlp.down_proj.weight"] = v
        elif name.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight")):
            lw[name] = 1 + v
        else:
            lw[name] = v
    layer.load_weights(list(lw.items()))  # strict: every parameter of the layer

    def rms(x, g):
        return mx.fast.rms_norm(x, 1 + g, tc["rms_norm_eps"])

    e = w["model.language_model.embed_tokens.weight"][tokens]
    x = mx.concatenate(
        [
            rms(e, w["mtp.pre_fc_norm_embedding.weight"]),
            rms(hidden, w["mtp.pre_fc_norm_hidden.weight"]),
        ],
        -1,
    )
    x = layer((x @ w["mtp.fc.weight"].T)[:, None, :])[:, 0]
    return rms(x, w["mtp.norm.weight"]) @ w["lm_head.weight"].T


def draft_logits(drafter, target, tokens, hidden):
    """One draft step per position, in mlx_vlm: the drafter's forward from (t+1, h_t), then
    lm_head."""
    rows = []
    for i, t in enumerate(tokens.tolist()):
        drafter.reset(target)
        out = drafter._forward_tokens(mx.array([[t]]), hidden[i][None, None, :], mx.int32)
        rows.append(drafter._lm_head_fn(out)[0, 0])
    return mx.stack(rows)


def agreement(got, ref) -> dict:
    cos = (got * ref).sum(-1) / (mx.linalg.norm(got, axis=-1) * mx.linalg.norm(ref, axis=-1))
    return {
        "cosine_min": round(cos.min().item(), 5),
        "cosine_mean": round(cos.mean().item(), 5),
        "max_abs_diff": round(mx.abs(got - ref).max().item(), 4),
        "ref_max_abs": round(mx.abs(ref).max().item(), 4),
        "rel_l2": round((mx.linalg.norm(got - ref) / mx.linalg.norm(ref)).item(), 5),
        "top1": round((got.argmax(-1) == ref.argmax(-1)).astype(mx.float32).mean().item(), 4),
    }


def test_the_xl_mtp_head_drafts_in_mlx_vlm_and_passes_omlx_rules(built: Project, tmp_path):
    from mlx_vlm import generate, load
    from mlx_vlm.speculative.drafters import load_drafter
    from mlx_vlm.utils import load_model

    out = built.out / "xl-mtp"
    assert omlx_problems(out) == []
    assert not any(
        k.startswith("mtp.")
        for k in json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    )

    drafter, kind = load_drafter(str(out / "mtp"), kind="mtp")
    assert kind == "mtp" and type(drafter).__name__ == "Qwen3_5MTPDraftModel"
    published = mx.load(str(out / "mtp" / "model.safetensors"))
    heads = {
        k.removeprefix(HEAD): v
        for k, v in mx.load(
            str(
                out
                / json.loads((out / "model.safetensors.index.json").read_text())["weight_map"][
                    HEAD + "fc.weight"
                ]
            )
        ).items()
        if k.startswith(HEAD)
    }
    assert set(published) == set(heads) and all(
        mx.array_equal(published[k], heads[k]).item() for k in heads
    )
    assert (out / "mtp" / "model.safetensors").stat().st_size < sum(
        f.stat().st_size for f in out.glob("model-*.safetensors")
    ) / 4

    target = load_model(out)
    target.set_dtype(mx.float32)
    drafter.set_dtype(mx.float32)
    cfg = json.loads((out / "config.json").read_text())["text_config"]
    mx.random.seed(0)
    tokens = mx.random.randint(0, cfg["vocab_size"], (POSITIONS,))
    hidden = mx.random.normal((POSITIONS, cfg["hidden_size"]))
    ref = reference_logits(fixture_dir(built), tokens, hidden)
    good = agreement(draft_logits(drafter, target, tokens, hidden), ref)

    # The same bytes with the keys marked as Hugging Face layout (mtp.*): mlx_vlm shifts them again.
    twice = shutil.copytree(out / "mtp", tmp_path / "twice")
    mx.save_safetensors(
        str(twice / "model.safetensors"),
        {f"mtp.{k}": v for k, v in published.items()},
        metadata={"format": "mlx"},
    )
    doubled, _ = load_drafter(str(twice), kind="mtp")
    assert doubled.pre_fc_norm_hidden.weight.astype(mx.float32).mean().item() > 1.5
    doubled.set_dtype(mx.float32)
    bad = agreement(draft_logits(doubled, target, tokens, hidden), ref)
    print(f"\ndraft logits vs bf16 reference: {good}\ndoubly shifted norms: {bad}")

    assert good["cosine_min"] > 0.99 and good["rel_l2"] < 0.1 and good["top1"] >= 0.9, good
    assert (
        bad["rel_l2"] > 3 * good["rel_l2"] and bad["rel_l2"] > 0.1 and bad["top1"] < good["top1"]
    ), bad

    model, processor = load(str(out))  # speculative decoding end to end with the published drafter
    drafter, _ = load_drafter(str(out / "mtp"), kind="mtp")
    res = generate(
        model,
        processor,
        "Hello",
        max_tokens=6,
        temperature=0.0,
        verbose=False,
        draft_model=drafter,
        draft_kind="mtp",
    )
    assert res.generation_tokens >= 1


# --- the cards --------------------------------------------------------------------------------


def test_cards_say_how_each_client_uses_the_model(built: Project):
    cards = {v: (built.out / v / "README.md").read_text() for v in VARIANTS}
    for v, card in cards.items():
        assert "pipeline_tag: image-text-to-text" in card, v
        assert "python -m mlx_vlm.generate --model path/to/this/model --image" in card, v
        assert (
            "from mlx_vlm import load, generate" in card
            and "from mlx_lm import load, generate" in card
        ), v
    assert "mtp_enabled: true" not in cards["xl"] and "--draft-kind" not in cards["xl"]
    for v in ("xl-mtp", "oq4e-mtp-xl"):
        card = cards[v]
        assert "set `mtp_enabled: true`" in card and "mtp_head_norm_convention" in card
        assert "below 0.5" in card
        assert "--draft-model path/to/this/model/mtp --draft-kind mtp" in card
        assert "LM Studio" in card and "ignore the head" in card


# --- publish's client check ---------------------------------------------------------------------


def test_new_head_bits_rerun_only_the_drafter_part_of_the_client_check(built: Project, tmp_path):
    p = Project(tmp_path).adopt(built)
    p.write_manifest(
        "head5",
        'extends = "xl-mtp"\n[steps.requantize.params.recipe.roles]\n'
        "routed_expert = { bits = 5, group_size = 64 }\n",
    )
    res = p.build("head5")
    assert "client check (mlx_vlm, image prompt): not run again" in res.stderr
    assert (
        "client check (mlx_vlm, MTP drafter mtp/): loaded as kind 'mtp', 7 norms as published"
        in res.stderr
    )


def test_the_client_check_fails_a_drafter_whose_norms_mlx_vlm_would_shift_again(
    built: Project, tmp_path
):
    from buildkit.clients import loadcheck
    from buildkit.core.errors import StepError

    d = shutil.copytree(built.out / "xl-mtp", tmp_path / "m")
    w = mx.load(str(d / "mtp" / "model.safetensors"))
    mx.save_safetensors(
        str(d / "mtp" / "model.safetensors"),
        {f"mtp.{k}": v for k, v in w.items()},
        metadata={"format": "mlx"},
    )
    with pytest.raises(StepError, match="changes 7 of the drafter's norms as it loads them"):
        loadcheck.check_drafter_loads(d)
    assert "7 norms as published" in loadcheck.check_drafter_loads(built.out / "xl-mtp")["summary"]


def test_the_cards_mlx_vlm_command_runs_an_image_prompt_with_the_drafter(built: Project, tmp_path):
    import subprocess
    import sys

    out = built.out / "xl-mtp"
    an_image().save(tmp_path / "photo.png")
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlx_vlm.generate",
            "--model",
            str(out),
            "--draft-model",
            str(out / "mtp"),
            "--draft-kind",
            "mtp",
            "--image",
            str(tmp_path / "photo.png"),
            "--prompt",
            "Describe this image.",
            "--max-tokens",
            "4",
            "--temperature",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    assert "Speculative decoding:" in p.stdout + p.stderr


def test_without_mlx_vlm_the_check_says_what_it_did_not_check(built: Project, monkeypatch):
    from buildkit.clients import loadcheck
    from buildkit.steps.publish import Publish
    from buildkit.store.store import Store

    monkeypatch.setattr(loadcheck, "vlm_importable", lambda: False)
    store = Store(built.store)
    cfg = json.loads((built.out / "xl-mtp" / "config.json").read_text())
    found = loadcheck.lookup(store, cfg, {}, Publish().writer)
    assert found.vlm == {} and "mlx_vlm.utils" not in found.to_run
    lines: list[str] = []
    assert loadcheck._check_vlm(store, built.out / "xl-mtp", found, lines.append) is False
    assert lines == [
        "client check: mlx_vlm is not installed: the image prompt and the MTP drafter are not "
        "checked (install mlx-vlm to check them)"
    ]
