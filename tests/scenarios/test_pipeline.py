"""End to end: xl and xl-mtp built from a generated checkpoint, opened with safetensors and
mlx_lm."""

from __future__ import annotations

import json
import os
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import HEAD_NORMS, Project, cached, ran, shard_parts
from safetensors import safe_open

from buildkit.fixtures.generated import FixtureSpec, generate
from buildkit.formats.tensors import bf16_to_f32, f32_to_bf16, read_header, read_tensor
from buildkit.store.store import Store


def tensors_of(out: Path) -> dict[str, np.ndarray]:
    """Every tensor of a published directory, as raw storage arrays (bf16 as uint16)."""
    idx = json.loads((out / "model.safetensors.index.json").read_text())
    res = {}
    for shard in sorted(set(idx["weight_map"].values())):
        h = read_header(out / shard)
        for name, info in h.tensors.items():
            res[name] = read_tensor(info, out / shard)
    return res


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """xl then xl-mtp in one store (the order a user would take)."""
    p = Project(tmp_path_factory.mktemp("pipeline"))
    xl = p.build("xl")
    mtp = p.build("xl-mtp")
    return p, xl, mtp


def test_xl_mtp_after_xl_reruns_only_the_head_and_publish(built):
    p, xl, mtp = built
    shared = ["eval", "fetch", "quantize", "reference", "sanitize", "verify"]
    assert sorted(ran(xl)) == sorted([*shared, "publish"])
    assert sorted(ran(mtp)) == ["eval_head", "graft", "publish", "requantize", "verify_head"]
    assert sorted(cached(mtp)) == shared


def test_xl_mtp_after_xl_does_not_repeat_xls_load_check(built):
    """mlx_lm drops the MTP head, so it would read xl-mtp exactly as it read xl."""
    p, xl, mtp = built
    assert "load check: mlx_lm loaded the model and ran a token" in xl.stderr
    assert "load check: not run again" in mtp.stderr


def test_both_load_and_generate_with_mlx_lm(built):
    from mlx_lm import generate, load

    p, *_ = built
    for variant in ("xl", "xl-mtp"):
        model, tok = load(str(p.out / variant))
        text = generate(model, tok, prompt="the quick brown fox", max_tokens=6)
        assert isinstance(text, str) and len(tok.encode(text)) > 0
        logits = model(mx.array([tok.encode("hello world")]))
        assert bool(mx.isfinite(logits).all())


def test_mlx_lm_reads_the_role_allocation(built):
    from mlx_lm import load

    p, *_ = built
    model, _ = load(str(p.out / "xl"))
    layer = model.language_model.model.layers[0]
    # BaseQuant_XL: router, shared-expert gate, shared expert and lm_head stay bf16
    for module in (
        layer.mlp.gate,
        layer.mlp.shared_expert_gate,
        layer.mlp.shared_expert.up_proj,
        model.language_model.lm_head,
    ):
        assert type(module) is nn.Linear and module.weight.dtype == mx.bfloat16
    assert (layer.mlp.switch_mlp.gate_proj.bits, layer.mlp.switch_mlp.gate_proj.group_size) == (
        6,
        64,
    )
    assert layer.linear_attn.in_proj_qkv.bits == 8
    assert model.language_model.model.layers[3].self_attn.q_proj.bits == 8
    assert model.language_model.model.embed_tokens.bits == 8
    cfg = json.loads((p.out / "xl" / "config.json").read_text())
    assert cfg["quantization"] == cfg["quantization_config"]
    assert cfg["quantization"]["bits"] == 6 and cfg["quantization"]["group_size"] == 64


