"""quantize (and requantize): static mixed-precision quantization by architectural role.

Each tensor gets a role from the recipe; a quantized role turns ``X.weight``
into ``X.weight`` (packed uint32), ``X.scales`` and ``X.biases`` with
``mx.quantize``; a passthrough role keeps the entry as it is (a view stays a
view: passthrough bytes are never copied). Tensors stream through a small
thread pool, each in blocks of rows, so memory is a few blocks (never a whole
tensor: the real embedding is 1 GB) and reading, hashing, quantizing and
writing overlap.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping

from pydantic import Field, model_validator

from buildkit.core.errors import StepError
from buildkit.engine.step import Context, Params, Slot, Step, library_version, register
from buildkit.formats.tensors import ITEMSIZE, nbytes
from buildkit.quant import budget, dataaware
from buildkit.quant.quantize import (
    assign_roles,
    module_path,
    output_shapes,
    quantize_entry,
    stored_bits,
)
from buildkit.quant.roles import Recipe, Role
from buildkit.store.artifact import Artifact
from buildkit.store.packs import PackSet, PackWriter


class QuantizeParams(Params):
    recipe: Recipe
    rules: dict[str, str] = Field(
        default_factory=dict
    )  # step-local rules, tried first, must all match
    require_all_rules: bool = True  # every recipe rule must match some tensor of this input

    @model_validator(mode="after")
    def _roles_exist(self):
        for pattern, role in self.rules.items():
            if role not in self.recipe.roles:
                raise ValueError(
                    f"rule {pattern!r} names unknown role {role!r}; "
                    f"roles: {', '.join(self.recipe.roles)}"
                )
        return self


def pack_entry(store, name: str, entry: dict, role: Role, slots: dict) -> dict[str, dict]:
    """One tensor into its slots in the step's packs (a task: ``Context.map``)."""
    w = PackWriter(store, slots)
    if role.passthrough:
        return {name: w.copy(name, entry)}
    return quantize_entry(w, name, entry, role)


def resolved_plan(
    tensors: dict[str, dict], params: QuantizeParams, sensitivity: Artifact | None = None
) -> dict:
    """What a quantizing step does to each tensor, as it enters the key: the roles used (with
    bits, group size, mode) and which tensors take each, in sorted order. Rule syntax and order
    reach the key only through what they resolve to. Under a budget (``recipe.target_bpw``),
    each budgeted tensor takes a role ``<role>@<bits>`` of the bits the plan gave its group,
    and the plan's summary (target, planned bits per weight, each group's bits and
    sensitivities) is under ``budget``."""
    recipe = params.recipe
    roles = assign_roles(sorted(tensors), params)
    table = dict(recipe.roles)
    summary = None
    budgeted = any(recipe.roles[r].budget_bits for r in set(roles.values()))
    if recipe.target_bpw is not None and budgeted:
        if sensitivity is None:
            raise StepError(
                f"recipe.target_bpw = {recipe.target_bpw} needs measured sensitivities: add "
                'inputs.sensitivity = "<a sensitivity step>" to this quantizing step'
            )
        bits, summary = budget.plan(
            tensors, roles, recipe.roles, recipe.target_bpw, sensitivity.meta
        )
        for name, b in bits.items():
            derived = f"{roles[name]}@{b}"
            table[derived] = recipe.roles[roles[name]].model_copy(
                update={"bits": b, "budget_bits": None}
            )
            roles[name] = derived
    used = sorted(set(roles.values()))
    plan = {
        "roles": {r: table[r].key_dump() for r in used},
        "tensors": dict(sorted(roles.items())),  # tensor -> role (canonical JSON sorts it anyway)
    }
    if summary is not None:
        plan["budget"] = summary
    return plan


def task_units(names: list[str], roles: dict[str, str], recipe: Recipe) -> list[tuple[str, ...]]:
    """The tensors each quantize task makes, in order: one each, but a layer's gate_proj and
    up_proj together when both have the same GPTQ role (gptq.pairs)."""
    gptq_roles = {n for n, r in recipe.roles.items() if r.calibrated and r.method == "gptq"}
    if not gptq_roles:
        return [(n,) for n in names]
    from buildkit.quant import gptq

    up_of = {
        g: u
        for g, u in gptq.pairs(names).items()
        if roles[g] == roles[u] and roles[g] in gptq_roles
    }
    ups = set(up_of.values())
    return [(n, up_of[n]) if n in up_of else (n,) for n in names if n not in ups]


