"""verify: the tensor-level checks a release must pass, each with its figure.

The reference for every check is recomputed from the raw source files, not
taken from the steps under test: norms with mlx's own ``bf16 + 1.0`` (what
mlx_lm's sanitize does), passthrough tensors byte for byte, quantized tensors
by dequantizing and measuring rel-L1 against the source, fused experts by
reassembling them; the numerics are ``buildkit/quant/measures.py``. The report is the
step's output (``verify.json``); any failed check fails the build and names the tensors.

Each check is a function of a ``Subject`` listed in ``CHECKS``, in report order: a new check
is one function and one entry there.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from functools import cached_property
from typing import Any

from pydantic import Field

from buildkit.core.errors import VerifyError
from buildkit.engine.step import Context, Params, Slot, Step, library_version, register
from buildkit.formats import checkpoint as ckpt
from buildkit.formats.checkpoint import PROJS, SWITCH
from buildkit.formats.convert import view
from buildkit.quant.measures import compare_experts, inspect_tensor, layer_expert_errors, task_slice
from buildkit.store.artifact import Artifact

DEFAULT_REL_L1 = {"2": 0.6, "3": 0.3, "4": 0.16, "5": 0.08, "6": 0.045, "8": 0.012}


class VerifyParams(Params):
    max_rel_l1: dict[str, float] = Field(default_factory=lambda: dict(DEFAULT_REL_L1))
    only: str | None = None  # check only the tensors whose MLX names match this glob


def expert_error_figure(
    ctx: Context, heldout: Artifact, parts: list[Artifact], roles_q: dict, expected: dict
) -> tuple[bool, dict, list | None]:
    """(ok, figure, detail): mean relative output error, over the held-out tokens routed to each
    data-aware expert, of the published experts and of data-agnostic ``mx.quantize`` of the same
    source weights at the same bits; data-aware must be lower. One task per MoE layer."""
    model = {k: v for a in parts for k, v in a.tensors.items()}
    fallback: dict[str, list[int]] = {}
    for a in parts:
        fallback.update(a.meta.get("calibration", {}).get("fallback_by_layer", {}))
    problems, tasks = [], []
    for key in sorted(k for k in heldout.tensors if k.endswith(".inputs")):
        sw = key.removesuffix(".inputs")
        layer = sw.removesuffix(SWITCH)
        sources, stored, qargs = {}, {}, {}
        for proj in PROJS:
            module = f"{sw}.{proj}"
            q = roles_q.get(module)
            if q is None or f"{module}.weight" not in expected or f"{module}.scales" not in model:
                problems.append(f"{module}: not a quantized tensor of this model")
                continue
            hf, digest, info, slc, shape = expected[f"{module}.weight"]
            sources[proj] = view(digest, info, shape, slc)  # the raw source file's bytes
            stored[proj] = [model[f"{module}.{k}"] for k in ("weight", "scales", "biases")]
            qargs[proj] = (q["bits"], q["group_size"], q.get("mode", "affine"))
        if len(qargs) < len(PROJS):
            continue
        heldout_entries = {k: heldout.tensors[f"{sw}.{k}"] for k in ("inputs", "experts")}
        skip = sorted(fallback.get(layer, ()))
        tasks.append((layer, (heldout_entries, sources, stored, qargs, skip)))
    figure, more = compare_experts(
        ctx.map(layer_expert_errors, tasks), sum(map(len, fallback.values()))
    )
    problems += more
    return not problems, figure, problems[:20] or None


@dataclass
class Inspection:
    """The per-source-tensor reports (``Inspect``) summed up for the checks that read them."""

    limits: dict[str, float]  # bits -> the highest rel-L1 allowed
    norms: list = field(default_factory=list)
    passes: list = field(default_factory=list)
    nonfinite: list = field(default_factory=list)
    shape_bad: list = field(default_factory=list)
    per_role: dict[str, list[float]] = field(default_factory=dict)
    over: list[str] = field(default_factory=list)
    sampled: dict[str, list[float]] = field(default_factory=dict)
    over_first: list[str] = field(default_factory=list)
    split: dict = field(default_factory=lambda: {"checked": 0, "ok": 0})
    split_bad: list[str] = field(default_factory=list)

    def add(self, r: dict) -> None:
        for name, (bits, err) in r["sampled"].items():
            self.sampled.setdefault(bits, []).append(err)
            if not err <= self.limits.get(bits, 1.0):
                self.over_first.append(f"{name}: {err:.4f} in its first rows")
        self.norms += r["norm"]
        self.passes += r["pass"]
        self.nonfinite += r["nonfinite"]
        self.shape_bad += r["shape_bad"]
        for name, (bits, err) in r["err"].items():
            self.per_role.setdefault(bits, []).append(err)
            if not err <= self.limits.get(bits, 1.0):
                self.over.append(f"{name}: {err:.4f}")
        if r["split"] is not None and r["split"][1] == 0:
            # gate and up alike where compared (all-zero experts): no order to tell them by
            self.split["indistinct"] = self.split.get("indistinct", 0) + 1
        elif r["split"] is not None:
            right, swapped = r["split"]
            ok = right < 0.5 * swapped
            split = self.split
            split["checked"] += 1
            split["ok"] += ok
            split["worst_right"] = max(split.get("worst_right", 0.0), round(right, 5))
            split["best_swapped"] = min(split.get("best_swapped", math.inf), round(swapped, 5))
            if not ok:
                self.split_bad.append(f"{r['hf']}: gate|up {right:.4f} vs up|gate {swapped:.4f}")


@dataclass
class Subject:
    """What verify's checks read: the model under test, every MLX tensor its sources imply,
    and one inspection of every source tensor, made when a check first asks for it."""

    ctx: Context
    params: VerifyParams
    inputs: dict
    full_model: dict[str, dict]  # name -> entry, every tensor of the model
    model: dict[str, dict]  # the tensors in scope (``params.only``)
    roles_q: dict[str, dict]  # module -> its quantization record
    recorded: dict[str, float]  # weight -> rel-L1 quantize measured on what it wrote
    expected: dict[str, tuple]  # MLX name -> (hf name, file digest, info, slice, shape)

    @cached_property
    def inspected(self) -> Inspection:
        """norms, passthrough identity, dequant error, finiteness, split order: one read of
        each source tensor, one task each, handed only its own entries (under --dask they
        travel)."""
        by_hf: dict[str, list] = {}
        for name, (hf, digest, info, slc, shape) in sorted(self.expected.items()):
            by_hf.setdefault(hf, [digest, info, []])[2].append((name, slc, shape))
        items = [(hf, d, info, pieces) for hf, (d, info, pieces) in sorted(by_hf.items())]
        tasks = [
            (it[0], (it, *task_slice(it, self.model, self.roles_q, self.recorded))) for it in items
        ]
        found = Inspection(self.params.max_rel_l1)
        self.ctx.progress.start(len(items))
        for r in self.ctx.map(inspect_tensor, tasks):
            found.add(r)
            self.ctx.progress.advance(1, r["bytes"])
        return found


def expected_tensors(store, inputs: dict, model: dict) -> dict[str, tuple]:
    """Every MLX tensor the sources imply: name -> (hf name, file digest, info, slice, shape);
    the head's from its own source when the model has one."""
    expected: dict[str, tuple] = {}
    trunk_src = inputs["source"][0]
    head_src = (inputs.get("head_source") or [trunk_src])[0]
    has_head = any(n.startswith("language_model.mtp.") for n in model)
    for part, src in (("trunk", trunk_src), ("head", head_src)):
        if part == "head" and not has_head:
            continue
        for hf, (digest, info) in ckpt.scan_source(store, src).items():
            if hf.startswith("mtp.") != (part == "head"):
                continue
            for mlx_name, shape, slc in ckpt.split_experts(hf, info.shape):
                expected[mlx_name] = (hf, digest, info, slc, shape)
    return expected


