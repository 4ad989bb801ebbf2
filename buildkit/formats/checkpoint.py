"""What a qwen3_5_moe checkpoint looks like: expected tensors, and the HF -> MLX name mapping.

Facts: text keys live under ``model.language_model.``, the
vision tower under ``model.visual.``, the MTP head under ``mtp.``. mlx_lm names
text keys ``language_model.model.*`` and splits fused experts into
``switch_mlp.{gate,up,down}_proj.weight`` (gate = first half of rows); mlx_vlm
names the vision tower ``vision_tower.*``. Offset norms are stored as ``w`` and
used as ``1 + w``.
"""

from __future__ import annotations

import json
import math
import re

from buildkit.core.errors import SourceError
from buildkit.formats.tensors import TensorInfo, read_header

OFFSET_NORMS = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "q_norm.weight",
    "k_norm.weight",
)
HEAD_PREFIX = "language_model.mtp."  # the head in the published model, where oMLX looks for it
DRAFTER_DIR = "mtp"  # the head again, as mlx_vlm's standalone drafter (docs/architecture.md)
SWITCH = ".mlp.switch_mlp"  # a MoE layer's routed experts, as mlx_lm names them
PROJS = ("gate_proj", "up_proj", "down_proj")  # each expert's three projections, in that order
MTP_OFFSET_NORMS = (
    "pre_fc_norm_embedding.weight",
    "pre_fc_norm_hidden.weight",
)


def text_config(config: dict) -> dict:
    tc = config.get("text_config", config)
    if not isinstance(tc, dict):
        raise SourceError("config.json: text_config is not an object")
    return tc


def _need(tc: dict, key: str):
    if key not in tc:
        raise SourceError(f"config.json: text_config.{key} is missing")
    return tc[key]


def layer_shapes(tc: dict, prefix: str, full_attention: bool) -> dict[str, tuple[int, ...]]:
    """HF tensor shapes of one decoder layer (attention or gated delta net, plus MoE)."""
    H = _need(tc, "hidden_size")
    E, I = _need(tc, "num_experts"), _need(tc, "moe_intermediate_size")
    SI = _need(tc, "shared_expert_intermediate_size")
    s: dict[str, tuple[int, ...]] = {
        f"{prefix}.input_layernorm.weight": (H,),
        f"{prefix}.post_attention_layernorm.weight": (H,),
        f"{prefix}.mlp.gate.weight": (E, H),
        f"{prefix}.mlp.experts.gate_up_proj": (E, 2 * I, H),
        f"{prefix}.mlp.experts.down_proj": (E, H, I),
        f"{prefix}.mlp.shared_expert.gate_proj.weight": (SI, H),
        f"{prefix}.mlp.shared_expert.up_proj.weight": (SI, H),
        f"{prefix}.mlp.shared_expert.down_proj.weight": (H, SI),
        f"{prefix}.mlp.shared_expert_gate.weight": (1, H),
    }
    if full_attention:
        nh, nkv = _need(tc, "num_attention_heads"), _need(tc, "num_key_value_heads")
        hd = tc.get("head_dim") or H // nh
        a = f"{prefix}.self_attn"
        s |= {
            f"{a}.q_proj.weight": (2 * nh * hd, H),
            f"{a}.k_proj.weight": (nkv * hd, H),
            f"{a}.v_proj.weight": (nkv * hd, H),
            f"{a}.o_proj.weight": (H, nh * hd),
            f"{a}.q_norm.weight": (hd,),
            f"{a}.k_norm.weight": (hd,),
        }
    else:
        kh, vh = _need(tc, "linear_num_key_heads"), _need(tc, "linear_num_value_heads")
        kd, vd = _need(tc, "linear_key_head_dim"), _need(tc, "linear_value_head_dim")
        K = _need(tc, "linear_conv_kernel_dim")
        C = 2 * kh * kd + vh * vd
        a = f"{prefix}.linear_attn"
        s |= {
            f"{a}.in_proj_qkv.weight": (C, H),
            f"{a}.in_proj_z.weight": (vh * vd, H),
            f"{a}.in_proj_b.weight": (vh, H),
            f"{a}.in_proj_a.weight": (vh, H),
            f"{a}.conv1d.weight": (C, 1, K),
            f"{a}.dt_bias": (vh,),
            f"{a}.A_log": (vh,),
            f"{a}.norm.weight": (vd,),
            f"{a}.out_proj.weight": (H, vh * vd),
        }
    return s


LAYERS = "language_model.model.layers."
LM_HEAD = "language_model.lm_head.weight"


