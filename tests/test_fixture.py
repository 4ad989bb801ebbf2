import json
import shutil
import struct
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from safetensors import safe_open

from buildkit.fixtures.generated import FixtureSpec, generate
from buildkit.formats.tensors import read_header

SPEC = FixtureSpec()
MTP_KEYS = {
    "mtp.fc.weight",
    "mtp.pre_fc_norm_embedding.weight",
    "mtp.pre_fc_norm_hidden.weight",
    "mtp.norm.weight",
    *(
        f"mtp.layers.0.{k}"
        for k in (
            "input_layernorm.weight",
            "post_attention_layernorm.weight",
            "self_attn.q_proj.weight",
            "self_attn.k_proj.weight",
            "self_attn.v_proj.weight",
            "self_attn.o_proj.weight",
            "self_attn.q_norm.weight",
            "self_attn.k_norm.weight",
            "mlp.gate.weight",
            "mlp.experts.gate_up_proj",
            "mlp.experts.down_proj",
            "mlp.shared_expert.gate_proj.weight",
            "mlp.shared_expert.up_proj.weight",
            "mlp.shared_expert.down_proj.weight",
            "mlp.shared_expert_gate.weight",
        )
    ),
}


@pytest.fixture(scope="module")
def fixture_dir(tmp_path_factory) -> Path:
    return generate(tmp_path_factory.mktemp("fx") / "model")


def _headers(path: Path) -> dict[str, dict]:
    out = {}
    for shard in sorted(path.glob("*.safetensors")):
        raw = shard.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        out[shard.name] = json.loads(raw[8 : 8 + n])
    return out


def _shapes(path: Path) -> dict[str, list[int]]:
    shapes = {}
    for shard in sorted(path.glob("*.safetensors")):
        with safe_open(shard, "np") as f:
            assert f.metadata() == {"format": "pt"}
            for k in f.keys():
                assert k not in shapes
                shapes[k] = f.get_slice(k).get_shape()
    return shapes


def test_loads_and_generates_with_mlx_lm(fixture_dir):
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(fixture_dir))  # sanitize + strict load of the HF layout
    model.set_dtype(mx.float32)  # mlx CPU gather_mm (MoE) only supports float32
    text = mlx_lm.generate(model, tokenizer, prompt="hello", max_tokens=5)
    assert isinstance(text, str)
    ids = tokenizer.encode("The quick brown fox jumps")
    logits = model(mx.array([ids]))
    assert logits.shape == (1, len(ids), SPEC.vocab)
    assert mx.isfinite(logits).all().item()
    assert logits.std().item() > 0.1  # varied, not collapsed
    # mlx_lm's sanitize shifts offset norms by 1 and leaves linear_attn.norm alone
    norm = np.array(model.language_model.model.norm.weight)
    assert abs(norm.mean() - 1.0) < 0.05 and norm.std() > 0.01
    gated = np.array(model.language_model.model.layers[0].linear_attn.norm.weight)
    assert abs(gated.mean() - 1.0) < 0.05


def test_config_and_tokenizer_load_with_transformers(fixture_dir):
    from tokenizers import Tokenizer
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(fixture_dir)
    assert type(config).__name__ == "Qwen3_5MoeConfig"
    assert config.text_config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    raw = json.loads((fixture_dir / "config.json").read_text())
    text = raw["text_config"]
    assert text["mtp_num_hidden_layers"] == 1 and text["tie_word_embeddings"] is False
    assert sum(text["rope_parameters"]["mrope_section"]) == SPEC.head_dim // 8
    tok = AutoTokenizer.from_pretrained(fixture_dir)
    s = "Hello, world!\n  The 2048 experts don't sleep. café"
    assert (
        tok(s).input_ids == Tokenizer.from_file(str(fixture_dir / "tokenizer.json")).encode(s).ids
    )
    assert tok.decode(tok(s).input_ids) == s
    assert len(tok) <= SPEC.vocab
    assert tok.eos_token == "<|im_end|>"
    assert raw["image_token_id"] == tok.convert_tokens_to_ids("<|image_pad|>")
    assert text["eos_token_id"] == tok.convert_tokens_to_ids("<|endoftext|>")