def subject(ctx: Context, params: VerifyParams, inputs: dict) -> Subject:
    model: dict[str, dict] = {}
    roles_q: dict[str, dict] = {}
    recorded: dict[str, float] = {}
    for art in inputs["model"]:
        model.update(art.tensors)
        roles_q.update(art.meta.get("quantization", {}))
        recorded.update(art.meta.get("rel_l1", {}))
    expected = expected_tensors(ctx.store, inputs, model)
    scoped = model
    if params.only:
        expected = {k: v for k, v in expected.items() if fnmatchcase(k, params.only)}
        scoped = {k: v for k, v in model.items() if fnmatchcase(k, params.only)}
    return Subject(ctx, params, inputs, model, scoped, roles_q, recorded, expected)


# The checks, in report order: each returns (ok, figure, detail or None), or None where it does
# not apply to this build; its name is the function's.
Outcome = tuple[bool, Any, Any] | None


def key_set(s: Subject) -> Outcome:
    """Derived from the source layout and the recorded role of each module."""
    want = set()
    for name in s.expected:
        base = name.removesuffix(".weight")
        if name.endswith(".weight") and base in s.roles_q:
            want |= {f"{base}.weight", f"{base}.scales", f"{base}.biases"}
        else:
            want.add(name)
    missing, extra = sorted(want - set(s.model)), sorted(set(s.model) - want)
    figure = {
        "expected": len(want),
        "actual": len(s.model),
        "mtp_keys": sum(k.startswith("language_model.mtp.") for k in s.model),
    }
    detail = {"missing": missing[:20], "unexpected": extra[:20]} if missing or extra else None
    return not missing and not extra, figure, detail