def active_weights(config: dict, shapes: dict[str, tuple]) -> tuple[list[float], int]:
    """(the weights a token meets in each decoder layer, in the output head) of the MLX-named
    bf16 ``shapes``: every matrix of a layer, its routed experts at top-k of E. A forward
    pass's matmuls are 2 flops per weight a token meets: what its floor is counted in."""
    text = text_config(config)
    n, share = text["num_hidden_layers"], text["num_experts_per_tok"] / text["num_experts"]
    active = [0.0] * n
    for name, shape in shapes.items():
        if name.startswith(LAYERS) and name.endswith(".weight") and len(shape) >= 2:
            i = int(name[len(LAYERS) :].split(".", 1)[0])
            if i < n:
                k = math.prod(shape)
                active[i] += k * share if SWITCH in name else k
    head = shapes.get(LM_HEAD)
    return active, (head[0] * head[1] if head else 0)


def pass_tflop(config: dict, shapes: dict[str, tuple], tokens, heads: int = 0) -> float:
    """Matmul TFLOP of the trunk over ``tokens`` (a count, or each layer's count) and
    ``heads`` output heads over the last layer's: what a step logs (``matmuls``)."""
    active, head = active_weights(config, shapes)
    per = tokens if isinstance(tokens, list) else [tokens] * len(active)
    flops = sum(2 * t * a for t, a in zip(per, active, strict=False))  # a layer not run: 0
    return round((flops + 2 * (per[-1] if per else 0) * heads * head) / 1e12, 3)


def matmuls(tflop: float) -> str:
    """How a forward-pass step logs its count, the phrase bench/bench35b.py's TFLOP_LINE reads
    (the floor it divides by the machine's sgemm rate)."""
    return f"~{round(tflop, 3)} TFLOP of matmuls"


def is_full_attention(tc: dict, layer: int) -> bool:
    return (layer + 1) % tc.get("full_attention_interval", 4) == 0


def text_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every text tensor the HF checkpoint must hold, with its shape."""
    tc = text_config(config)
    H, V = _need(tc, "hidden_size"), _need(tc, "vocab_size")
    s: dict[str, tuple[int, ...]] = {
        "model.language_model.embed_tokens.weight": (V, H),
        "model.language_model.norm.weight": (H,),
    }
    if not (tc.get("tie_word_embeddings") or config.get("tie_word_embeddings")):
        s["lm_head.weight"] = (V, H)
    for n in range(_need(tc, "num_hidden_layers")):
        s |= layer_shapes(tc, f"model.language_model.layers.{n}", is_full_attention(tc, n))
    return s


def mtp_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """The MTP head's tensors (``mtp.*``), with shapes; empty if the config declares none."""
    tc = text_config(config)
    n = tc.get("mtp_num_hidden_layers", 0)
    if not n:
        return {}
    H = _need(tc, "hidden_size")
    s: dict[str, tuple[int, ...]] = {
        "mtp.fc.weight": (H, 2 * H),
        "mtp.pre_fc_norm_embedding.weight": (H,),
        "mtp.pre_fc_norm_hidden.weight": (H,),
        "mtp.norm.weight": (H,),
    }
    for i in range(n):
        s |= layer_shapes(tc, f"mtp.layers.{i}", True)
    return s


def head_signature(config: dict) -> dict:
    """The fields an MTP head must agree on with the trunk it is grafted onto."""
    tc = text_config(config)
    keys = (
        "hidden_size",
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "shared_expert_intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "rms_norm_eps",
    )
    return {k: tc.get(k) for k in keys}


# ---- names -------------------------------------------------------------------------

_LAYER_EXPERTS = re.compile(r"^(?P<p>.*\.mlp)\.experts\.(?P<w>gate_up_proj|down_proj)$")


def mlx_name(hf: str) -> str:
    """HF name -> MLX name (before the experts split, which maps one tensor to two)."""
    if hf.startswith("model.language_model."):
        return "language_model.model." + hf[len("model.language_model.") :]
    if hf.startswith("model.visual."):
        return "vision_tower." + hf[len("model.visual.") :]
    if hf.startswith("mtp."):
        return "language_model." + hf
    if hf == "lm_head.weight":
        return "language_model.lm_head.weight"
    raise SourceError(f"tensor {hf!r} is not part of the qwen3_5_moe layout (unknown prefix)")


