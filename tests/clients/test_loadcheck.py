"""publish's load check is remembered by what mlx_lm reads: run again only when that changes."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
from conftest import Project, ran

from buildkit.clients import loadcheck
from buildkit.core.errors import StepError
from buildkit.steps.publish import Publish
from buildkit.store.store import Store

RAN = "load check: mlx_lm loaded the model and ran a token"
SKIPPED = "load check: not run again"
HEAD5 = (
    'extends = "xl-mtp"\n[steps.requantize.params.recipe.roles]\n'
    "routed_expert = { bits = 5, group_size = 64 }\n"
)
ATTN4 = 'extends = "xl-mtp"\n[recipe.roles]\nattention = { bits = 4, group_size = 64 }\n'


@pytest.fixture
def adopted(project: Project, seed: Project) -> Project:
    return project.adopt(seed)


def published(p: Project, variant: str) -> tuple[dict, dict[str, dict]]:
    """config.json and name -> store entry of a variant's published model, from the store."""
    store = Store(p.store)
    nodes = store.get_ref(variant)["nodes"]
    tensors: dict[str, dict] = {}
    for node in ("quantize", "requantize"):
        if node in nodes:
            tensors.update(store.get_artifact(nodes[node]["outputs"]["out"]).tensors)
    return json.loads((p.out / variant / "config.json").read_text()), tensors


def test_new_mtp_bits_reuse_the_check_and_new_trunk_bits_run_it(adopted: Project):
    p = adopted
    p.write_manifest("head5", HEAD5)
    head5 = p.build("head5")
    assert "publish" in ran(head5)
    assert SKIPPED in head5.stderr and RAN not in head5.stderr
    assert "the 140 of 223 tensors mlx_lm reads" in head5.stderr

    p.write_manifest("attn4", ATTN4)
    attn4 = p.build("attn4")
    assert RAN in attn4.stderr and SKIPPED not in attn4.stderr

    from mlx_lm import generate, load  # the model whose check was reused loads and generates

    model, tok = load(str(p.out / "head5"))
    assert len(generate(model, tok, prompt="hello", max_tokens=4)) > 0
    cfg = json.loads((p.out / "head5" / "config.json").read_text())
    assert cfg["quantization"]["language_model.mtp.layers.0.mlp.switch_mlp.gate_proj"]["bits"] == 5


def test_the_key_covers_what_mlx_lm_reads_and_nothing_else(adopted: Project):
    p = adopted
    store = Store(p.store)
    config, tensors = published(p, "xl-mtp")
    writer = Publish().writer
    key, n_read = loadcheck.memo_key(store, config, tensors, writer)
    assert (
        store.get_memo("loadcheck", key) is not None
    )  # the key publish recorded for this very model
    assert n_read == 140 and len(tensors) == 223

    def changed(config=config, tensors=tensors, writer=writer) -> bool:
        return loadcheck.memo_key(store, config, tensors, writer)[0] != key

    mtp_w = "language_model.mtp.layers.0.mlp.switch_mlp.up_proj.weight"
    vision_w = next(k for k in tensors if k.startswith("vision_tower."))
    trunk_w = "language_model.model.layers.0.mlp.switch_mlp.up_proj.weight"
    for name, read in ((mtp_w, False), (vision_w, False), (trunk_w, True)):
        t = copy.deepcopy(tensors)
        t[name] = tensors["language_model.model.norm.weight"]  # another tensor's bytes
        assert changed(tensors=t) is read, name
        t = dict(tensors)
        del t[name]
        assert changed(tensors=t) is read, name

    c = copy.deepcopy(config)
    c["quantization"]["language_model.mtp.layers.0.mlp.switch_mlp.up_proj"] = {
        "bits": 3,
        "group_size": 32,
    }
    assert not changed(config=c)
    c = copy.deepcopy(config)
    c["quantization"]["language_model.model.layers.0.mlp.switch_mlp.up_proj"] = {
        "bits": 3,
        "group_size": 32,
    }
    assert changed(config=c)
    c = copy.deepcopy(config)
    c["quantization"]["bits"] = 3  # the default every unlisted module is read with
    assert changed(config=c)
    c = copy.deepcopy(config)
    c["text_config"]["rms_norm_eps"] = 1e-5
    assert changed(config=c)
    assert changed(writer={"publish": writer["publish"] + 1})


def test_a_store_that_has_not_seen_the_architecture_checks_everything(tmp_path, adopted: Project):
    """Without mlx_lm's module list for this config, every tensor and the whole config count."""
    config, tensors = published(adopted, "xl-mtp")
    fresh = Store(tmp_path / "fresh")
    key, n_read = loadcheck.memo_key(fresh, config, tensors, Publish().writer)
    assert n_read == len(tensors) == 223
    t = dict(tensors)
    t["language_model.mtp.fc.weight"] = tensors["language_model.model.norm.weight"]
    assert loadcheck.memo_key(fresh, config, t, Publish().writer)[0] != key