def test_mtp_keys_only_in_xl_mtp_and_trunk_is_byte_identical(built):
    p, *_ = built
    xl, mtp = tensors_of(p.out / "xl"), tensors_of(p.out / "xl-mtp")
    head = sorted(k for k in mtp if k.startswith("language_model.mtp."))
    assert not any(k.startswith("language_model.mtp.") for k in xl)
    # 19 source tensors -> 20 after the split: 13 bf16 (fc, norms, router, shared expert and its
    # gate) + 7 quantized x (weight, scales, biases): q/k/v/o 8-bit, the routed experts 6-bit
    assert len(head) == 13 + 7 * 3
    assert set(mtp) - set(head) == set(xl)
    for k, v in xl.items():
        assert mtp[k].dtype == v.dtype and mtp[k].tobytes() == v.tobytes(), k
    idx = json.loads((p.out / "xl-mtp" / "model.safetensors.index.json").read_text())
    assert set(head) <= set(idx["weight_map"])
    cfg = json.loads((p.out / "xl-mtp" / "config.json").read_text())
    assert cfg["text_config"]["mtp_num_hidden_layers"] == 1
    q = cfg["quantization"]
    assert q["language_model.mtp.layers.0.self_attn.q_proj"]["bits"] == 8
    assert (
        "language_model.mtp.layers.0.mlp.gate" not in q
        and "language_model.mtp.layers.0.mlp.shared_expert.up_proj" not in q
    )
    assert (
        "language_model.mtp.fc" not in q and mtp["language_model.mtp.fc.weight"].dtype == np.uint16
    )


def test_mtp_head_norms_shifted_once_and_experts_split_gate_first(built):
    p, *_ = built
    out = tensors_of(p.out / "xl-mtp")
    src_dir = next((p.store / "fixtures").iterdir())
    src = {}
    for f in sorted(src_dir.glob("*.safetensors")):
        h = read_header(f)
        src.update({k: read_tensor(i, f) for k, i in h.tensors.items() if k.startswith("mtp.")})
    for n in HEAD_NORMS:
        want = f32_to_bf16(bf16_to_f32(src[f"mtp.{n}.weight"]) + np.float32(1.0))
        assert out[f"language_model.mtp.{n}.weight"].tobytes() == want.tobytes(), n
    # mtp.fc is bf16 and untouched, columns in source order (embedding half first)
    assert out["language_model.mtp.fc.weight"].tobytes() == src["mtp.fc.weight"].tobytes()
    fused = bf16_to_f32(src["mtp.layers.0.mlp.experts.gate_up_proj"])
    i = fused.shape[1] // 2
    base = "language_model.mtp.layers.0.mlp.switch_mlp"

    def deq(name):
        w, s, b = (mx.array(out[f"{base}.{name}.{k}"]) for k in ("weight", "scales", "biases"))
        s, b = s.view(mx.bfloat16), b.view(mx.bfloat16)
        return np.array(mx.dequantize(w, s, b, group_size=64, bits=6).astype(mx.float32))

    gate, up = deq("gate_proj"), deq("up_proj")
    err = lambda a, b: np.abs(a - b).sum() / np.abs(b).sum()  # noqa: E731
    assert err(gate, fused[:, :i]) < 0.05 and err(up, fused[:, i:]) < 0.05
    assert err(gate, fused[:, i:]) > 0.5


def test_sanitize_matches_mlx_lm_sanitize(built):
    """Our sanitized trunk is exactly what mlx_lm's qwen3_5_moe sanitize makes of the source."""
    from mlx_lm.utils import _get_classes, load_config

    from buildkit.store.store import Store

    p, *_ = built
    src_dir = next((p.store / "fixtures").iterdir())
    config = load_config(src_dir)
    model_cls, args_cls = _get_classes(config)
    model = model_cls(args_cls.from_dict(config))
    weights = {}
    for f in sorted(src_dir.glob("*.safetensors")):
        weights.update(mx.load(str(f)))
    want = model.sanitize(weights)
    store = Store(p.store)
    ref = store.get_ref("xl")["nodes"]["sanitize"]["outputs"]["model"]
    art = store.get_artifact(ref)
    trunk = {k: v for k, v in art.tensors.items() if k.startswith("language_model.")}
    assert set(trunk) == set(want)
    for k, v in want.items():
        got = store.read_tensor(trunk[k])
        mine = mx.array(got).view(mx.bfloat16) if trunk[k]["dtype"] == "BF16" else mx.array(got)
        assert tuple(mine.shape) == tuple(v.shape), k
        assert bool(mx.array_equal(mine, v)), k
    assert any(k.startswith("vision_tower.") for k in art.tensors)