def quantize_artifact(
    ctx: Context,
    art: Artifact,
    params: QuantizeParams,
    calibration: Artifact | None = None,
    sensitivity: Artifact | None = None,
) -> Artifact:
    names = sorted(art.tensors)
    plan = resolved_plan(art.tensors, params, sensitivity)
    roles = plan["tensors"]
    recipe = Recipe(roles={r: Role(**d) for r, d in plan["roles"].items()})
    out = Artifact(meta={})
    quant_cfg: dict[str, dict] = {}
    table: dict[str, dict] = {}
    src_params = src_bits = out_bits = 0
    ctx.progress.start(len(names))

    tally = dataaware.check_calibration(recipe, roles, calibration)
    from buildkit.quant import qerror  # numba: only once a step quantizes

    def work(store, *items: tuple) -> dict[str, dict]:
        """One task's tensors, each ``(name, entry, role, slots)``: one tensor, or a layer's
        gate_proj and up_proj under a GPTQ role (they share a Hessian and its factor)."""
        name, entry, role, slots = items[0]
        if role.calibrated and role.method == "gptq":  # error feedback (buildkit/gptq.py)
            from buildkit.quant import gptq  # numba and scipy: only for a GPTQ role

            w = PackWriter(store, {k: v for it in items for k, v in it[3].items()})
            pairs = [(it[0], it[1]) for it in items]
            return gptq.quantize_entries(w, pairs, role, calibration, art.tensors, tally)
        if role.calibrated:  # data-aware routed experts (buildkit/dataaware.py)
            w = PackWriter(store, slots)
            return dataaware.quantize_entry(w, name, entry, role, calibration, tally)
        return pack_entry(store, name, entry, role, slots)

    # Every tensor goes into the packs publish will link (passthrough ones copied), as tasks:
    # on two threads (two tensors in memory, never the model) or, under --dask, on the
    # cluster. Each result is a few small dicts. Data-aware tasks share a tally, so they stay
    # in this process.
    outputs = {
        name: output_shapes(name, art.tensors[name], recipe.roles[roles[name]]) for name in names
    }
    packset = PackSet(ctx.store, {k: v for o in outputs.values() for k, v in o.items()})

    def item(name: str) -> tuple:
        return name, art.tensors[name], recipe.roles[roles[name]], packset.slots_for(outputs[name])

    calibrated = calibration is not None  # check_calibration: then some role is calibrated
    units = [(name,) for name in names]  # the tensors each task makes, in task order
    if calibrated:
        units = task_units(names, roles, recipe)
        tasks = [(u[0], tuple(item(n) for n in u)) for u in units]
        results = ctx.map(work, tasks, local_only=True)
    else:
        results = ctx.map(pack_entry, [(name, item(name)) for name in names])
    written: dict[str, dict] = {}
    rel_l1: dict[str, float] = {}  # weight -> its dequantization error, for verify

    def account(name: str, entries: dict[str, dict]) -> None:
        """A tensor's outputs into the packs, its figures into the step's meta."""
        nonlocal src_params, src_bits, out_bits
        role_name = roles[name]
        role = recipe.roles[role_name]
        for k, e in entries.items():
            err = e.pop(qerror.REL_L1, None)
            if err is not None and math.isfinite(err):  # a NaN source: verify names it
                rel_l1[k] = round(err, 7)
        written.update(entries)
        for i in packset.written(entries):
            packset.finish(i)
        src = art.tensors[name]
        n = 1
        for d in src["shape"]:
            n *= d
        if not role.passthrough:
            quant_cfg[module_path(name)] = role.quant()
        row = table.setdefault(
            role_name, {**role.model_dump(exclude_defaults=True), "tensors": 0, "params": 0}
        )
        row["tensors"] += 1
        row["params"] += n
        src_params += n
        src_bits += 8 * ITEMSIZE[src["dtype"]] * n
        out_bits += stored_bits(entries)
        ctx.progress.advance(1, nbytes(src["dtype"], src["shape"]))

    try:
        with contextlib.closing(results):
            for unit in units:
                made = next(results)
                planned = {k for name in unit for k in outputs[name]}
                if set(made) != planned:
                    raise StepError(
                        f"tensor {' and '.join(map(repr, unit))}: made {sorted(made)}, "
                        f"planned {sorted(planned)}"
                    )
                for name in unit:
                    account(name, {k: made[k] for k in outputs[name]})
    finally:
        packset.discard()  # temp files of packs never completed (a failure)
    out.tensors = {k: packset.entry(k, e) for k, e in sorted(written.items())}
    out.meta = {
        "quantization": quant_cfg,
        "roles": roles,
        "role_table": table,
        "bits_per_weight": round(out_bits / max(src_params, 1), 4),
        "rel_l1": dict(sorted(rel_l1.items())),
        "source_bits_per_weight": round(src_bits / max(src_params, 1), 4),
    }
    if "budget" in plan:
        b = out.meta["budget"] = plan["budget"]  # bits and sensitivity per budgeted group
        ctx.log(f"budget: target {b['target_bpw']} bits per weight, planned {b['bits_per_weight']}")
    if tally:
        out.meta["calibration"] = tally.summary()
        if any(r.method == "gptq" for r in recipe.roles.values()):
            from buildkit.quant import gptq

            out.meta["calibration"]["method"] = gptq.METHOD
        ctx.log(
            f"data-aware: {tally.expert_slices} expert slices; "
            f"{out.meta['calibration']['fallback_experts']} experts "
            "reached by no calibration token fell back"
        )
    ctx.log(
        f"{len(quant_cfg)} quantized, {len(names) - len(quant_cfg)} passthrough, "
        f"{out.meta['bits_per_weight']:.3f} bits per weight"
    )
    return out


