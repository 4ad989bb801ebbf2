"""eval: grade a quantized model by its outputs against the bf16 source, on a held-out text.

Inputs ``model`` (quantize/requantize artifacts), ``source`` (sanitize:model, plus graft
for a head) and ``reference`` (reference nodes: the source's pass over the texts' windows,
computed once per source and text and shared by every variant's eval; one gives the main
text, others domains). The text, its windows and ``max_tokens`` are the reference's
(``steps/reference.py``). The numerics are ``grade/evaluate.py``.

``scope = "trunk"`` (the default) measures KL divergence, top-1 agreement and perplexities
(and acceptance, if the models have heads); output ``trunk`` keeps both trunks' hidden
states, so ``scope = "head"`` (xl-mtp's ``eval_head``, input ``trunk``) grades only the heads
without running the trunks again. Output ``out`` holds ``eval.json``.

Gates (``max_kld_mean``, ``min_acceptance``, ``min_tokens_per_cycle``) fail a ``--release``
build through the engine's release hook (``release_gate``), cached figures or new; they are not
in the key (they change no figure).
"""

from __future__ import annotations

import json
import math
import time
from typing import Annotated, Literal

from pydantic import Field

from buildkit.clients import speculative as spec
from buildkit.core.errors import StepError
from buildkit.core.lazy import lazy
from buildkit.core.requires import require
from buildkit.engine.step import (
    Context,
    Params,
    SameBytes,
    Slot,
    WorldStep,
    library_version,
    register,
)
from buildkit.formats import checkpoint as ckpt
from buildkit.grade import drafting, stats
from buildkit.grade import evaluate as ev
from buildkit.grade import reference as rf
from buildkit.grade.forward import Trunk
from buildkit.grade.weights import StoreWeights
from buildkit.store.artifact import Artifact

np = lazy("numpy", __name__)


def _trunk(p) -> bool:
    return p.scope != "head"


class EvalParams(Params):
    # the text, its windows and max_tokens are the reference input's (``steps/reference.py``)
    # grade windows in rounds until KLD mean's 95% interval is within this share of it (and
    # acceptance within target_acceptance_ci, where this node measures it) or max_tokens
    target_rel_ci: float | None = Field(default=None, gt=0)
    target_acceptance_ci: float = Field(default=0.03, gt=0)
    scope: Literal["trunk", "head"] = "trunk"
    label: str = ""  # names these figures beside others (e.g. "data-agnostic baseline")
    # the figures of scope "head" alone: a trunk's eval measures no drafts
    depth: Annotated[int, SameBytes(_trunk)] = Field(default=3, ge=1, le=16)
    # a verify cycle, in plain decode steps (the yield)
    verify_cost: Annotated[float | list[float], SameBytes(_trunk)] = 1.66
    speculative: Annotated[
        spec.SpeculativeParams | None,
        SameBytes(lambda p: _trunk(p) or p.speculative is None),
    ] = None  # mlx_vlm's own run (scope "head")
    # release gates, judged on the 95% interval (whole interval on the right side)
    max_kld_mean: Annotated[float | None, SameBytes()] = None
    min_acceptance: Annotated[float | None, SameBytes()] = None
    # with ``depth`` drafts, teacher-forced
    min_tokens_per_cycle: Annotated[float | None, SameBytes()] = None

    def key_params(self, inputs=None) -> dict:
        out = super().key_params(inputs)
        if self.scope == "head" and self.speculative is not None:
            out["speculative_version"] = spec.VERSION
        return out


def _ci(report: dict, key: str, k: int | None = None):
    ci = (report.get("ci95") or {}).get(key)
    if k is not None:
        ci = ci[k] if ci and len(ci) > k else None
    return ci