def test_verify_report_and_model_card(built):
    p, *_ = built
    report = json.loads((p.out / "xl-mtp" / "verify.json").read_text())
    checks = report["checks"]
    assert report["ok"] and all(c["ok"] for c in checks.values())
    head = " (language_model.mtp.*)"
    assert checks["key_set"]["figure"]["mtp_keys"] == 0  # the trunk's own check
    assert checks["key_set" + head]["figure"] == {"expected": 34, "actual": 34, "mtp_keys": 34}
    assert checks["base_identical" + head]["figure"] == {"tensors": 189, "differ": 0}
    assert checks["experts_split_order"]["figure"]["checked"] == 4  # every trunk layer
    assert checks["experts_split_order" + head]["figure"]["checked"] == 1
    assert checks["dequant_rel_l1"]["figure"]["6-bit"]["max"] < 0.045
    # 6-bit: the routed experts (4 layers x gate/up/down) and the vision linears (2 blocks x
    # qkv/proj/linear_fc1, the merger's two), each dequantized against its source
    assert checks["dequant_rel_l1"]["figure"]["6-bit"]["tensors"] == 12 + 2 * 3 + 2
    card = (p.out / "xl-mtp" / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: mlx\n")  # a test checkpoint has no base model
    assert "trained test checkpoint" in card and "not a real model" in card
    assert "| trunk | routed_expert | 6 | 64 |" in card and "mtp" in card
    assert "bits per weight" in card and "base_identical" in card
    # built from the trained checkpoint, a newcomer's first card shows real figures: the
    # native head drafts well above chance (a random head: well under 1%)
    evals = json.loads((p.out / "xl-mtp" / "eval.json").read_text())
    assert evals["acceptance"] > 0.40 and f"{evals['acceptance']:.2%}" in card


def test_shards_have_mlx_metadata_and_index_parity(built):
    p, *_ = built
    out = p.out / "xl-mtp"
    idx = json.loads((out / "model.safetensors.index.json").read_text())
    total = 0
    seen = {}
    for shard in sorted(set(idx["weight_map"].values())):
        with safe_open(out / shard, framework="numpy") as f:
            assert f.metadata() == {"format": "mlx"}
        for k, info in read_header(out / shard).tensors.items():
            seen[k] = shard
            total += info.nbytes
    assert seen == idx["weight_map"] and total == idx["metadata"]["total_size"]
    assert list(idx["weight_map"]) == sorted(idx["weight_map"])


def test_published_bytes_identical_across_clean_builds(tmp_path, built):
    """Two jobs or one: the same bytes."""
    p, xl, mtp = built
    q = Project(tmp_path)
    q.build("xl-mtp", "--jobs", "1")
    a, b = p.out / "xl-mtp", q.out / "xl-mtp"
    names = sorted(
        str(x.relative_to(a)) for x in a.rglob("*") if x.is_file()
    )  # with the drafter in mtp/
    assert names == sorted(str(x.relative_to(b)) for x in b.rglob("*") if x.is_file())
    for n in names:
        assert (a / n).read_bytes() == (b / n).read_bytes(), n


def test_xl_mtp_links_xls_shards_and_writes_only_the_heads(built):
    """Each part of the model has shards of its own, and quantize wrote them as packs in the
    store: both variants' shards are the packs, hard-linked; only the drafter's copy of the
    head (mtp/, under other names) is written."""
    p, xl, mtp = built
    a, b = shard_parts(p.out / "xl"), shard_parts(p.out / "xl-mtp")
    assert sorted(a) == ["language_model", "vision_tower"] and sorted(b) == [
        "language_model",
        "mtp",
        "vision_tower",
    ]
    for part in a:
        assert os.path.samefile(a[part], b[part]), part
    assert b["mtp"].stat().st_nlink == 2  # the requantized head's pack, and this link
    assert "(3 of 4 shards hard-linked, not written)" in mtp.stderr  # 4th: the drafter's, mtp/
    assert "(2 of 2 shards hard-linked, not written)" in xl.stderr
    objects = {x.stat().st_ino for x in (p.store / "objects").glob("*/*")}
    assert all(x.stat().st_ino in objects for x in [*a.values(), *b.values()])  # the packs
    # Linking changed the inodes' ctime; the store moved xl's records along, so both paths are
    # still known without reading them.
    store = Store(p.store)
    assert [store.sources.digest_file(a[k]) for k in sorted(a)] == [
        store.sources.digest_file(b[k]) for k in sorted(a)
    ]
    assert store.stats.bytes_read == 0


def test_second_build_runs_nothing_and_deleted_output_is_republished(built):
    p, *_ = built
    again = p.build("xl-mtp")
    assert ran(again) == []
    (p.out / "xl-mtp" / "config.json").unlink()
    redo = p.build("xl-mtp")
    assert ran(redo) == ["publish"]
    assert "missing" in redo.stderr


def test_local_directory_source_and_sharding(tmp_path):
    """A local HF directory as --source; a small shard limit splits the output."""
    p = Project(tmp_path / "proj")
    src = generate(tmp_path / "src", FixtureSpec(seed=3, shards=3))
    p.write_manifest(
        "xl-small-shards", 'extends = "xl"\n[steps.publish.params]\nmax_shard_bytes = 1048576\n'
    )
    p.build("xl-small-shards", "--source", str(src))
    out = p.out / "xl-small-shards"
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) >= 2 and shards[0].name == f"model-00001-of-{len(shards):05d}.safetensors"
    from mlx_lm import load

    load(str(out))


