"""calibrate: per-expert activation statistics of the bf16 trunk on a calibration text.

Input ``model`` is a sanitize ``:model`` artifact; ``params.text`` names the text
(``builtin:calibration.txt``, shipped in buildkit/data, or a project path). The
text's content digest is part of the key (its path is not). The lines are split
into calibration and held-out lines (every ``heldout_every``-th is held out).

Output ``out``: per MoE layer, ``<layer>.mlp.switch_mlp.tokens`` [E] and, per
routed-expert weight, ``<module>.input_sq_mean`` [E, in] (what quantize weighs
its search with). Output ``heldout``: per MoE layer, the held-out tokens' routed
inputs ``<layer>.mlp.switch_mlp.inputs`` [N, H] (bf16) and the experts chosen
for them ``<layer>.mlp.switch_mlp.experts`` [N, k] (what verify measures expert
output error on).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import Field

from buildkit.core.errors import StepError
from buildkit.core.lazy import lazy
from buildkit.engine.step import (
    Context,
    Params,
    SameBytes,
    Slot,
    Step,
    library_version,
    register,
)
from buildkit.formats import calibstats
from buildkit.formats import checkpoint as ckpt
from buildkit.formats.checkpoint import PROJS, SWITCH
from buildkit.formats.tensors import f32_to_bf16
from buildkit.grade import calibration as cal
from buildkit.grade import texts
from buildkit.store.artifact import Artifact

np = lazy("numpy", __name__)


class CalibrateParams(Params):
    # identity is the content digest (``reads``), not this path
    text: Annotated[str, SameBytes()] = "builtin:calibration.txt"
    heldout_every: int = Field(default=5, ge=2)
    seq_len: int = Field(default=128, ge=2)
    max_tokens: int = Field(default=4096, ge=1)
    max_heldout_tokens: int = Field(default=1024, ge=1)
    # also keep the calibration stream's routed inputs in ``out`` (what GPTQ builds its
    # per-expert Hessians from; ~16 MB a layer on the real model); in the key only when set
    keep_inputs: Annotated[bool, SameBytes(lambda p: not p.keep_inputs)] = False
    # A layer's experts run the fewest whole sequences of the calibration lines that route this
    # many rows to every one of them (the rest skip that layer's experts and every later
    # layer): the search's statistics have settled by then (bench/RESULTS.md, "Calibrate:
    # rows an expert"). 0: every token. Not with keep_inputs (which overrides it): GPTQ's
    # per-expert Hessians want every row.
    rows_per_expert: Annotated[int, SameBytes(lambda p: p.keep_inputs)] = Field(default=128, ge=0)


@register
class Calibrate(Step):
    kind = "calibrate"
    resource = "forward"  # one forward pass at a time (engine/step.py, SharesResource)
    version = 8  # bump when either output's bytes change (7: experts summed; 8: numpy attention)
    Params = CalibrateParams
    inputs = {"model": Slot()}
    outputs = ("out", "heldout")

    def libraries(self) -> dict[str, str]:
        return {name: library_version(name) for name in ("mlx", "mlx-lm", "tokenizers", "numpy")}

    def reads(self, params: CalibrateParams, ctx: Context) -> dict[str, Path]:
        return {"text": texts.text_path(params.text, ctx.options.project_root)}

    def run(self, ctx: Context, params: CalibrateParams, inputs) -> dict[str, Artifact]:
        model = inputs["model"][0]
        path = texts.text_path(params.text, ctx.options.project_root)
        calib, held = texts.lines(path, params.heldout_every)
        if "tokenizer.json" not in model.files:
            raise StepError(
                "the model artifact has no tokenizer.json; "
                "calibration tokenizes with the source's own"
            )
        tok = ctx.store.get_blob(model.files["tokenizer.json"])
        streams = {
            "calibration": texts.tokenize(tok, calib, params.max_tokens),
            "heldout": texts.tokenize(tok, held, params.max_heldout_tokens),
        }
        n_experts = model.meta["config"].get("text_config", model.meta["config"])["num_experts"]
        found = Statistics(ctx.store, n_experts, params.keep_inputs)
        # held out: verify compares each expert on its first HELDOUT_ROWS rows, no more
        enough = {
            "calibration": 0 if params.keep_inputs else params.rows_per_expert,
            "heldout": cal.HELDOUT_ROWS,
        }
        for layer, seen in cal.moe_activations(
            ctx.store, model, streams, params.seq_len, ctx.progress, enough
        ):
            found.add(layer, seen)
        stats, heldout = found.artifacts(len(calib), len(held), streams)
        used, held_used = found.used, found.held_used
        shapes = {k: e["shape"] for k, e in model.tensors.items()}
        ran = [a + b for a, b in zip(used, held_used, strict=True)]  # each layer's tokens
        tflop = ckpt.pass_tflop(model.meta["config"], shapes, ran)
        ctx.log(
            f"{stats.meta['tokens']} calibration tokens (the first layer ran "
            f"{used[0] if used else 0}, the last {used[-1] if used else 0}), "
            f"{heldout.meta['tokens']} held-out (the last layer ran "
            f"{held_used[-1] if held_used else 0}); "
            f"{stats.meta['unreached_experts']} of {stats.meta['experts']} "
            f"experts reached by no token; {ckpt.matmuls(tflop)}"
        )
        return {"out": stats, "heldout": heldout}


class Statistics:
    """calibrate's two outputs, a MoE layer at a time as the forward pass reaches it."""

    def __init__(self, store, n_experts: int, keep_inputs: bool):
        self.store, self.n_experts, self.keep_inputs = store, n_experts, keep_inputs
        self.stats, self.heldout = Artifact(), Artifact()
        self.unreached: dict[str, list[int]] = {}
        self.used: list[int] = []  # calibration tokens each layer ran
        self.held_used: list[int] = []  # held-out tokens each layer ran

    def add(self, layer: str, seen: dict) -> None:
        store, tensors = self.store, self.stats.tensors
        s = cal.expert_stats(seen["calibration"], self.n_experts)
        self.used.append(sum(map(len, seen["calibration"].x)))
        sw = layer + SWITCH
        tensors[calibstats.tokens_name(layer)] = store.put_tensor("I64", s["tokens"])
        for proj in PROJS:
            sq = s["mid_sq"] if proj == "down_proj" else s["in_sq"]
            tensors[calibstats.stat_name(f"{sw}.{proj}")] = store.put_tensor("F32", sq)
        if (s["tokens"] == 0).any():
            self.unreached[layer] = np.flatnonzero(s["tokens"] == 0).tolist()
        if self.keep_inputs:
            x, experts = seen["calibration"].cat()
            tensors[f"{sw}.inputs"] = store.put_tensor("BF16", f32_to_bf16(x))
            tensors[f"{sw}.experts"] = store.put_tensor("I32", experts.astype(np.int32))
        x, experts = seen["heldout"].cat()
        self.held_used.append(len(x))
        self.heldout.tensors[f"{sw}.inputs"] = store.put_tensor("BF16", f32_to_bf16(x))
        self.heldout.tensors[f"{sw}.experts"] = store.put_tensor("I32", experts.astype(np.int32))

    def artifacts(self, lines: int, held_lines: int, streams: dict) -> tuple[Artifact, Artifact]:
        """(out, heldout), each meta describing only its own half of the text, so an edit to
        held-out lines leaves the statistics (and the quantize that reads them) untouched."""
        self.stats.meta = {
            "lines": lines,
            "tokens": len(streams["calibration"]),
            "tokens_by_layer": self.used,
            "statistic": (
                "per-channel E[x^2] of each expert's routed inputs "
                "(gate/up: the MoE input; down: silu(gate x) * up x)"
            ),
            "experts": len(self.used) * self.n_experts,
            "unreached_experts": sum(map(len, self.unreached.values())),
            "unreached_by_layer": self.unreached,
        }
        self.heldout.meta = {
            "lines": held_lines,
            "tokens": len(streams["heldout"]),
            "tokens_by_layer": self.held_used,
        }
        return self.stats, self.heldout