def gate_failures(params: EvalParams, report: dict) -> list[str]:
    """The gates a report does not meet, each said with its figure, interval and limit. A gate
    passes only when the figure's whole 95% interval is on the right side of its limit."""
    bad = []
    if params.max_kld_mean is not None and "kld_mean" in report:
        ci = _ci(report, "kld_mean")
        if ci is None or not ci[1] <= params.max_kld_mean:
            bad.append(_said("kld_mean", report["kld_mean"], ci, ">", params.max_kld_mean))
    if params.min_acceptance is not None:
        acc, ci = report.get("acceptance"), _ci(report, "acceptance")
        if acc is None:
            bad.append("min_acceptance is set but this eval measures no MTP head")
        elif ci is None or not ci[0] >= params.min_acceptance:
            bad.append(_said("acceptance", acc, ci, "<", params.min_acceptance))
    if params.min_tokens_per_cycle is not None:
        tpc = report.get("tokens_per_cycle")
        if not tpc:
            bad.append("min_tokens_per_cycle is set but this eval measures no drafts by depth")
        elif tpc[-1] is None:
            bad.append(
                f"min_tokens_per_cycle: too few drafts at depth {len(tpc)} for a rate "
                f"({report['drafts_by_depth'][-1][1]} tried): grade more tokens"
            )
        else:
            ci = _ci(report, "tokens_per_cycle", len(tpc) - 1)
            if ci is None or not ci[0] >= params.min_tokens_per_cycle:
                what = f"tokens_per_cycle ({len(tpc)} drafts)"
                bad.append(_said(what, tpc[-1], ci, "<", params.min_tokens_per_cycle))
    return bad


def _said(what: str, v: float, ci, op: str, limit: float) -> str:
    gate = {">": "max", "<": "min"}[op]
    name = what.split(" ")[0]
    if ci is None:
        return f"{what} {v:.5g} has no interval (too few windows): grade more tokens"
    side = "<=" if op == ">" else ">="
    return (
        f"{what} {v:.5g} (95% interval [{ci[0]:.5g}, {ci[1]:.5g}]) is not all "
        f"{side} {gate}_{name} {limit:g}"
    )


def spec_fits_now(record: dict | None) -> str | None:
    """Why a cached report whose real-client run was skipped for memory runs again: this
    machine now has the memory it needed (else None)."""
    if not record or "skipped" not in record:
        return None
    free, where = spec.available_memory()
    if record["needed_bytes"] > free:
        return None
    return (
        f"mlx_vlm's speculative run was skipped for memory ({record['needed_bytes'] / spec.GB:.2f} "
        f"GB needed) and {where} now has {free / spec.GB:.2f} GB: run it"
    )


def model_size(parts: list[Artifact]) -> dict:
    """Stored bytes and bits per weight (stored bits / source weights) of the model parts."""
    n = sum(r["params"] for a in parts for r in a.meta.get("role_table", {}).values())
    bits = sum(
        a.meta.get("bits_per_weight", 0)
        * sum(r["params"] for r in a.meta.get("role_table", {}).values())
        for a in parts
    )
    return {
        "size_bytes": sum(a.tensor_bytes() for a in parts),
        "bits_per_weight": round(bits / n, 4) if n else None,
    }


def weights(ctx: Context, inputs) -> tuple[StoreWeights, StoreWeights]:
    from buildkit.quant.quantize import quantization_config

    src = inputs["source"]
    config = src[0].meta["config"]
    tok = src[0].files.get("tokenizer.json")
    return (
        StoreWeights(ctx.store, src, config, None, tok),
        StoreWeights(ctx.store, inputs["model"], config, quantization_config(inputs["model"])),
    )


def _put_trunks(store, trunks, tokens: list[int], text: str) -> Artifact:
    art = Artifact(meta={"tokens": len(tokens), "groups": trunks[0].groups, "text": text})
    art.tensors["tokens"] = store.put_tensor("I32", np.array(tokens, np.int32))
    for who, t in zip(("source", "model"), trunks, strict=False):
        for j, (x0, h) in enumerate(zip(t.x0, t.h, strict=False)):
            art.tensors[f"{who}.x0.{j}"] = store.put_tensor("F32", np.array(x0))
            art.tensors[f"{who}.h.{j}"] = store.put_tensor("F32", np.array(h))
        art.tensors[f"{who}.argmax"] = store.put_tensor(
            "I32", np.concatenate(t.argmax).astype(np.int32)
        )
    return art


def _batch_groups(art: Artifact) -> list[str]:
    """Each kept batch's text ("" the main one)."""
    n = sum(1 for k in art.tensors if k.startswith("model.h."))
    return art.meta.get("groups") or [""] * n