@register
class Quantize(Step):
    kind = "quantize"
    # 2: tensors written into packs, the shards publish links (buildkit/packs.py); 3: meta.rel_l1
    # by buildkit's float32 dequantization (qerror.py), not mx.dequantize's bf16-rounded one.
    # Data-aware bytes are versioned by dataaware.METHOD, in key_params' data_aware
    version = 3
    Params = QuantizeParams
    # calibration: a calibrate output; sensitivity: a sensitivity output (for recipe.target_bpw)
    inputs = {
        "model": Slot(),
        "calibration": Slot(required=False),
        "sensitivity": Slot(required=False),
    }
    uses_recipe = True

    def libraries(self) -> dict[str, str]:
        return {"mlx": library_version("mlx")}

    def key_params(self, params: QuantizeParams, inputs: Mapping[str, list[Artifact]]) -> dict:
        """The resolved per-tensor plan, not the rules: two manifests whose rules resolve alike
        share a key, and any difference in what a tensor becomes changes it."""
        plan = resolved_plan(
            inputs["model"][0].tensors, params, (inputs.get("sensitivity") or [None])[0]
        )
        d = {"plan": plan, "require_all_rules": params.require_all_rules}
        if any(v["calibrated"] for v in plan["roles"].values()):
            d["data_aware"] = dataaware.key()  # the search's version and the numpy it runs on
        if any(v.get("method") == "gptq" for v in plan["roles"].values()):
            from buildkit.quant import gptq

            d["gptq"] = gptq.key()
        return d

    def run(self, ctx: Context, params: QuantizeParams, inputs) -> dict[str, Artifact]:
        calibration, sensitivity = (
            (inputs.get(k) or [None])[0] for k in ("calibration", "sensitivity")
        )
        return {"out": quantize_artifact(ctx, inputs["model"][0], params, calibration, sensitivity)}


class RequantizeParams(QuantizeParams):
    require_all_rules: bool = False  # the trunk's rules need not all match a head


@register
class Requantize(Quantize):
    """The same role allocation applied to a grafted head (inherited rules need not all match)."""

    kind = "requantize"
    version = 3  # 2: the head's tensors in a pack of their own (packs.py); 3: as quantize's
    Params = RequantizeParams
