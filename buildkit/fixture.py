"""Deterministic small qwen3_5_moe checkpoints in the Hugging Face layout of
Qwen/Qwen3.6-35B-A3B."""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import struct
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import NamedTuple

from pydantic import BaseModel, ConfigDict, model_validator

from .fsio import settle
from .lazy import lazy

np = lazy("numpy", __name__)
tk = lazy(
    "tokenizers", __name__, "tk"
)  # only for writing a tokenizer; the CLI parser reads FixtureSpec

# Constants of the real checkpoint that the fixture keeps as they are.
PATCH_SIZE, TEMPORAL_PATCH_SIZE, IN_CHANNELS, SPATIAL_MERGE = 16, 2, 3, 2
PARTIAL_ROTARY = 0.25
ROPE_THETA = 10_000_000
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
# Qwen3.5's pre-tokenizer split (transformers' Qwen3_5Tokenizer rebuilds it, so tokenizer.json
# must match).
_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CHUNK = 1 << 20  # elements generated and written per step
_NORM_STD = 0.05  # offset norms: runtime weight is 1 + w


class FixtureSpec(BaseModel):
    """Shape and seed of a fixture checkpoint.

    Every linear input dimension must be a multiple of 64 (group-size-64 quantization) except
    ``vision_intermediate`` (the vision blocks' ``linear_fc2``, 4304 in the real model, which xl
    keeps bf16), ``linear_value_heads`` a multiple of ``linear_key_heads`` and ``heads`` of
    ``kv_heads``.
    ``vision_positions`` is the vision tower's learned position grid (a perfect square).
    An invalid spec raises ``ValueError`` naming the field.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    hidden: int = 128
    layers: int = 4
    experts: int = 8
    experts_per_tok: int = 2
    moe_intermediate: int = 64
    shared_intermediate: int = 64
    vocab: int = 512
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    linear_key_heads: int = 2
    linear_value_heads: int = 4
    linear_key_dim: int = 32
    linear_value_dim: int = 32
    conv_kernel: int = 4
    full_attention_interval: int = 4
    vision_depth: int = 2
    vision_hidden: int = 64
    vision_heads: int = 2
    vision_intermediate: int = 128
    vision_positions: int = 64
    shards: int = 2
    seed: int = 0

    @model_validator(mode="after")
    def _check(self) -> FixtureSpec:
        for name, value in self:
            if value < (0 if name == "seed" else 1):
                raise ValueError(
                    f"{name}={value} must be {'>= 0' if name == 'seed' else 'positive'}"
                )
        for name, value in [
            ("hidden", self.hidden),
            ("moe_intermediate", self.moe_intermediate),
            ("shared_intermediate", self.shared_intermediate),
            ("heads*head_dim", self.heads * self.head_dim),
            (
                "linear_value_heads*linear_value_dim",
                self.linear_value_heads * self.linear_value_dim,
            ),
            ("vision_hidden", self.vision_hidden),
        ]:  # vision_intermediate is free: the real model's 4304 keeps linear_fc2 bf16
            # (manifests/xl.toml)
            if value % 64:
                raise ValueError(
                    f"{name}={value} must be a multiple of 64 (quantization group size)"
                )
        rules = [
            (
                "linear_value_heads",
                self.linear_value_heads % self.linear_key_heads == 0,
                "must be a multiple of linear_key_heads",
            ),
            ("kv_heads", self.heads % self.kv_heads == 0, "must divide heads"),
            ("experts_per_tok", self.experts_per_tok <= self.experts, "must be <= experts"),
            ("head_dim", self.head_dim % 8 == 0, "must be a multiple of 8 (partial rotary 0.25)"),
            (
                "conv_kernel",
                self.conv_kernel >= 2,
                "must be >= 2 (mlx_lm detects an HF checkpoint by conv1d.weight.shape[-1] != 1)",
            ),
            (
                "full_attention_interval",
                self.full_attention_interval >= 2,
                "must be >= 2 (mlx_lm needs a linear-attention layer to detect HF offset norms)",
            ),
            (
                "layers",
                self.layers >= self.full_attention_interval,
                "must be >= full_attention_interval (mlx_lm needs one full-attention layer)",
            ),
            (
                "vocab",
                self.vocab >= 256 + len(SPECIAL_TOKENS),
                "must hold 256 bytes + special tokens",
            ),
            (
                "vision_heads",
                self.vision_hidden % self.vision_heads == 0
                and (self.vision_hidden // self.vision_heads) % 4 == 0,
                "must divide vision_hidden into heads of a multiple of 4",
            ),
            (
                "vision_positions",
                math.isqrt(self.vision_positions) ** 2 == self.vision_positions,
                "must be a perfect square",
            ),
        ]
        for name, ok, why in rules:
            if not ok:
                raise ValueError(f"{name}={getattr(self, name)} {why}")
        return self


# The real checkpoint's dimensions (DESIGN.md): `buildkit fixture OUT --preset qwen3.6-35b-a3b`.
PRESETS: dict[str, dict[str, int]] = {
    "qwen3.6-35b-a3b": dict(
        hidden=2048,
        layers=40,
        experts=256,
        experts_per_tok=8,
        moe_intermediate=512,
        shared_intermediate=512,
        vocab=248320,
        heads=16,
        kv_heads=2,
        head_dim=256,
        linear_key_heads=16,
        linear_value_heads=32,
        linear_key_dim=128,
        linear_value_dim=128,
        conv_kernel=4,
        full_attention_interval=4,
        vision_depth=27,
        vision_hidden=1152,
        vision_heads=16,
        vision_intermediate=4304,
        vision_positions=2304,
        shards=26,
    ),
}
SPARSE_REAL_BYTES = 1 << 20  # sparse fixtures write tensors up to this size whole
SPARSE_HEAD_BYTES = 4096  # and of each larger tensor its first bytes, the rest a hole


class _Tensor(NamedTuple):
    name: str
    shape: tuple[int, ...]
    std: float
    mean: float = 0.0
    a_log: bool = False  # log(uniform(1, 16)) instead of mean + std * noise

    @property
    def nbytes(self) -> int:
        return 2 * math.prod(self.shape)


def _linear(name: str, out: int, inp: int) -> _Tensor:
    return _Tensor(name, (out, inp), inp**-0.5)


def _norm(name: str, dim: int) -> _Tensor:  # offset RMSNorm (runtime 1 + w)
    return _Tensor(name, (dim,), _NORM_STD)


def _decoder_layer(p: str, s: FixtureSpec, full: bool) -> list[_Tensor]:
    H, E, MI, SI = s.hidden, s.experts, s.moe_intermediate, s.shared_intermediate
    t = [_norm(p + "input_layernorm.weight", H), _norm(p + "post_attention_layernorm.weight", H)]
    if full:
        a, q, kv = p + "self_attn.", s.heads * s.head_dim, s.kv_heads * s.head_dim
        t += [
            _linear(a + "q_proj.weight", 2 * q, H),  # query and output gate
            _linear(a + "k_proj.weight", kv, H),
            _linear(a + "v_proj.weight", kv, H),
            _linear(a + "o_proj.weight", H, q),
            _norm(a + "q_norm.weight", s.head_dim),
            _norm(a + "k_norm.weight", s.head_dim),
        ]
    else:
        a = p + "linear_attn."
        key, value, nv = (
            s.linear_key_heads * s.linear_key_dim,
            s.linear_value_heads * s.linear_value_dim,
            s.linear_value_heads,
        )
        conv = 2 * key + value
        t += [
            _linear(a + "in_proj_qkv.weight", conv, H),
            _linear(a + "in_proj_z.weight", value, H),
            _linear(a + "in_proj_b.weight", nv, H),
            _linear(a + "in_proj_a.weight", nv, H),
            _Tensor(a + "conv1d.weight", (conv, 1, s.conv_kernel), s.conv_kernel**-0.5),
            _Tensor(a + "dt_bias", (nv,), 0.1, mean=1.0),
            _Tensor(a + "A_log", (nv,), 0.0, a_log=True),
            _Tensor(a + "norm.weight", (s.linear_value_dim,), _NORM_STD, mean=1.0),  # not an offset
            _linear(a + "out_proj.weight", H, value),
        ]
    m = p + "mlp."
    return t + [
        _linear(m + "gate.weight", E, H),
        _Tensor(m + "experts.gate_up_proj", (E, 2 * MI, H), H**-0.5),
        _Tensor(m + "experts.down_proj", (E, H, MI), MI**-0.5),
        _linear(m + "shared_expert.gate_proj.weight", SI, H),
        _linear(m + "shared_expert.up_proj.weight", SI, H),
        _linear(m + "shared_expert.down_proj.weight", H, SI),
        _linear(m + "shared_expert_gate.weight", 1, H),
    ]


def _vision(s: FixtureSpec) -> list[_Tensor]:
    v, vi, merged = "model.visual.", s.vision_hidden, s.vision_hidden * SPATIAL_MERGE**2
    patch = IN_CHANNELS * TEMPORAL_PATCH_SIZE * PATCH_SIZE**2

    def bias(name: str, dim: int) -> _Tensor:
        return _Tensor(name, (dim,), 0.02)

    def layer_norm(name: str) -> list[_Tensor]:
        return [_Tensor(name + ".weight", (vi,), _NORM_STD, mean=1.0), bias(name + ".bias", vi)]

    t = [
        _Tensor(
            v + "patch_embed.proj.weight",
            (vi, IN_CHANNELS, TEMPORAL_PATCH_SIZE, PATCH_SIZE, PATCH_SIZE),
            patch**-0.5,
        ),
        bias(v + "patch_embed.proj.bias", vi),
        _Tensor(v + "pos_embed.weight", (s.vision_positions, vi), 0.02),
    ]
    for n in range(s.vision_depth):
        b = f"{v}blocks.{n}."
        t += (
            layer_norm(b + "norm1")
            + layer_norm(b + "norm2")
            + [
                _linear(b + "attn.qkv.weight", 3 * vi, vi),
                bias(b + "attn.qkv.bias", 3 * vi),
                _linear(b + "attn.proj.weight", vi, vi),
                bias(b + "attn.proj.bias", vi),
                _linear(b + "mlp.linear_fc1.weight", s.vision_intermediate, vi),
                bias(b + "mlp.linear_fc1.bias", s.vision_intermediate),
                _linear(b + "mlp.linear_fc2.weight", vi, s.vision_intermediate),
                bias(b + "mlp.linear_fc2.bias", vi),
            ]
        )
    return (
        t
        + layer_norm(v + "merger.norm")
        + [
            _linear(v + "merger.linear_fc1.weight", merged, merged),
            bias(v + "merger.linear_fc1.bias", merged),
            _linear(v + "merger.linear_fc2.weight", s.hidden, merged),
            bias(v + "merger.linear_fc2.bias", s.hidden),
        ]
    )


def _plan(s: FixtureSpec) -> list[tuple[_Tensor, int]]:
    # Every tensor with its 0-based shard, in model order; mtp.* last and all in the last shard.
    lm, H = "model.language_model.", s.hidden
    body = [_Tensor(lm + "embed_tokens.weight", (s.vocab, H), 1.0)]
    for n in range(s.layers):
        body += _decoder_layer(f"{lm}layers.{n}.", s, (n + 1) % s.full_attention_interval == 0)
    body += [_norm(lm + "norm.weight", H), _linear("lm_head.weight", s.vocab, H)] + _vision(s)
    mtp = [
        _linear("mtp.fc.weight", H, 2 * H),
        _norm("mtp.pre_fc_norm_embedding.weight", H),
        _norm("mtp.pre_fc_norm_hidden.weight", H),
        _norm("mtp.norm.weight", H),
    ] + _decoder_layer("mtp.layers.0.", s, full=True)
    total = sum(t.nbytes for t in body + mtp)
    plan, done = [], 0
    for t in body:  # contiguous runs of about total / shards bytes
        plan.append((t, min(done * s.shards // total, s.shards - 1)))
        done += t.nbytes
    plan += [(t, s.shards - 1) for t in mtp]
    empty = set(range(s.shards)) - {k for _, k in plan}
    if empty:
        raise ValueError(
            f"shards={s.shards} is too many for this spec: shard(s) {sorted(empty)} would be empty"
        )
    return plan


def _values(t: _Tensor, seed: int, limit: int | None = None) -> Iterator[np.ndarray]:
    # float32 chunks of a tensor, bit-identical on every machine: the noise uses only PCG64's
    # integer stream and correctly rounded float ops (no libm, whose last ulp varies). Each
    # element is the Irwin-Hall sum of the four 16-bit lanes of one 64-bit draw, standardised
    # (unit variance, |z| <= 3.46): near-normal, and the stream is independent of _CHUNK.
    key = int.from_bytes(hashlib.blake2b(t.name.encode(), digest_size=8).digest(), "little")
    bitgen = np.random.PCG64(np.random.SeedSequence([seed, key]))
    n = math.prod(t.shape) if limit is None else min(limit, math.prod(t.shape))
    lanes = np.uint64(0x0000FFFF0000FFFF)
    scale = np.float32(t.std / math.sqrt(4 * (65536**2 - 1) / 12))
    for start in range(0, n, _CHUNK):
        raw = bitgen.random_raw(min(_CHUNK, n - start))
        if t.a_log:  # A = uniform(1, 16); log of few values, rounding to bf16 hides libm ulps
            yield np.log1p((raw >> np.uint64(11)) * (15 * 2.0**-53)).astype(np.float32)
            continue
        pair = (raw & lanes) + ((raw >> np.uint64(16)) & lanes)
        z = ((pair & np.uint64(0xFFFFFFFF)) + (pair >> np.uint64(32))).astype(np.float32)
        z -= np.float32(2 * 65535)
        z *= scale
        z += np.float32(t.mean)
        yield z


def _bf16(x: np.ndarray) -> np.ndarray:
    # float32 -> bf16 bit patterns (little-endian uint16), round to nearest even; clobbers x.
    b = x.view(np.uint32)
    b += np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))
    return (b >> np.uint32(16)).astype("<u2")


def _write_shard(
    path: Path,
    tensors: list[_Tensor],
    seed: int,
    progress,
    weights: Mapping[str, np.ndarray],
    sparse: bool = False,
) -> None:
    tensors = sorted(tensors, key=lambda t: t.name)  # safetensors' own header and data order
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        header[t.name] = {
            "dtype": "BF16",
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for t in tensors:
            if t.name in weights:  # given bf16 bit patterns instead of noise
                f.write(np.ascontiguousarray(weights[t.name], dtype="<u2").data)
            elif sparse and t.nbytes > SPARSE_REAL_BYTES:  # the first bytes real, then a hole
                start = f.tell()
                for chunk in _values(t, seed, limit=SPARSE_HEAD_BYTES // 2):
                    f.write(_bf16(chunk).data)
                f.seek(start + t.nbytes)
            else:
                for chunk in _values(t, seed):
                    f.write(_bf16(chunk).data)
            if progress:
                progress(f"{path.name}: {t.name} {list(t.shape)}")
        f.truncate(f.tell())  # a trailing hole still counts in the file's size


_CORPUS = """\
The old lighthouse keeper climbed the spiral stairs every evening before the sun went down.
He carried a small lamp, a notebook and a flask of tea, and he counted the steps out loud:
one hundred and twelve, never more and never less. From the top he could see the harbour,
the fishing boats coming home, the gulls circling above the market, and the long grey line
of the northern cliffs. Winter storms were the hardest. The wind pressed against the glass,
the rain turned to ice on the railings, and the beam had to keep turning through the night.
In the spring the village school visited, and the children asked how far the light could
reach. Twenty miles, he told them, on a clear night, and farther if you know where to look.
A good build system remembers what it has already done. It reads the recipe, computes a key
for every step from its inputs and parameters, and skips the work when the key is known.
When a parameter changes, only the steps that depend on it run again; everything else is
taken from the store. Weights are checked, shapes are compared, and the result is written
to a new directory so that a failure never leaves a half-finished model behind.
Small models are useful for testing because they load quickly and still exercise the same
code paths as large ones: the same names, the same layouts, the same quantization rules.
Hello, world! The quick brown fox jumps over the lazy dog. Numbers like 0, 1, 2, 3, 4, 5,
6, 7, 8, 9, 10, 64, 128 and 2048 appear in configuration files; so do words such as hidden,
layers, experts, heads, vocabulary, tokenizer, attention, expert, router and projection.
"""

# Qwen3-VL's chat template, cut to what the fixture needs: text, image and video items, so an
# image prompt renders <|vision_start|><|image_pad|><|vision_end|> as the real template does.
_CHAT_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}{%- else %}"
    "{%- for item in message['content'] %}"
    "{%- if item['type'] == 'image' or 'image' in item %}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif item['type'] == 'video' or 'video' in item %}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- elif 'text' in item %}{{- item['text'] }}{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def train_tokenizer(lines: Iterable[str], vocab: int) -> tk.Tokenizer:
    """A byte-level BPE of ``vocab`` ids (special tokens included) trained on ``lines``, with
    Qwen3.5's pre-tokenizer; the fixture's tokenizer is this trained on a built-in paragraph."""
    tok = tk.Tokenizer(tk.models.BPE())
    tok.normalizer = tk.normalizers.NFC()
    tok.pre_tokenizer = tk.pre_tokenizers.Sequence(
        [
            tk.pre_tokenizers.Split(tk.Regex(_PRETOKENIZE_REGEX), behavior="isolated"),
            tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.post_processor = tk.processors.ByteLevel(
        add_prefix_space=False, trim_offsets=False, use_regex=False
    )
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab - len(SPECIAL_TOKENS),
        show_progress=False,
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(lines, trainer)
    tok.add_special_tokens(
        [tk.AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]
    )
    return tok


def _write_tokenizer(out: Path, s: FixtureSpec, tokenizer: str | None = None) -> dict[str, int]:
    if tokenizer is None:
        tok = train_tokenizer(_CORPUS.splitlines(), s.vocab)
    else:
        tok = tk.Tokenizer.from_str(tokenizer)
        missing = [t for t in SPECIAL_TOKENS if tok.token_to_id(t) is None]
        if tok.get_vocab_size() != s.vocab or missing:
            raise ValueError(
                f"the given tokenizer has {tok.get_vocab_size()} ids (spec vocab={s.vocab})"
                + (f" and lacks {', '.join(missing)}" if missing else "")
            )
    (out / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n")
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    config = {
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(i): {
                "content": t,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for t, i in ids.items()
        },
        "bos_token": None,
        "chat_template": _CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 262144,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    _write_json(out / "tokenizer_config.json", config)
    return ids


def _write_processor_files(out: Path) -> None:
    """What a real source carries for image and video prompts: the chat template as its own
    file, and the image and video processor configs (the real model's constants; pixel bounds
    small, so a test image is a few patches)."""
    (out / "chat_template.jinja").write_text(_CHAT_TEMPLATE + "\n")
    common = {
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "merge_size": SPATIAL_MERGE,
        "patch_size": PATCH_SIZE,
        "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "processor_class": "Qwen3VLProcessor",
    }
    pixels = (PATCH_SIZE * SPATIAL_MERGE) ** 2  # one merged token
    _write_json(
        out / "preprocessor_config.json",
        common
        | {
            "image_processor_type": "Qwen2VLImageProcessorFast",
            "size": {"shortest_edge": 4 * pixels, "longest_edge": 16 * pixels},
        },
    )
    _write_json(
        out / "video_preprocessor_config.json",
        common
        | {
            "video_processor_type": "Qwen3VLVideoProcessor",
            "fps": 2,
            "do_sample_frames": True,
            "size": {
                "shortest_edge": 4 * pixels,
                "longest_edge": 16 * pixels * TEMPORAL_PATCH_SIZE,
            },
        },
    )


def _configs(s: FixtureSpec, ids: dict[str, int]) -> tuple[dict, dict]:
    half = int(s.head_dim * PARTIAL_ROTARY) // 2  # mrope sections split the rotary half-dims
    mrope = [
        half // 3 + (i < half % 3) for i in range(3)
    ]  # 256 -> [11, 11, 10] as in the real model
    eos, im_end = ids["<|endoftext|>"], ids["<|im_end|>"]
    text = {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_output_gate": True,
        "bos_token_id": eos,
        "dtype": "bfloat16",
        "eos_token_id": eos,
        "full_attention_interval": s.full_attention_interval,
        "head_dim": s.head_dim,
        "hidden_act": "silu",
        "hidden_size": s.hidden,
        "initializer_range": 0.02,
        "layer_types": [
            "full_attention" if (n + 1) % s.full_attention_interval == 0 else "linear_attention"
            for n in range(s.layers)
        ],
        "linear_conv_kernel_dim": s.conv_kernel,
        "linear_key_head_dim": s.linear_key_dim,
        "linear_num_key_heads": s.linear_key_heads,
        "linear_num_value_heads": s.linear_value_heads,
        "linear_value_head_dim": s.linear_value_dim,
        "mamba_ssm_dtype": "float32",
        "max_position_embeddings": 262144,
        "mlp_only_layers": [],
        "model_type": "qwen3_5_moe_text",
        "moe_intermediate_size": s.moe_intermediate,
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "num_attention_heads": s.heads,
        "num_experts": s.experts,
        "num_experts_per_tok": s.experts_per_tok,
        "num_hidden_layers": s.layers,
        "num_key_value_heads": s.kv_heads,
        "output_router_logits": False,
        "pad_token_id": None,
        "partial_rotary_factor": PARTIAL_ROTARY,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "mrope_interleaved": True,
            "mrope_section": mrope,
            "partial_rotary_factor": PARTIAL_ROTARY,
            "rope_theta": ROPE_THETA,
            "rope_type": "default",
        },
        "router_aux_loss_coef": 0.001,
        "shared_expert_intermediate_size": s.shared_intermediate,
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": s.vocab,
    }
    vision = {
        "deepstack_visual_indexes": [],
        "depth": s.vision_depth,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": s.vision_hidden,
        "in_channels": IN_CHANNELS,
        "initializer_range": 0.02,
        "intermediate_size": s.vision_intermediate,
        "model_type": "qwen3_5_moe",
        "num_heads": s.vision_heads,
        "num_position_embeddings": s.vision_positions,
        "out_hidden_size": s.hidden,
        "patch_size": PATCH_SIZE,
        "spatial_merge_size": SPATIAL_MERGE,
        "temporal_patch_size": TEMPORAL_PATCH_SIZE,
    }
    config = {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "image_token_id": ids["<|image_pad|>"],
        "language_model_only": False,
        "model_type": "qwen3_5_moe",
        "text_config": text,
        "tie_word_embeddings": False,
        "transformers_version": "4.57.1",
        "video_token_id": ids["<|video_pad|>"],
        "vision_config": vision,
        "vision_end_token_id": ids["<|vision_end|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
    }
    generation = {
        "bos_token_id": eos,
        "do_sample": True,
        "eos_token_id": [im_end, eos],
        "pad_token_id": eos,
        "temperature": 1.0,
        "top_k": 20,
        "top_p": 0.95,
        "transformers_version": "4.57.1",
    }
    return config, generation


def layout(spec: FixtureSpec) -> tuple[dict, dict[str, tuple[int, ...]]]:
    """config.json and HF tensor name -> shape (all bf16) of the checkpoint ``generate`` would
    write, without writing it; the special-token ids are placeholders (no tokenizer is trained)."""
    ids = {t: spec.vocab - len(SPECIAL_TOKENS) + i for i, t in enumerate(SPECIAL_TOKENS)}
    return _configs(spec, ids)[0], {t.name: t.shape for t, _ in _plan(spec)}


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def generate(
    out_dir: str | Path,
    spec: FixtureSpec = FixtureSpec(),  # noqa: B008 (frozen)
    progress: Callable[[str], None] | None = None,
    sparse: bool = False,
    *,
    tokenizer: str | None = None,
    weights: Mapping[str, np.ndarray] | None = None,
) -> Path:
    """Write a deterministic fixture checkpoint to ``out_dir`` and return its path.

    Produces ``model-0000K-of-0000N.safetensors`` shards (bf16, metadata ``{"format": "pt"}``,
    every ``mtp.*`` tensor in the last shard), ``model.safetensors.index.json``,
    ``config.json``, ``generation_config.json``, ``tokenizer.json``, ``tokenizer_config.json``,
    ``chat_template.jinja``, ``preprocessor_config.json`` and ``video_preprocessor_config.json``,
    named and shaped exactly like the Qwen3.6-35B-A3B Hugging Face checkpoint. The same spec
    gives byte-identical files on any machine. Tensors are streamed in chunks, so memory stays
    small whatever the size. Everything is written to a temporary sibling directory and renamed
    into place at the end, mtimes set a few seconds back (``store.settle``: a build that hashes
    them at once need not hash them again); ``progress`` (if given) receives one line per tensor
    written.

    ``sparse``: tensors up to ``SPARSE_REAL_BYTES`` are written whole; of each larger one only
    the first ``SPARSE_HEAD_BYTES`` (its generated values), the rest is a hole (zeros that take
    no disk). The real model's shapes then cost ~72 GB apparent and tens of MB on disk.
    ``tokenizer`` (a ``tokenizer.json`` text with ``spec.vocab`` ids and the special tokens)
    replaces the built-in one; ``weights`` maps tensor names to bf16 bit patterns (uint16 of
    the tensor's shape) written instead of noise. ``buildkit.trained`` uses both.

    Raises ``FileExistsError`` if ``out_dir`` exists and is not an empty directory.
    """
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(
            f"{out} already exists and is not empty; remove it or choose another output directory"
        )
    plan = _plan(spec)
    weights = weights or {}
    shapes = {t.name: t.shape for t, _ in plan}
    for name, w in weights.items():
        if name not in shapes:
            raise ValueError(f"weights[{name!r}]: the spec has no such tensor")
        if tuple(w.shape) != shapes[name] or w.dtype.itemsize != 2:
            raise ValueError(
                f"weights[{name!r}]: {w.dtype}{list(w.shape)}; the spec needs bf16 bit patterns "
                f"of shape {list(shapes[name])}"
            )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        names = [f"model-{k + 1:05d}-of-{spec.shards:05d}.safetensors" for k in range(spec.shards)]
        for k, name in enumerate(names):
            _write_shard(
                tmp / name, [t for t, i in plan if i == k], spec.seed, progress, weights, sparse
            )
        index = {
            "metadata": {"total_size": sum(t.nbytes for t, _ in plan)},
            "weight_map": {t.name: names[k] for t, k in sorted(plan, key=lambda p: p[0].name)},
        }
        _write_json(tmp / "model.safetensors.index.json", index)
        config, generation = _configs(spec, _write_tokenizer(tmp, spec, tokenizer))
        _write_json(tmp / "config.json", config)
        _write_json(tmp / "generation_config.json", generation)
        _write_processor_files(tmp)
        for f in tmp.iterdir():  # unseen until the rename: a digest of them is trusted at once
            settle(f)
        os.chmod(tmp, 0o755)
        if out.exists():
            out.rmdir()
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if progress:
        progress(f"wrote {out} ({index['metadata']['total_size']} bytes of tensors)")
    return out