def _get_trunks(store, art: Artifact, group: str) -> tuple[Trunk, Trunk]:
    """Both trunks an eval node kept, their batches of one text: what eval_head holds grows
    with one text, not with all of them (oq4e-mtp-xl keeps four)."""
    import mlx.core as mx

    groups = _batch_groups(art)
    keep = [j for j, g in enumerate(groups) if g == group]
    out = []
    for who in ("source", "model"):
        shapes = [art.tensors[f"{who}.h.{j}"]["shape"] for j in range(len(groups))]
        L = [s[1] for s in shapes for _ in range(s[0])]  # each sequence's length
        am = np.split(store.read_tensor(art.tensors[f"{who}.argmax"]), np.cumsum(L)[:-1])
        first = np.cumsum([0] + [s[0] for s in shapes])  # each batch's first sequence
        t = Trunk(groups=[group] * len(keep))
        for j in keep:
            t.x0.append(mx.array(store.read_tensor(art.tensors[f"{who}.x0.{j}"])))
            t.h.append(mx.array(store.read_tensor(art.tensors[f"{who}.h.{j}"])))
            t.argmax += am[first[j] : first[j + 1]]
        out.append(t)
    return out[0], out[1]


def _head_hits(store, art: Artifact, src, mod, main: dict) -> dict:
    """Each head's hits and positions per window, in the kept windows' order: the main text's
    from its drafts' depth 1 (``main``: "model"/"source" -> ``drafting.drafts_by_depth``'s
    counts, the same draft ``evaluate.head_hits`` makes, so acceptance is d1's rate and the
    output head runs once for both), the domains' by ``head_hits``, one text's trunks loaded
    at a time."""
    groups = _batch_groups(art)
    windows = [
        g for j, g in enumerate(groups) for _ in range(art.tensors[f"model.h.{j}"]["shape"][0])
    ]
    hits = {who: ([0] * len(windows), [0] * len(windows)) for who in ("model", "source")}
    for g in dict.fromkeys(groups):
        at = [i for i, y in enumerate(windows) if y == g]
        if g == "":
            per = {who: drafting.first_draft(counts) for who, counts in main.items()}
        else:
            ts, tm = _get_trunks(store, art, g)
            per = {"model": ev.head_hits(mod, tm), "source": ev.head_hits(src, ts)}
        for who, (hs, ns) in per.items():
            for i, h, n in zip(at, hs, ns, strict=True):
                hits[who][0][i], hits[who][1][i] = h, n
    return {"hits": hits, "windows": windows}


