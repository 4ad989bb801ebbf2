"""sensitivity: how much the model's outputs move when a layer's routed experts are quantized lower.

For each group of routed-expert tensors (``granularity``: a layer's gate, up and down, or each
tensor alone) and each candidate bits, the mean KL divergence from the bf16 source on the
calibration lines of ``params.text`` (split as calibrate splits it; the held-out lines, which
eval grades on, are never used) with that group alone quantized as the build quantizes it
(data-aware with input ``calibration``'s statistics, or ``mx.quantize`` without that input).
Measured once per source and text: the key has the model, the calibration, the text's content
digest and these params, never a budget, so a new ``target_bpw`` re-plans quantize without
re-measuring. The figures are in ``meta`` (no tensors); the numerics are in
``buildkit/budget.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from buildkit.core.errors import StepError
from buildkit.engine.step import Context, Params, Slot, Step, library_version, register
from buildkit.grade import calibration as cal
from buildkit.quant import budget
from buildkit.quant.roles import BITS
from buildkit.store.artifact import Artifact


class SensitivityParams(Params):
    bits: list[int] = Field(default_factory=lambda: [3, 4, 6, 8])
    group_size: int = Field(default=64, ge=16)
    text: str = "builtin:calibration.txt"  # identity is the content digest, not this path
    heldout_every: int = Field(default=5, ge=2)  # as calibrate's: only its calibration lines
    seq_len: int = Field(default=128, ge=2)
    # tokens the KL is measured on; the bf16 log-probabilities are kept: tokens x vocab x 4 bytes
    max_tokens: int = Field(default=2048, ge=2)
    # one bits per layer's routed experts (gate, up, down), or per tensor: bench/RESULTS.md
    granularity: Literal["layer", "tensor"] = "layer"

    @field_validator("bits")
    @classmethod
    def _bits(cls, v: list[int]) -> list[int]:
        if not v or any(b not in BITS for b in v):
            raise ValueError(f"bits must be a non-empty list of {', '.join(map(str, BITS))}")
        return sorted(set(v))


@register
class Sensitivity(Step):
    kind = "sensitivity"
    version = 2  # 2: the KL divergence of the outputs, no longer a reconstruction-error proxy
    Params = SensitivityParams
    # model: sanitize:model; calibration: a calibrate output (data-aware candidates)
    inputs = {"model": Slot(), "calibration": Slot(required=False)}

    def libraries(self) -> dict[str, str]:
        return {name: library_version(name) for name in ("mlx", "mlx-lm", "tokenizers", "numpy")}

    def key_params(self, params: SensitivityParams, inputs=None) -> dict:
        return params.model_dump(mode="json", exclude={"text"})

    def reads(self, params: SensitivityParams, ctx: Context) -> dict[str, Path]:
        return {"text": cal.text_path(params.text, ctx.options.project_root)}

    def run(self, ctx: Context, params: SensitivityParams, inputs) -> dict[str, Artifact]:
        model = inputs["model"][0]
        calibration = (inputs.get("calibration") or [None])[0]
        names = budget.routed_weights(model.tensors)
        if not names:
            raise StepError("sensitivity: the model has no routed-expert weight (*.switch_mlp.*)")
        for name in names:
            if model.tensors[name]["shape"][-1] % params.group_size:
                raise StepError(
                    f"{name}: last dimension {model.tensors[name]['shape'][-1]} "
                    f"is not a multiple of group_size {params.group_size}"
                )
        if "tokenizer.json" not in model.files:
            raise StepError(
                "the model artifact has no tokenizer.json; sensitivity tokenizes with the "
                "source's own"
            )
        path = cal.text_path(params.text, ctx.options.project_root)
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise StepError(f"calibration text {path}: not UTF-8 ({e})") from None
        calib, _ = cal.split_lines(text, params.heldout_every)
        tokens = cal.tokenize(
            ctx.store.get_blob(model.files["tokenizer.json"]), calib, params.max_tokens
        )
        if len(tokens) < 2:
            raise StepError(f"calibration text {path}: {len(tokens)} tokens; it needs more")
        groups = budget.groups_of(names, params.granularity)
        figures = budget.measure(
            ctx.store,
            model,
            calibration,
            groups,
            params.bits,
            params.group_size,
            tokens,
            params.seq_len,
            ctx.progress,
        )
        out = Artifact(
            meta={
                "measure": budget.MEASURE,
                "quantizer": "data-aware" if calibration is not None else "mx.quantize",
                "bits": params.bits,
                "group_size": params.group_size,
                "tokens": len(tokens),
                "granularity": params.granularity,
                "groups": groups,
                "sensitivity": {
                    g: {str(b): v for b, v in sorted(s.items())} for g, s in sorted(figures.items())
                },
            }
        )
        ctx.log(
            f"sensitivity of {len(groups)} groups of routed-expert tensors (per "
            f"{params.granularity}) at bits {params.bits} on {len(tokens)} calibration tokens"
        )
        return {"out": out}