def test_key_set_index_and_shapes(fixture_dir):
    index = json.loads((fixture_dir / "model.safetensors.index.json").read_text())
    headers, shapes = _headers(fixture_dir), _shapes(fixture_dir)
    weight_map = index["weight_map"]
    assert list(weight_map) == sorted(weight_map)
    assert set(weight_map) == set(shapes)
    for shard, header in headers.items():
        names = [k for k in header if k != "__metadata__"]
        assert names == sorted(names) and {weight_map[k] for k in names} == {shard}
    assert index["metadata"]["total_size"] == sum(2 * int(np.prod(s)) for s in shapes.values())
    last = f"model-{SPEC.shards:05d}-of-{SPEC.shards:05d}.safetensors"
    assert len(headers) == SPEC.shards and last in headers
    mtp = {k for k in weight_map if k.startswith("mtp.")}
    assert mtp == MTP_KEYS and len(mtp) == 19
    assert all(weight_map[k] == last for k in mtp)

    H, E, MI = SPEC.hidden, SPEC.experts, SPEC.moe_intermediate
    conv = (
        2 * SPEC.linear_key_heads * SPEC.linear_key_dim
        + SPEC.linear_value_heads * SPEC.linear_value_dim
    )
    lm = "model.language_model."
    assert shapes[lm + "layers.0.linear_attn.conv1d.weight"] == [conv, 1, SPEC.conv_kernel]
    assert shapes[lm + "layers.0.mlp.experts.gate_up_proj"] == [E, 2 * MI, H]
    assert shapes[lm + "layers.0.mlp.experts.down_proj"] == [E, H, MI]
    assert shapes[lm + "layers.3.self_attn.q_proj.weight"] == [2 * SPEC.heads * SPEC.head_dim, H]
    assert shapes[lm + "layers.1.mlp.shared_expert_gate.weight"] == [1, H]
    assert shapes["mtp.fc.weight"] == [H, 2 * H]
    assert shapes["lm_head.weight"] == [SPEC.vocab, H]
    assert not any(k.startswith(lm + "layers.3.linear_attn") for k in shapes)
    assert not any(k.startswith(lm + "layers.0.self_attn") for k in shapes)
    vis = {k for k in shapes if k.startswith("model.visual.")}
    assert shapes["model.visual.patch_embed.proj.weight"] == [SPEC.vision_hidden, 3, 2, 16, 16]
    assert shapes["model.visual.merger.linear_fc1.weight"] == [4 * SPEC.vision_hidden] * 2
    assert len(vis) == 3 + 12 * SPEC.vision_depth + 6
    assert (
        len(shapes) == 3 + 3 * 18 + 15 + len(vis) + 19
    )  # embed/norm/lm_head, 3 linear, 1 full, mtp


def test_files_match_safetensors_serializer(fixture_dir):
    safetensors = pytest.importorskip("safetensors")
    spec_cls = getattr(safetensors, "TensorSpec", None)
    if spec_cls is None:
        pytest.skip("safetensors.TensorSpec not available")
    for shard in sorted(fixture_dir.glob("*.safetensors")):
        raw = shard.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + n])
        arrays = {
            k: np.frombuffer(
                raw,
                "<u2",
                (v["data_offsets"][1] - v["data_offsets"][0]) // 2,
                8 + n + v["data_offsets"][0],
            )
            for k, v in header.items()
            if k != "__metadata__"
        }
        specs = {
            k: spec_cls(
                dtype="bfloat16",
                shape=header[k]["shape"],
                data_ptr=a.ctypes.data,
                data_len=a.nbytes,
            )
            for k, a in arrays.items()
        }
        assert safetensors.serialize(specs, metadata={"format": "pt"}) == raw


def test_values(fixture_dir):
    w = {}
    for shard in fixture_dir.glob("*.safetensors"):
        w.update({k: np.array(v.astype(mx.float32)) for k, v in mx.load(str(shard)).items()})
    lm = "model.language_model."
    for k in (
        lm + "norm.weight",
        lm + "layers.3.self_attn.q_norm.weight",
        "mtp.pre_fc_norm_hidden.weight",
    ):
        assert np.abs(w[k]).max() < 0.5  # offsets, not 1-centred
    assert abs(w[lm + "layers.0.linear_attn.norm.weight"].mean() - 1) < 0.1  # not an offset
    a_log = w[lm + "layers.0.linear_attn.A_log"]
    assert np.all((a_log >= 0) & (a_log <= np.log(16) + 0.02))
    gate_up = w[lm + "layers.0.mlp.experts.gate_up_proj"]
    assert abs(gate_up.std() * np.sqrt(SPEC.hidden) - 1) < 0.05 and abs(gate_up.mean()) < 0.01
    assert all(np.isfinite(v).all() for v in w.values())


