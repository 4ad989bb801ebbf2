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

from pydantic import Field

from buildkit.core.errors import StepError
from buildkit.core.lazy import lazy
from buildkit.engine.step import Context, Params, Slot, Step, library_version, register
from buildkit.formats.tensors import f32_to_bf16
from buildkit.grade import calibration as cal
from buildkit.store.artifact import Artifact

np = lazy("numpy", __name__)


class CalibrateParams(Params):
    text: str = "builtin:calibration.txt"  # identity is the content digest, not this path
    heldout_every: int = Field(default=5, ge=2)
    seq_len: int = Field(default=128, ge=2)
    max_tokens: int = Field(default=4096, ge=1)
    max_heldout_tokens: int = Field(default=1024, ge=1)
    # also keep the calibration stream's routed inputs in ``out`` (what GPTQ builds its
    # per-expert Hessians from; ~16 MB a layer on the real model)
    keep_inputs: bool = False
    # A layer's experts run the fewest whole sequences of the calibration lines that route this
    # many rows to every one of them (the rest skip that layer's experts and every later
    # layer): the search's statistics have settled by then (bench/RESULTS.md, "oq4e speed").
    # 0: every token. Not with keep_inputs: GPTQ's per-expert Hessians want every row.
    rows_per_expert: int = Field(default=128, ge=0)


@register
class Calibrate(Step):
    kind = "calibrate"
    # 2: the forward's matmuls in numpy's BLAS, statistics summed per expert as rows pass;
    # 3: a layer stops at rows_per_expert routed rows an expert (meta.tokens_by_layer);
    # 4: decided from the router's choices on whole sequences, the stream in one batch;
    # 5: the held-out stream stops alike at calibration.HELDOUT_ROWS rows an expert (what
    #    verify compares each expert on)
    version = 5
    Params = CalibrateParams
    inputs = {"model": Slot()}
    outputs = ("out", "heldout")

    def libraries(self) -> dict[str, str]:
        return {name: library_version(name) for name in ("mlx", "mlx-lm", "tokenizers", "numpy")}

    def key_params(self, params: CalibrateParams, inputs=None) -> dict:
        # keep_inputs only when set (calibrations without it keep their keys), and then not
        # rows_per_expert, which it overrides
        drop = {"rows_per_expert"} if params.keep_inputs else {"keep_inputs"}
        return params.model_dump(mode="json", exclude={"text"} | drop)

    def reads(self, params: CalibrateParams, ctx: Context) -> dict[str, Path]:
        return {"text": cal.text_path(params.text, ctx.options.project_root)}

    def run(self, ctx: Context, params: CalibrateParams, inputs) -> dict[str, Artifact]:
        model = inputs["model"][0]
        path = cal.text_path(params.text, ctx.options.project_root)
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise StepError(f"calibration text {path}: not UTF-8 ({e})") from None
        calib, held = cal.split_lines(text, params.heldout_every)
        if not calib or not held:
            raise StepError(
                f"calibration text {path}: {len(calib)} calibration and {len(held)} "
                "held-out lines; "
                f"it needs at least {params.heldout_every} non-blank lines"
            )
        if "tokenizer.json" not in model.files:
            raise StepError(
                "the model artifact has no tokenizer.json; "
                "calibration tokenizes with the source's own"
            )
        tok = ctx.store.get_blob(model.files["tokenizer.json"])
        streams = {
            "calibration": cal.tokenize(tok, calib, params.max_tokens),
            "heldout": cal.tokenize(tok, held, params.max_heldout_tokens),
        }
        n_experts = model.meta["config"].get("text_config", model.meta["config"])["num_experts"]
        stats, heldout = Artifact(), Artifact()
        unreached: dict[str, list[int]] = {}
        layers = 0
        # held out: verify compares each expert on its first HELDOUT_ROWS rows, no more
        enough = {
            "calibration": 0 if params.keep_inputs else params.rows_per_expert,
            "heldout": cal.HELDOUT_ROWS,
        }
        used, held_used = [], []  # calibration and held-out tokens each layer ran
        for layer, seen in cal.moe_activations(
            ctx.store, model, streams, params.seq_len, ctx.progress, enough
        ):
            s = cal.expert_stats(seen["calibration"], n_experts)
            used.append(sum(map(len, seen["calibration"].x)))
            layers += 1
            sw = layer + cal.SWITCH
            stats.tensors[cal.tokens_name(layer)] = ctx.store.put_tensor("I64", s["tokens"])
            for proj in cal.PROJS:
                sq = s["mid_sq"] if proj == "down_proj" else s["in_sq"]
                stats.tensors[cal.stat_name(f"{sw}.{proj}")] = ctx.store.put_tensor("F32", sq)
            if (s["tokens"] == 0).any():
                unreached[layer] = np.flatnonzero(s["tokens"] == 0).tolist()
            if params.keep_inputs:
                x, experts = seen["calibration"].cat()
                stats.tensors[f"{sw}.inputs"] = ctx.store.put_tensor("BF16", f32_to_bf16(x))
                stats.tensors[f"{sw}.experts"] = ctx.store.put_tensor(
                    "I32", experts.astype(np.int32)
                )
            x, experts = seen["heldout"].cat()
            held_used.append(len(x))
            heldout.tensors[f"{sw}.inputs"] = ctx.store.put_tensor("BF16", f32_to_bf16(x))
            heldout.tensors[f"{sw}.experts"] = ctx.store.put_tensor("I32", experts.astype(np.int32))
        # Each output's meta describes only its own half of the text, so an edit to held-out
        # lines leaves the statistics (and the quantize that reads them) untouched.
        stats.meta = {
            "lines": len(calib),
            "tokens": len(streams["calibration"]),
            "tokens_by_layer": used,
            "statistic": (
                "per-channel E[x^2] of each expert's routed inputs "
                "(gate/up: the MoE input; down: silu(gate x) * up x)"
            ),
            "experts": layers * n_experts,
            "unreached_experts": sum(map(len, unreached.values())),
            "unreached_by_layer": unreached,
        }
        heldout.meta = {
            "lines": len(held),
            "tokens": len(streams["heldout"]),
            "tokens_by_layer": held_used,
        }
        ctx.log(
            f"{stats.meta['tokens']} calibration tokens (the first layer ran "
            f"{used[0] if used else 0}, the last {used[-1] if used else 0}), "
            f"{heldout.meta['tokens']} held-out (the last layer ran "
            f"{held_used[-1] if held_used else 0}); "
            f"{stats.meta['unreached_experts']} of {stats.meta['experts']} "
            "experts reached by no token"
        )
        return {"out": stats, "heldout": heldout}
