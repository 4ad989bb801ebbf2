"""Speculative decoding as users run it: mlx_vlm's own generation with the published ``mtp/``
drafter, greedy, against plain greedy decoding on the same prompts.

For each draft length 1..depth (``draft_block_size`` = drafts + 1), every prompt is generated
with the drafter and compared token for token with plain greedy decoding, in float32 (model
and drafter cast as loaded): greedy speculative decoding is lossless, so any difference is a
defect of the directory (a graft or a requantization that breaks the head's agreement with
the trunk shows as fewer accepted drafts, never as other text). mlx_vlm's counters
(``speculative_stats_snapshot``/``speculative_stats_since``) give rounds, accepted and drafted;
tokens per round = (accepted + rounds) / rounds, as mlx_vlm prints it. The wall-clock ratio
(plain time / speculative time) is this machine's CPU figure, not a Metal one. Then, in the
directory's own bf16, how many prompts diverge from plain greedy and after how many tokens:
batched verification and single-token decoding round differently near ties.

mlx_vlm loads the whole model; this is for models that fit in memory.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from buildkit.core.errors import StepError, UsageError
from buildkit.core.lazy import lazy
from buildkit.formats.checkpoint import DRAFTER_DIR, HEAD_PREFIX

np = lazy("numpy", __name__)

# what publish does not copy from the source (it writes its own config, index and card)
SKIP_SOURCE_FILES = {"config.json", "model.safetensors.index.json", "README.md", ".gitattributes"}


class SpeculativeParams(BaseModel):
    """How much of the eval text the speculative run uses (kept small: it decodes token by
    token)."""

    model_config = ConfigDict(extra="forbid")
    prompts: int = Field(default=4, ge=1)
    prompt_tokens: int = Field(default=32, ge=2)
    max_tokens: int = Field(default=24, ge=1)  # new tokens per prompt
    bf16: bool = True  # also measure divergence in the directory's own bf16


def prompt_ids(tokens: list[int], n: int, length: int) -> list[list[int]]:
    """``n`` prompts of ``length`` tokens, evenly spaced over the text's tokens."""
    if len(tokens) < length:
        raise UsageError(
            f"the eval text has {len(tokens)} tokens; a speculative prompt needs {length}"
        )
    starts = np.linspace(0, len(tokens) - length, n).astype(int)
    return [list(tokens[s : s + length]) for s in starts]


def _greedy(model, processor, prompt: str, max_tokens: int, **kw) -> list[int]:
    from mlx_vlm import stream_generate

    return [
        int(r.token)
        for r in stream_generate(
            model, processor, prompt, max_tokens=max_tokens, temperature=0.0, **kw
        )
    ]