def model_part(mlx: str) -> str:
    """The part of the model an MLX tensor belongs to: "language_model" (the trunk mlx_lm
    runs), "mtp" (the head grafted onto it) or "vision_tower". Variants differ by part (xl-mtp
    is xl plus a head), so publish never puts two parts in one shard."""
    if mlx.startswith("language_model.mtp."):
        return "mtp"
    return mlx.split(".", 1)[0]


def split_experts(
    hf: str, shape: tuple[int, ...]
) -> list[tuple[str, tuple[int, ...], tuple[int, int, int] | None]]:
    """MLX (name, shape, slice) pieces for a tensor: fused gate_up becomes gate then up."""
    m = _LAYER_EXPERTS.match(mlx_name(hf))
    if not m:
        return [(mlx_name(hf), shape, None)]
    p = m["p"] + ".switch_mlp"
    if m["w"] == "down_proj":
        return [(f"{p}.down_proj.weight", shape, None)]
    E, two_i, H = shape
    i = two_i // 2
    return [
        (f"{p}.gate_proj.weight", (E, i, H), (1, 0, i)),
        (f"{p}.up_proj.weight", (E, i, H), (1, i, two_i)),
    ]


def is_offset_norm(hf: str) -> bool:
    """Stored as w, used as 1 + w: decoder and MTP RMS norms (never linear_attn.norm)."""
    if ".linear_attn." in hf or hf.startswith("model.visual."):
        return False
    if hf in ("model.language_model.norm.weight", "mtp.norm.weight"):
        return True
    return hf.endswith(OFFSET_NORMS) or (hf.startswith("mtp.") and hf.endswith(MTP_OFFSET_NORMS))


def is_conv1d(hf: str) -> bool:
    return hf.endswith("linear_attn.conv1d.weight")


def is_patch_embed(hf: str) -> bool:
    return hf.endswith("patch_embed.proj.weight")


# ---- reading a fetched source ---------------------------------------------------


def load_config(store, art) -> dict:
    if "config.json" not in art.files:
        raise SourceError("source has no config.json")
    try:
        return json.loads(store.get_blob(art.files["config.json"]))
    except ValueError as e:
        raise SourceError(f"config.json is not valid JSON: {e}") from e


def scan_source(store, art) -> dict[str, tuple[str, TensorInfo]]:
    """name -> (file digest, header entry) over every shard, checked against the index."""
    found: dict[str, tuple[str, TensorInfo]] = {}
    where: dict[str, str] = {}
    for rel, digest in sorted(art.external.items()):
        if not rel.endswith(".safetensors"):
            continue
        header = read_header(store.sources.resolve(digest))
        for name, info in header.tensors.items():
            if name in found:
                raise SourceError(f"tensor {name!r} appears in both {where[name]} and {rel}")
            found[name], where[name] = (digest, info), rel
    idx_name = "model.safetensors.index.json"
    if idx_name in art.files:
        try:
            wmap = json.loads(store.get_blob(art.files[idx_name]))["weight_map"]
        except (ValueError, KeyError) as e:
            raise SourceError(f"{idx_name}: no valid weight_map ({e})") from e
        for name, rel in wmap.items():
            if where.get(name) != rel:
                raise SourceError(
                    f"{idx_name}: weight_map puts {name!r} in {rel} but "
                    + (f"it is in {where[name]}" if name in where else "no shard holds it")
                )
        extra = sorted(set(found) - set(wmap))
        if extra:
            raise SourceError(
                f"{idx_name}: tensors missing from weight_map: {', '.join(extra[:5])}"
            )
    return found


FLOAT_DTYPES = ("BF16", "F16", "F32")


def check_layout(config: dict, found: dict[str, tuple[str, TensorInfo]]) -> None:
    want = text_shapes(config) | mtp_shapes(config)
    missing = sorted(set(want) - set(found))
    if missing:
        more = f" (+{len(missing) - 8} more)" if len(missing) > 8 else ""
        raise SourceError(
            f"source is missing {len(missing)} tensor(s): {', '.join(missing[:8])}{more}"
        )
    for name, (_, info) in sorted(found.items()):
        if name in want and tuple(info.shape) != want[name]:
            raise SourceError(
                f"tensor {name!r} has shape {list(info.shape)} "
                f"but config.json implies {list(want[name])}"
            )
        if info.dtype not in FLOAT_DTYPES:
            raise SourceError(
                f"tensor {name!r} has dtype {info.dtype}; expected one of {FLOAT_DTYPES}"
            )
        if name not in want and not name.startswith("model.visual."):
            raise SourceError(f"tensor {name!r} is not part of the qwen3_5_moe layout")