def test_dry_run_plans_and_runs_nothing(built, tmp_path):
    """build --dry-run is make -n: the plan, no step run, nothing written (with or without
    --push)."""
    p, *_ = built
    out = tmp_path / "elsewhere"
    r = p.run("build", "xl", "--out", str(out), "--push", "me/xl-test", "--dry-run")
    assert "stale publish (publish)" in r.stdout and "1 to run" in r.stdout
    assert "then: upload the published directory to me/xl-test" in r.stdout
    assert not out.exists() and "[run]" not in r.stderr
    r = p.run("build", "xl", "--out", str(out), "--dry-run", "--json")
    assert json.loads(r.stdout)["to_run"] == 1 and not out.exists()


def test_hf_source_from_offline_cache(tmp_path, monkeypatch):
    """hf://org/repo@sha resolves through huggingface_hub's cache with HF_HUB_OFFLINE=1."""
    sha = "0123456789abcdef0123456789abcdef01234567"
    cache = tmp_path / "hf"
    snap = cache / "models--Qwen--Tiny" / "snapshots" / sha
    generate(snap, FixtureSpec(seed=5))
    (cache / "models--Qwen--Tiny" / "refs").mkdir(parents=True)
    (cache / "models--Qwen--Tiny" / "refs" / "main").write_text(sha)
    p = Project(tmp_path / "proj")
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)}

    full_env = {**os.environ, **env}
    r = p.run(
        "build", "xl", "--source", f"hf://Qwen/Tiny@{sha}", "--out", str(p.out / "xl"), env=full_env
    )
    assert "publish" in ran(r)
    bad = p.run(
        "build", "xl", "--release", "--source", "hf://Qwen/Tiny@main", check=False, env=full_env
    )
    assert bad.returncode == 2 and "pinned revision" in bad.stderr
    # Outside --release an unpinned revision builds, and says the build is not reproducible.
    moving = p.run("plan", "xl", "--source", "hf://Qwen/Tiny@main", env=full_env)
    assert "is not pinned to a commit: this build is not reproducible" in moving.stderr
    # A revision the offline cache lacks: the error does not advise setting what is set.
    gone = p.run("plan", "xl", "--source", "hf://Qwen/Absent@main", check=False, env=full_env)
    assert gone.returncode == 1 and "HF_HUB_OFFLINE is set" in gone.stderr
    assert "Set HF_HUB_OFFLINE=1" not in gone.stderr