def test_byte_identical_and_seed_sensitive(tmp_path):
    a, b = generate(tmp_path / "a"), generate(tmp_path / "b")
    c = generate(tmp_path / "c", FixtureSpec(seed=1))
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir()) == sorted(p.name for p in c.iterdir())
    for name in files:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    for name in files:
        if name.endswith(".safetensors"):
            assert (a / name).read_bytes() != (c / name).read_bytes(), name


def test_default_is_fast(tmp_path):
    start = time.perf_counter()
    generate(tmp_path / "m")
    assert time.perf_counter() - start < 2.0


def test_single_shard_and_progress(tmp_path):
    lines = []
    out = generate(
        tmp_path / "one", FixtureSpec(shards=1, layers=8, experts=4), progress=lines.append
    )
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {"model-00001-of-00001.safetensors"}
    assert len(lines) == len(index["weight_map"]) + 1


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"hidden": 100}, "hidden"),
        ({"moe_intermediate": 96}, "moe_intermediate"),
        ({"linear_value_heads": 3}, "linear_value_heads"),
        ({"vision_hidden": 100}, "vision_hidden"),
        ({"head_dim": 36, "heads": 16}, "head_dim"),
        ({"full_attention_interval": 1}, "full_attention_interval"),
        ({"layers": 0}, "layers"),
        ({"vision_positions": 50}, "vision_positions"),
        ({"shards": 500}, "shards"),
    ],
)
def test_bad_spec_names_field(tmp_path, kwargs, field):
    with pytest.raises(ValueError, match=field):
        generate(tmp_path / "bad", FixtureSpec(**kwargs))
    assert not (tmp_path / "bad").exists()


def test_spec_is_frozen_and_strict():
    with pytest.raises(ValueError, match="hiden"):
        FixtureSpec(hiden=128)
    with pytest.raises(ValueError):
        SPEC.hidden = 256


def test_refuses_non_empty_out_dir(tmp_path):
    out = tmp_path / "m"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match="remove it"):
        generate(out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    generate(tmp_path / "empty_ok")  # an empty existing directory is fine
    (tmp_path / "e").mkdir()
    assert (generate(tmp_path / "e") / "config.json").exists()


def test_crash_leaves_nothing(tmp_path):
    def boom(line):
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError):
        generate(tmp_path / "m", progress=boom)
    assert list(tmp_path.iterdir()) == []


def test_sparse_35b_preset_from_the_command_line(tmp_path, capsys):
    """The real model's names and shapes, large tensors a first 4 KiB of values and a hole."""
    from buildkit.cli.main import main
    from buildkit.fixtures.generated import PRESETS, SPARSE_HEAD_BYTES

    out = tmp_path / "35b"
    assert main(["fixture", str(out), "--preset", "qwen3.6-35b-a3b", "--sparse"]) == 0
    try:
        files = list(out.iterdir())
        apparent = sum(f.stat().st_size for f in files)
        on_disk = sum(f.stat().st_blocks * 512 for f in files)
        assert apparent > 71.5e9 and on_disk < 100e6
        tc = json.loads((out / "config.json").read_text())["text_config"]
        assert (
            tc["hidden_size"],
            tc["num_hidden_layers"],
            tc["num_experts"],
            tc["vocab_size"],
        ) == (2048, 40, 256, 248320)
        assert (
            json.loads((out / "config.json").read_text())["vision_config"]["intermediate_size"]
            == 4304
        )
        shards = sorted(out.glob("*.safetensors"))
        assert len(shards) == PRESETS["qwen3.6-35b-a3b"]["shards"] == 26
        mtp = [
            k
            for k, v in json.loads((out / "model.safetensors.index.json").read_text())[
                "weight_map"
            ].items()
            if k.startswith("mtp.")
        ]
        assert len(mtp) == 19
        h = read_header(shards[0])
        big = next(i for i in h.tensors.values() if i.nbytes > 1 << 20)
        with open(shards[0], "rb") as f:
            f.seek(big.start)
            head = f.read(SPARSE_HEAD_BYTES + 4096)
        assert any(head[:SPARSE_HEAD_BYTES]) and not any(head[SPARSE_HEAD_BYTES:])
    finally:
        shutil.rmtree(out)


def test_sparse_changes_nothing_for_small_tensors(tmp_path):
    a, b = generate(tmp_path / "a"), generate(tmp_path / "b", sparse=True)
    for f in a.iterdir():
        assert f.read_bytes() == (b / f.name).read_bytes(), f.name