@register
class Eval(WorldStep):
    kind = "eval"
    resource = "forward"  # one forward pass at a time (engine/step.py, SharesResource)
    # 2: streamed forward, KL by running log-sum-exp; text name; domains
    # 3: 95% intervals (block bootstrap), llama.cpp's KLD report, rates only from 30 drafts
    # 4: the source's trunk from a reference node; the trunk output names its text
    # 6: the routed experts' outputs summed expert by expert; 7: attention in numpy
    version = 8  # 8: KL against the reference's head summary where the heads are the same
    Params = EvalParams
    inputs = {
        "model": Slot(many=True),  # the quantized model's artifacts
        "source": Slot(many=True),  # sanitize:model (and graft, for a head): the bf16 weights
        "reference": Slot(many=True, required=False),  # reference nodes (scope "trunk")
        "trunk": Slot(required=False),  # an eval node's trunk output (scope "head")
    }
    outputs = ("out", "trunk")

    def libraries(self) -> dict[str, str]:
        return {name: library_version(name) for name in ("mlx", "mlx-lm", "tokenizers", "numpy")}

    def outdated(
        self, params: EvalParams, outputs: dict[str, Artifact], ctx: Context
    ) -> str | None:
        """A cached report whose real-client run was skipped for memory runs again once this
        machine has the memory (release gates are the release code's: ``release_gate``)."""
        return spec_fits_now(outputs["out"].meta.get("report", {}).get("speculative"))

    def watch(self, params: EvalParams, ctx: Context):
        # nothing outside the store (the texts are the reference's): a run skipped for memory
        # is tried again by a planning build, not by the no-op shortcut (docs/evaluation.md)
        return [], []

    def check_request(self, params: EvalParams, ctx: Context) -> None:
        if params.speculative is not None:  # mlx_vlm's own speculative run is part of the grade
            require("mlx_vlm", "mlx-vlm", f"step {ctx.node!r} (eval, speculative)")

    def release_gate(self, params: EvalParams, outputs: dict[str, Artifact]) -> list[str]:
        return gate_failures(params, outputs["out"].meta.get("report", {}))

    def run(self, ctx: Context, params: EvalParams, inputs) -> dict[str, Artifact]:
        src, mod = weights(ctx, inputs)
        grade = self._heads if params.scope == "head" else self._trunks
        report, trunk = grade(ctx, params, inputs, src, mod)
        report = {"scope": params.scope, "label": params.label, **report}
        for k, v in report.items():
            if isinstance(v, float) and not math.isfinite(v):
                raise StepError(f"eval: {k} is {v}; the forward pass is not finite")
        blob = json.dumps(report, indent=2, sort_keys=True).encode()
        ctx.log(
            "  ".join(
                f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                for k, v in report.items()
                if v != "" and not isinstance(v, dict)
            )
        )
        if bad := gate_failures(params, report):
            ctx.log(f"warning: gate not met ({'; '.join(bad)}); a --release build fails on it")
        return {
            "out": Artifact(files={"eval.json": ctx.store.put_blob(blob)}, meta={"report": report}),
            "trunk": trunk,
        }

    def _heads(self, ctx: Context, params: EvalParams, inputs, src, mod):
        """scope 'head': the heads' drafts on the trunks an eval node kept."""
        if not inputs.get("trunk"):
            raise StepError(
                "scope 'head' grades heads on an eval node's trunks: "
                'give input trunk = "eval:trunk"'
            )
        art = inputs["trunk"][0]
        for who, w in (("model", mod), ("source", src)):
            if not w.has_head():
                raise StepError(
                    f"scope 'head': the {who} input has no MTP head (language_model.mtp.* tensors)"
                )
        tokens = ctx.store.read_tensor(art.tensors["tokens"]).tolist()
        ts, tm = _get_trunks(ctx.store, art, "")  # the drafts run on the main text's batches
        main = drafting.both_counts(src, mod, ts, tm, tokens, params.depth)
        del ts, tm  # the domains' trunks are loaded one text at a time
        got = _head_hits(ctx.store, art, src, mod, main)
        report = {"tokens": art.meta["tokens"]}
        stats.merge(report, ev.heads(got["hits"], got["windows"]))
        depth = drafting.report(
            main["model"], main["source"], len(tokens), params.depth, params.verify_cost
        )
        stats.merge(report, depth)
        report["text"] = art.meta.get("text", "")
        if params.speculative is not None:
            report["speculative"] = self._speculative(ctx, params, inputs, src, tokens)
        trunk = Artifact(meta={"tokens": report["tokens"]})
        return report, trunk

    def _trunks(self, ctx: Context, params: EvalParams, inputs, src, mod):
        """The model against the reference on its texts (the main one and each domain), in
        rounds of its windows until the intervals are narrow enough (``target_rel_ci``) or
        the reference's windows end."""
        ref = reference(ctx.store, inputs)
        main = ref.meta["texts"][""]
        doms = {g: ref.tokens(g) for g in dict.fromkeys(ref.groups) if g}
        ctx.progress.start(ckpt.text_config(mod.config)["num_hidden_layers"], "layers")
        cuts = rounds(ref.tokens(""), ref.meta["seq_len"], params.target_rel_ci is not None)
        m, at = None, 0
        for n in cuts:
            part = ref.part(at, n, domains=m is None)  # the domains are graded whole, first
            more = ev.measure(src, mod, part, progress=ctx.progress)
            m = more if m is None else (m.extend(more) or m)
            report = ev.report(m, {"": n, **doms})
            at = n
            if params.target_rel_ci is not None and narrow_enough(report, params):
                break
        graded = at + sum(doms.values())  # the model's trunk and the output heads ran over these
        # the source's logits are made again only for a model whose head is not the source's
        same = ev.head_from_reference(src, mod, ref)
        tflop = ckpt.pass_tflop(src.config, src.shapes, graded, heads=1 if same else 2)
        how = " (the source's output head from the reference's summary)" if same else ""
        ctx.log(f"{graded} tokens graded{how}: {ckpt.matmuls(tflop)}")
        report |= {"text": main["text"], "text_tokens": main["text_tokens"]}
        report["stopped_by"] = stopped_by(report, params, at, main["text_tokens"])
        report |= model_size(inputs["model"])
        trunk = _put_trunks(ctx.store, (m.ts, m.tm), ref.main_tokens()[:at], main["text"])
        return report, trunk

    @staticmethod
    def _speculative(ctx: Context, params: EvalParams, inputs, src, tokens: list[int]) -> dict:
        """mlx_vlm's speculative run on the model as publish lays it out, if it fits in memory
        (else a record of why not: the build goes on with its teacher-forced figures); any
        output that differs from plain greedy decoding fails the step (so nothing is
        published)."""
        p = params.speculative
        entries = {k: v for a in inputs["model"] for k, v in a.tensors.items()}
        fits = spec.memory_decision(entries)
        if "skipped" in fits:
            ctx.log(
                "warning: mlx_vlm's speculative run is not possible at this size "
                f"({fits['skipped']}); the figures are the teacher-forced ones"
            )
            return {"skipped": fits["skipped"], "needed_bytes": fits["needed_bytes"]}
        prompts = spec.decode_prompts(
            src.tokenizer_json(), spec.prompt_ids(tokens, p.prompts, p.prompt_tokens)
        )
        t0 = time.perf_counter()
        with spec.staged(
            ctx.store, inputs["model"], inputs["source"][0], ctx.store.layout.tmp
        ) as d:
            out = spec.run(d, prompts, params.depth, p)
        seconds = time.perf_counter() - t0
        # the clock varies run to run, the work is the run's count: logged, never in the
        # artifact (locks must reproduce)
        wall, work = out.pop("wall_ratio_cpu"), out.pop("positions")
        ctx.log(
            f"mlx_vlm speculative: {work} positions run in {seconds:.1f} s (staging included)"
            + (f" (stopped early: {out['stopped_early']})" if "stopped_early" in out else "")
            + "; wall-clock against plain decoding on this CPU: "
            + ", ".join(f"{x:.2f}x" for x in wall)
        )
        if not out["lossless"]:
            raise StepError(
                "speculative decoding is not lossless: with the mtp/ drafter, mlx_vlm's greedy "
                f"output differs from plain greedy decoding ({'; '.join(out['mismatches'][:3])}); "
                "the head or the trunk's published bytes are wrong"
            )
        return out