def test_the_check_runs_the_published_model_and_fails_when_it_cannot(tmp_path, seed: Project):
    """check_loads on real files: the published model passes (in float32 on the CPU, where mlx
    emulates bfloat16); the same files with a missing tensor, or with a norm that makes the
    logits infinite, fail with mlx_lm's reason."""
    import mlx.core as mx

    good = shutil.copytree(seed.out / "xl", tmp_path / "good")
    res = loadcheck.check_loads(good)
    vocab = json.loads((good / "config.json").read_text())["text_config"]["vocab_size"]
    assert res["logits_shape"] == [1, 1, vocab]
    assert res["dtype"] == ("float32" if mx.default_device() == mx.cpu else "bfloat16")
    assert "language_model.model.norm.weight" in res["parameters"]

    def edited(name: str, change) -> object:
        d = shutil.copytree(seed.out / "xl", tmp_path / f"edit-{len(list(tmp_path.iterdir()))}")
        shard = d / json.loads((d / "model.safetensors.index.json").read_text())["weight_map"][name]
        weights = mx.load(str(shard))
        change(weights)
        mx.save_safetensors(str(shard), weights, metadata={"format": "mlx"})
        return d

    norm = "language_model.model.norm.weight"
    inf = edited(
        norm, lambda w: w.update({norm: mx.full(w[norm].shape, float("inf"), w[norm].dtype)})
    )
    with pytest.raises(StepError, match="logits are not finite"):
        loadcheck.check_loads(inf)

    first = "language_model.model.layers.0.input_layernorm.weight"
    missing = edited(first, lambda w: w.pop(first))
    with pytest.raises(
        StepError,
        match=f"(?s)mlx_lm cannot load the published model: .*Missing 1 parameters.*{first}",
    ):
        loadcheck.check_loads(missing)


def test_the_streamed_pass_computes_what_the_clients_compute(seed: Project):
    """The check holds one module's weights at a time and runs the embedding and lm_head from
    the file in blocks of rows; with a 64 KiB block every module of the seed model above it is
    streamed and lm_head runs in many blocks, yet the logits are those of mlx_lm and mlx_vlm
    running the whole model in memory, bit for bit, and the drafter still drafts."""
    import mlx.core as mx
    from mlx_lm.utils import load_model

    path, block = seed.out / "xl", 64 << 10
    model, _ = load_model(path)  # the whole model in memory, run as mlx_lm runs it
    if mx.default_device() == mx.cpu:
        model.set_dtype(mx.float32)
    whole = model(mx.array([[1]]))
    streamed = loadcheck.check_loads(path, block=block)["logits"]
    assert streamed.shape == whole.shape and bool(mx.array_equal(streamed, whole).item())

    from mlx_vlm.prompt_utils import apply_chat_template
    from mlx_vlm.utils import load, prepare_inputs

    model, processor = load(str(path))  # the image prompt check_vlm_loads runs, run whole
    if mx.default_device() == mx.cpu:
        model.set_dtype(mx.float32)
    prompt = apply_chat_template(processor, model.config, "Describe the image.", num_images=1)
    inputs = prepare_inputs(
        processor,
        images=[loadcheck._test_image()],
        prompts=prompt,
        image_token_index=model.config.image_token_id,
    )
    inputs = loadcheck._image_span(inputs, model.config.image_token_id)  # what the check runs
    whole = model(
        inputs["input_ids"],
        inputs["pixel_values"],
        mask=inputs["attention_mask"],
        image_grid_thw=inputs["image_grid_thw"],
    ).logits
    streamed = loadcheck.check_vlm_loads(path, block=block)["logits"]
    assert streamed.shape == whole.shape and bool(mx.array_equal(streamed, whole).item())

    from mlx_vlm.speculative.drafters import load_drafter
    from mlx_vlm.utils import load_model as vlm_load_model

    drafter, _ = load_drafter(str(seed.out / "xl-mtp" / "mtp"), kind="mtp")  # whole, as a user
    drafter.reset(vlm_load_model(seed.out / "xl-mtp"))
    hidden = mx.ones((1, 1, drafter.fc.weight.shape[0]), dtype=mx.float32)
    whole = drafter._lm_head_fn(drafter._forward_tokens(mx.array([[1]]), hidden, mx.int32))
    drafted = loadcheck.check_drafter_loads(seed.out / "xl-mtp", block=block)
    assert "drafted a token" in drafted["summary"]
    assert bool(mx.array_equal(drafted["logits"], whole).item())


def _bytes_read() -> int:
    """Bytes this process has read through read()/pread() so far (Linux /proc/self/io)."""
    io = dict(ln.split(": ") for ln in open("/proc/self/io").read().splitlines())
    return int(io["rchar"])


def test_the_check_reads_only_the_experts_its_token_is_routed_to(seed: Project):
    """mlx_lm's one token goes to 2 of the seed model's 8 experts in each layer: of each stacked
    expert projection the check reads those experts' rows and not the other 6 (the real model:
    8 of 256, ~80% of its bytes left unread). Measured as the bytes this process reads, after a
    first check has paid for the imports."""
    path = seed.out / "xl"
    config = json.loads((path / "config.json").read_text())
    text = config.get("text_config", config)
    unused = 1 - text["num_experts_per_tok"] / text["num_experts"]
    infos = {n: i for n, (_, i) in loadcheck._published(path).items()}
    lm = sum(i.nbytes for n, i in infos.items() if not n.startswith("vision_tower."))
    experts = sum(i.nbytes for n, i in infos.items() if ".switch_mlp." in n)
    loadcheck.check_loads(path)
    before = _bytes_read()
    loadcheck.check_loads(path)
    read = _bytes_read() - before
    # mlx_lm's tensors (it drops the vision tower) but the unrouted experts, and the files'
    # headers and config.json (tens of KB)
    bound = lm - experts * unused + (64 << 10)
    assert experts * unused > 64 << 10  # else the bound could not tell the two apart
    assert read <= bound, f"read {read:,} bytes, more than {bound:,}"