def norms_shifted_once(s: Subject) -> Outcome:
    bad = [n for n, same in s.inspected.norms if not same]
    return not bad, {"norms": len(s.inspected.norms), "wrong": len(bad)}, bad[:20] or None


def passthrough_identical(s: Subject) -> Outcome:
    bad = [n for n, same in s.inspected.passes if not same]
    return not bad, {"tensors": len(s.inspected.passes), "differ": len(bad)}, bad[:20] or None


def finite(s: Subject) -> Outcome:
    bad = s.inspected.nonfinite
    return not bad, {"non_finite": len(bad)}, bad[:20] or None


def quantized_shapes(s: Subject) -> Outcome:
    bad = s.inspected.shape_bad
    return not bad, {"wrong": len(bad)}, bad[:20] or None


def dequant_rel_l1(s: Subject) -> Outcome:
    figure = {
        f"{b}-bit": {
            "tensors": len(v),
            "mean": round(sum(v) / len(v), 5),
            "max": round(max(v), 5),
            "limit": s.params.max_rel_l1.get(b),
        }
        for b, v in sorted(s.inspected.per_role.items())
    }
    return not s.inspected.over, figure, s.inspected.over[:20] or None


def dequant_rel_l1_first_rows(s: Subject) -> Outcome:
    """The independent measure, where quantize measured every row."""
    if not s.inspected.sampled:
        return None
    figure = {
        f"{b}-bit": {"tensors": len(v), "max": round(max(v), 5)}
        for b, v in sorted(s.inspected.sampled.items())
    }
    return not s.inspected.over_first, figure, s.inspected.over_first[:20] or None


def experts_split_order(s: Subject) -> Outcome:
    split, bad = s.inspected.split, s.inspected.split_bad
    return not bad and (split["checked"] > 0 or "indistinct" in split), split, bad or None


def base_identical(s: Subject) -> Outcome:
    """The base artifacts' weights appear unchanged."""
    if not s.inputs.get("base"):
        return None
    base_t = {k: v for a in s.inputs["base"] for k, v in a.tensors.items()}
    differ = sorted(k for k, v in base_t.items() if s.full_model.get(k) != v)
    return not differ, {"tensors": len(base_t), "differ": len(differ)}, differ[:20] or None


def calibrated_expert_error(s: Subject) -> Outcome:
    """Data-aware experts against data-agnostic ones, on held-out calibration text."""
    if not s.inputs.get("calibration"):
        return None
    return expert_error_figure(
        s.ctx, s.inputs["calibration"][0], s.inputs["model"], s.roles_q, s.expected
    )


CHECKS: list[Callable[[Subject], Outcome]] = [
    key_set,
    norms_shifted_once,
    passthrough_identical,
    finite,
    quantized_shapes,
    dequant_rel_l1,
    dequant_rel_l1_first_rows,
    experts_split_order,
    base_identical,
    calibrated_expert_error,
]


@register
class Verify(Step):
    kind = "verify"
    version = 6  # bump when verify.json's bytes change
    Params = VerifyParams
    inputs = {
        "model": Slot(many=True),  # the artifacts that make up the output model
        "source": Slot(),  # fetch output of the trunk's source
        "head_source": Slot(required=False),  # fetch output the MTP head came from (if any)
        "base": Slot(required=False, many=True),  # artifacts whose tensors must appear unchanged
        "calibration": Slot(required=False),  # calibrate:heldout: measure data-aware experts on it
    }

    def libraries(self) -> dict[str, str]:
        return {"mlx": library_version("mlx")}

    def run(self, ctx: Context, params: VerifyParams, inputs) -> dict[str, Artifact]:
        s = subject(ctx, params, inputs)
        results: dict[str, dict] = {}
        for check in CHECKS:
            outcome = check(s)
            if outcome is not None:
                ok, figure, detail = outcome
                results[check.__name__] = {
                    "ok": bool(ok),
                    "figure": figure,
                    **({"detail": detail} if detail else {}),
                }
        failed = [k for k, v in results.items() if not v["ok"]]
        report = {"checks": results, "ok": not failed, "scope": params.only or "all"}
        blob = json.dumps(report, indent=2, sort_keys=True, default=str).encode()
        out = Artifact(
            files={"verify.json": ctx.store.put_blob(blob)}, meta={"report": json.loads(blob)}
        )
        for name, r in results.items():
            ctx.log(
                f"{'ok  ' if r['ok'] else 'FAIL'} {name}: {json.dumps(r['figure'], default=str)}"
            )
        if failed:
            details = "; ".join(
                f"{k}: "
                + json.dumps(results[k].get("detail") or results[k]["figure"], default=str)[:300]
                for k in failed
            )
            raise VerifyError(f"{len(failed)} check(s) failed: {details}", report=blob)
        return {"out": out}
