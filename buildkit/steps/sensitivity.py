"""sensitivity: how much the model's outputs move when a layer's routed experts are quantized lower.

For each group of routed-expert tensors (``granularity``: a layer's gate, up and down, or each
tensor alone) and each candidate bits, the mean KL divergence from the bf16 source on the
calibration lines of ``params.text`` (split as calibrate splits it; the held-out lines, which
eval grades on, are never used) with that group alone quantized as the build quantizes it
(data-aware with input ``calibration``'s statistics, or ``mx.quantize`` without that input).
Measured once per source and text: the key has the model, the calibration, the text's content
digest and these params, never a budget, so a new ``target_bpw`` re-plans quantize without
re-measuring. The figures are in ``meta`` (no tensors); the numerics are in
``buildkit/quant/budget.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator

from buildkit.core.errors import StepError
from buildkit.engine.step import (
    Context,
    Inherit,
    Params,
    SameBytes,
    Slot,
    Step,
    library_version,
    register,
)
from buildkit.formats import checkpoint as ckpt
from buildkit.formats.checkpoint import SWITCH
from buildkit.grade import sensitivity as sens
from buildkit.grade import texts
from buildkit.grade.weights import StoreWeights
from buildkit.quant import budget
from buildkit.quant.roles import BF16, BITS, Recipe, Role
from buildkit.store.artifact import Artifact


class SensitivityParams(Params):
    # the manifest's: the roles with budget_bits are measured; only what it makes measured
    # changes the bytes (``key_params``), never target_bpw
    recipe: Annotated[Recipe, Inherit(top="recipe"), SameBytes()] = Recipe()
    # candidate bits; a group is measured at those of them its role's budget_bits lists
    bits: list[int] = Field(default_factory=lambda: [3, 4, 6, 8])
    group_size: int = Field(default=64, ge=16)
    # identity is the content digest, not this path; unset: the calibration input's text
    text: Annotated[
        str | None, Inherit(slot="calibration", fallback=texts.DEFAULT), SameBytes()
    ] = None
    heldout_every: int = Field(default=5, ge=2)  # as calibrate's: only its calibration lines
    seq_len: int = Field(default=128, ge=2)
    # tokens the KL is measured on; the bf16 log-probabilities are kept: tokens x vocab x 4 bytes
    max_tokens: int = Field(default=2048, ge=2)
    # one bits per layer's routed experts (gate, up, down), or per tensor: bench/RESULTS.md,
    # "Budget against uniform"
    granularity: Literal["layer", "tensor"] = "layer"
    # measured: every candidate through every later layer (exact, ~L/2 layer passes each);
    # local: each candidate's own layer's output error times a gain probed at ``probes`` layers
    # (~1 layer pass each); auto: measured where it costs at most AUTO_RATIO x local and holds
    # at most AUTO_MEMORY
    method: Literal["auto", "measured", "local"] = "auto"
    probes: int = Field(default=4, ge=1)

    @field_validator("bits")
    @classmethod
    def _bits(cls, v: list[int]) -> list[int]:
        if not v or any(b not in (*BITS, BF16) for b in v):
            raise ValueError(
                f"bits must be a non-empty list of {', '.join(map(str, BITS))} or {BF16} (bf16)"
            )
        return sorted(set(v))

    def key_params(self, inputs=None) -> dict:
        """The params but the text (its content digest is the fingerprint) and the recipe, of
        which only what it makes measured enters: each group's tensors and candidate bits
        (never target_bpw, so a new budget re-plans without re-measuring)."""
        d = super().key_params(inputs)
        method, probes = d.pop("method"), d.pop("probes")
        if inputs and inputs.get("model"):
            model = inputs["model"][0]
            groups = measured(self, model.tensors)
            if not _default(self, model.tensors, groups):
                d["measured"] = groups
            method = resolved(self, model.meta["config"], model.tensors, groups)
        # measured's keys are those from before the choice existed; auto, with no model to
        # decide on, keys as what it decides on small models
        if method == "local":
            d |= {"method": method, "probes": probes}
        return d


def measured(params: SensitivityParams, tensors: dict[str, dict]) -> dict[str, dict]:
    """group -> {"tensors": [...], "bits": [...]}: the tensors whose role in ``params.recipe``
    has budget_bits, grouped (``granularity``), each group at the candidate bits its role's
    budget_bits lists; with no budget_bits in the recipe, every routed expert at every bits."""
    recipe = params.recipe
    if not any(r.budget_bits for r in recipe.roles.values()):
        names = budget.routed_weights(tensors)
        return {
            g: {"tensors": ns, "bits": params.bits}
            for g, ns in budget.groups_of(names, params.granularity).items()
        }
    roles = {n: hit[1] for n in sorted(tensors) if (hit := recipe.match(n))}
    names = budget.budgeted_weights(tensors, roles, recipe.roles)
    out = {}
    for g, ns in budget.groups_of(names, params.granularity).items():
        allowed = set().union(*(recipe.roles[roles[n]].budget_bits for n in ns))
        out[g] = {"tensors": ns, "bits": [b for b in params.bits if b in allowed]}
    return out


# auto measures every candidate where that costs at most this many times local's layer passes:
# small models (4 layers: ~2x), never the real one (40 layers: ~17x)
AUTO_RATIO = 4
# ... and holds at most this: a build stays under 2 GB. By the model's shapes, not this
# machine's memory, so every machine keys the step alike (a shallow 35B-wide model: ~14 GB)
AUTO_MEMORY = 1_000_000_000


def resolved(params: SensitivityParams, config: dict, tensors: dict, plan: dict) -> str:
    """``params.method``, auto decided on this model by the two methods' decoder-layer passes
    and by what measured would hold (``budget.measured_bytes`` at ``max_tokens``)."""
    if params.method != "auto":
        return params.method
    if budget.measured_bytes(config, tensors, params.max_tokens) > AUTO_MEMORY:
        return "local"
    groups = {g: p["tensors"] for g, p in plan.items()}
    bits = {g: p["bits"] for g, p in plan.items()}
    passes = {
        m: budget.cost(config, tensors, groups, bits, 1, m, params.probes)["layer_passes"]
        for m in ("measured", "local")
    }
    return "measured" if passes["measured"] <= AUTO_RATIO * passes["local"] else "local"


def measure(
    ctx: Context, params: SensitivityParams, method: str, model, calibration, groups, bits, tokens
):
    """Each group's KL at its quantized bits (``grade.sensitivity``, ``method``), the
    candidates quantized as the build quantizes them (data-aware routed experts if
    ``calibration`` is given); with local, the gains by layer too."""

    def role(name: str, b: int) -> Role:
        expert = SWITCH in name and calibration is not None
        return Role(bits=b, group_size=params.group_size, calibrated=expert)

    w = StoreWeights(ctx.store, [model], model.meta["config"], None)
    quantized = {g: [b for b in bs if b != BF16] for g, bs in bits.items()}
    if method == "local":  # at any size: candidates made a block of rows at a time
        layers = [budget.layer_index(ns[0]) for ns in groups.values()]
        n = ckpt.text_config(model.meta["config"])["num_hidden_layers"]
        probes = budget.probed([i for i in layers if i < n], params.probes)

        def blocks(name: str, b: int, rows: int, pick=None):
            made = role(name, b)
            return budget.dequantized_rows(ctx.store, model, name, made, calibration, rows, pick)

        args = (w, groups, quantized, budget.layer_index, blocks, tokens, params.seq_len)
        return sens.local(*args, probes=probes, progress=ctx.progress)

    def candidate(name: str, b: int):
        return budget.dequantized(ctx.store, model, name, role(name, b), calibration)

    args = (w, groups, quantized, budget.layer_index, candidate, tokens, params.seq_len)
    return sens.measure(*args, progress=ctx.progress), None


def check(params: SensitivityParams, model, plan: dict) -> None:
    """Refuse, naming what is wrong, a plan with nothing to measure, a tensor whose rows do not
    split into groups, or a model without its tokenizer."""
    names = [n for g in plan.values() for n in g["tensors"]]
    if not names:
        raise StepError(
            "sensitivity: nothing to measure: the model has no routed-expert weight "
            "(*.switch_mlp.*) and no role of the recipe has budget_bits"
        )
    for name in names:
        if model.tensors[name]["shape"][-1] % params.group_size:
            raise StepError(
                f"{name}: last dimension {model.tensors[name]['shape'][-1]} "
                f"is not a multiple of group_size {params.group_size}"
            )
    if "tokenizer.json" not in model.files:
        raise StepError(
            "the model artifact has no tokenizer.json; sensitivity tokenizes with the source's own"
        )


def _default(params: SensitivityParams, tensors: dict[str, dict], groups: dict) -> bool:
    """Whether ``groups`` is the default measurement, every routed expert at every candidate
    bits, which ``bits`` and ``granularity`` in the key already say: then it adds nothing."""
    names = budget.routed_weights(tensors)
    return groups == {
        g: {"tensors": ns, "bits": params.bits}
        for g, ns in budget.groups_of(names, params.granularity).items()
    }


@register
class Sensitivity(Step):
    kind = "sensitivity"
    resource = "forward"  # one forward pass at a time (engine/step.py, SharesResource)
    version = 6  # 2: the KL of the outputs, not a proxy; 4: experts summed; 5: numpy attention;
    # 6: local fits KL as a power of the error (two candidates a probed group)
    Params = SensitivityParams
    # model: sanitize:model; calibration: a calibrate output (data-aware candidates)
    inputs = {"model": Slot(), "calibration": Slot(required=False)}

    def libraries(self) -> dict[str, str]:
        return {name: library_version(name) for name in ("mlx", "mlx-lm", "tokenizers", "numpy")}

    def reads(self, params: SensitivityParams, ctx: Context) -> dict[str, Path]:
        return {"text": texts.text_path(params.text or texts.DEFAULT, ctx.options.project_root)}

    def run(self, ctx: Context, params: SensitivityParams, inputs) -> dict[str, Artifact]:
        model = inputs["model"][0]
        calibration = (inputs.get("calibration") or [None])[0]
        plan = measured(params, model.tensors)
        check(params, model, plan)
        path = texts.text_path(params.text or texts.DEFAULT, ctx.options.project_root)
        calib, _ = texts.split_lines(texts.read(path), params.heldout_every)
        tokens = texts.tokenize(
            ctx.store.get_blob(model.files["tokenizer.json"]), calib, params.max_tokens
        )
        if len(tokens) < 2:
            raise StepError(f"calibration text {path}: {len(tokens)} tokens; it needs more")
        groups = {g: p["tensors"] for g, p in plan.items()}
        bits = {g: p["bits"] for g, p in plan.items()}
        method = resolved(params, model.meta["config"], model.tensors, plan)
        cost = budget.cost(
            model.meta["config"], model.tensors, groups, bits, len(tokens), method, params.probes
        )
        shapes = {k: e["shape"] for k, e in model.tensors.items()}
        # the source's own pass beside the candidates' (measured: its log-probabilities too)
        own = ckpt.pass_tflop(model.meta["config"], shapes, len(tokens), method == "measured")
        ctx.log(
            f"{cost['candidates']} candidates ({method}): {cost['layer_passes']} decoder-layer "
            f"passes and {cost['head_passes']} output-head passes over {len(tokens)} tokens, "
            f"{ckpt.matmuls(cost['tflop'] + own)} with the source's own pass"
        )
        figures, gains = measure(ctx, params, method, model, calibration, groups, bits, tokens)
        for g, bs in bits.items():
            if BF16 in bs:
                figures[g][BF16] = 0.0  # the source itself: no divergence
        meta = {
            "measure": budget.MEASURE if method == "measured" else budget.LOCAL,
            "method": method,
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
        out = Artifact(meta=meta | ({"gains": gains} if gains else {}))
        ctx.log(
            f"sensitivity ({method}) of {len(groups)} groups of tensors "
            f"(per {params.granularity}) at bits {params.bits} on {len(tokens)} calibration tokens"
        )
        return {"out": out}