def reference(store, inputs) -> rf.Reference:
    """The reference inputs as one, with a main text."""
    if not inputs.get("reference"):
        raise StepError(
            "eval grades against the source's reference: give input "
            'reference = ["reference"] (a step of kind "reference" on sanitize:model)'
        )
    ref = rf.get(store, inputs["reference"])
    if "" not in ref.groups:
        raise StepError("eval: no reference input has a main text (its params.text)")
    return ref


def rounds(n_tokens: int, seq_len: int, adaptive: bool) -> list[int]:
    """The token counts graded after each round: all at once, or (``adaptive``) 8 windows, then
    doubling, each cut at a whole window, the last at ``n_tokens``."""
    if not adaptive:
        return [n_tokens]
    out, n = [], 8 * seq_len
    while n < n_tokens:
        out.append(n)
        n *= 2
    return [*out, n_tokens]


def narrow_enough(report: dict, params: EvalParams) -> bool:
    """Whether KLD mean's interval is within ``target_rel_ci`` of it and (if measured here)
    acceptance's within ``target_acceptance_ci`` points."""
    ci = report.get("ci95", {})
    rel = stats.rel_half_width(report["kld_mean"], ci.get("kld_mean"))
    if rel is None or rel > params.target_rel_ci:
        return False
    if "acceptance" in report:
        h = stats.half_width(ci.get("acceptance"))
        return h is not None and h <= params.target_acceptance_ci
    return True


def stopped_by(report: dict, params: EvalParams, graded: int, in_text: int) -> str:
    """What ended grading: the interval target, ``max_tokens`` or the end of the text."""
    if params.target_rel_ci is not None and narrow_enough(report, params):
        return f"target_rel_ci {params.target_rel_ci:g} reached"
    if graded >= in_text:
        return "the whole text"
    return f"max_tokens {graded}"  # the reference's windows ended