def _load(model_dir: Path, float32: bool):
    import mlx.core as mx
    from mlx_vlm import load
    from mlx_vlm.speculative.drafters import load_drafter

    drafter_dir = model_dir / DRAFTER_DIR
    if not (drafter_dir / "config.json").is_file():
        raise UsageError(
            f"{model_dir}: no drafter directory {DRAFTER_DIR}/ (an MTP variant publishes one)"
        )
    model, processor = load(str(model_dir))
    drafter, kind = load_drafter(str(drafter_dir), kind="mtp")
    if float32:
        model.set_dtype(mx.float32)
        drafter.set_dtype(mx.float32)
    return model, processor, drafter, kind


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The index of the first token where two outputs differ (None if equal)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def run(model_dir: Path, prompts: list[str], depth: int, p: SpeculativeParams) -> dict:
    """The speculative figures of an MLX directory with a drafter in ``mtp/``."""
    import mlx.core as mx
    from mlx_vlm.speculative.common import speculative_stats_since, speculative_stats_snapshot

    model, processor, drafter, kind = _load(Path(model_dir), float32=True)
    spec = {"draft_model": drafter, "draft_kind": kind}
    _greedy(model, processor, prompts[0], 2)  # warm both paths before timing
    _greedy(model, processor, prompts[0], 2, **spec, draft_block_size=2)
    t0 = time.perf_counter()
    plain = [_greedy(model, processor, q, p.max_tokens) for q in prompts]
    t_plain = time.perf_counter() - t0
    out = {k: [] for k in ("rounds", "accepted", "drafted", "tokens_per_round", "wall_ratio_cpu")}
    mismatches = []
    for k in range(1, depth + 1):
        snap = speculative_stats_snapshot(drafter)
        t0 = time.perf_counter()
        got = [
            _greedy(model, processor, q, p.max_tokens, **spec, draft_block_size=k + 1)
            for q in prompts
        ]
        dt = time.perf_counter() - t0
        rounds, accepted, drafted = speculative_stats_since(drafter, snap)
        rounds, accepted, drafted = rounds or 0, accepted or 0, drafted or 0
        out["rounds"].append(rounds)
        out["accepted"].append(accepted)
        out["drafted"].append(drafted)
        out["tokens_per_round"].append((accepted + rounds) / rounds if rounds else None)
        out["wall_ratio_cpu"].append(t_plain / dt)
        for i, (a, b) in enumerate(zip(plain, got, strict=True)):
            if (at := first_difference(a, b)) is not None:
                mismatches.append(
                    f"prompt {i}, {k} draft(s): token {at} is {b[at : at + 1]} "
                    f"where plain greedy gives {a[at : at + 1]}"
                )
    del model, drafter
    mx.clear_cache()
    out |= {
        "lossless": not mismatches,
        "mismatches": mismatches,
        "prompts": len(prompts),
        "prompt_tokens": p.prompt_tokens,
        "max_tokens": p.max_tokens,
        "bf16_divergent_prompts": None,
        "bf16_tokens_before_divergence": None,
    }
    if p.bf16:
        model, processor, drafter, kind = _load(Path(model_dir), float32=False)
        at = []
        for q in prompts:
            a = _greedy(model, processor, q, p.max_tokens)
            b = _greedy(
                model,
                processor,
                q,
                p.max_tokens,
                draft_model=drafter,
                draft_kind=kind,
                draft_block_size=depth + 1,
            )
            if (i := first_difference(a, b)) is not None:
                at.append(i)
        out["bf16_divergent_prompts"] = len(at)
        out["bf16_tokens_before_divergence"] = float(np.mean(at)) if at else None
        del model, drafter
        mx.clear_cache()
    return out


def decode_prompts(tokenizer_json: bytes, ids: list[list[int]]) -> list[str]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer_json.decode())
    return [tok.decode(x, skip_special_tokens=False) for x in ids]


# ---- a directory from the store, laid out as publish lays it out ----------------------


def write_dir(store, parts: list, source, dest: Path) -> None:
    """An MLX directory of the model ``parts`` (store artifacts) with the source artifact's
    config and side files, and the head as the drafter ``mtp/``: publish's layout, in one shard
    per part, for mlx_vlm to load."""
    import mlx.core as mx

    from buildkit.clients.configs import drafter_config
    from buildkit.formats.tensors import to_mlx
    from buildkit.quant.quantize import quantization_config

    tensors = {k: v for a in parts for k, v in a.tensors.items()}
    config = json.loads(store.get_blob(source.files["config.json"]))
    if q := quantization_config(parts):
        config["quantization"] = config["quantization_config"] = q
    dest.mkdir(parents=True)
    for name, digest in source.files.items():
        if name not in SKIP_SOURCE_FILES and "/" not in name and name != "config.json":
            (dest / name).write_bytes(store.get_blob(digest))
    (dest / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    arrays = {k: to_mlx(store.read_tensor(e), e["dtype"]) for k, e in sorted(tensors.items())}
    mx.save_safetensors(str(dest / "model.safetensors"), arrays, metadata={"format": "mlx"})
    head = {k.removeprefix(HEAD_PREFIX): v for k, v in arrays.items() if k.startswith(HEAD_PREFIX)}
    if not head:
        raise StepError("speculative: the model has no MTP head (language_model.mtp.* tensors)")
    (dest / DRAFTER_DIR).mkdir()
    mx.save_safetensors(
        str(dest / DRAFTER_DIR / "model.safetensors"), head, metadata={"format": "mlx"}
    )
    (dest / DRAFTER_DIR / "config.json").write_text(
        json.dumps(drafter_config(config), indent=2, sort_keys=True)
    )


@contextlib.contextmanager
def staged(store, parts: list, source, tmp_root: Path):
    """A temporary directory (``write_dir``), removed afterwards."""
    tmp_root.mkdir(parents=True, exist_ok=True)
    d = Path(tempfile.mkdtemp(prefix="speculative-", dir=tmp_root))
    try:
        write_dir(store, parts, source, d / "model")
        yield d / "model"
    finally:
        shutil.rmtree(d, ignore_errors=True)
