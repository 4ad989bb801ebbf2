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
from collections.abc import Iterator, Mapping
from typing import Annotated

from pydantic import Field, model_validator

from buildkit.core.errors import StepError, UsageError
from buildkit.engine.step import (
    Context,
    Inherit,
    Params,
    Slot,
    Step,
    library_version,
    register,
)
from buildkit.formats.tensors import ITEMSIZE, nbytes
from buildkit.quant import budget, dataaware
from buildkit.quant import estimate as quant_estimate
from buildkit.quant.quantize import (
    assign_roles,
    module_path,
    output_shapes,
    quantize_entry,
    stored_bits,
)
from buildkit.quant.roles import BF16, Recipe, Role
from buildkit.store.artifact import Artifact
from buildkit.store.packs import PackSet, PackWriter


class QuantizeParams(Params):
    recipe: Annotated[Recipe, Inherit(top="recipe")]  # the manifest's, this step's merged over
    rules: dict[str, str] = Field(
        default_factory=dict
    )  # step-local rules, tried first, must all match
    require_all_rules: bool = True  # every recipe rule must match some tensor of this input
    # recipe.target_bpw applies (requantize: no, a grafted head takes its roles' own bits)
    budget: bool = True

    @model_validator(mode="after")
    def _roles_exist(self):
        for pattern, role in self.rules.items():
            if role not in self.recipe.roles:
                raise ValueError(
                    f"rule {pattern!r} names unknown role {role!r}; "
                    f"roles: {', '.join(self.recipe.roles)}"
                )
        return self

    def key_params(self, inputs: Mapping[str, list[Artifact]] | None = None) -> dict:
        """The resolved per-tensor plan, not the rules: two manifests whose rules resolve alike
        share a key, and any difference in what a tensor becomes changes it."""
        plan = resolved_plan(
            inputs["model"][0].tensors, self, (inputs.get("sensitivity") or [None])[0]
        )
        d = {"plan": plan, "require_all_rules": self.require_all_rules}
        if any(v["calibrated"] for v in plan["roles"].values()):
            d["data_aware"] = dataaware.key()  # the search's version and the numpy it runs on
        if any(v.get("method") == "gptq" for v in plan["roles"].values()):
            from buildkit.quant import gptq

            d["gptq"] = gptq.key()
        return d


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
    if not params.budget:  # its roles' own bits, keyed as if no budget_bits were given
        table = {k: r.model_copy(update={"budget_bits": None}) for k, r in table.items()}
    elif recipe.target_bpw is not None and budgeted:
        if sensitivity is None:
            raise StepError(
                f"recipe.target_bpw = {recipe.target_bpw} needs measured sensitivities: add "
                'inputs.sensitivity = "<a sensitivity step>" to this quantizing step'
            )
        bits, summary = budget.plan(
            tensors, roles, recipe.roles, recipe.target_bpw, sensitivity.meta
        )
        for name, b in bits.items():
            derived = f"{roles[name]}@{'bf16' if b == BF16 else b}"
            table[derived] = recipe.roles[roles[name]].at(b)
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


def calibrated_task(store, tensors: dict, calibration: Artifact, tally, *items: tuple) -> dict:
    """One task's tensors under a calibrated recipe, each ``(name, entry, role, slots)``: one
    tensor, or a layer's gate_proj and up_proj under a GPTQ role (they share a Hessian and its
    factor). ``tensors``: the step's input tensors; ``tally``: the data-aware figures."""
    name, entry, role, slots = items[0]
    if role.calibrated and role.method == "gptq":  # error feedback (quant/gptq.py)
        from buildkit.quant import gptq  # numba and scipy: only for a GPTQ role

        w = PackWriter(store, {k: v for it in items for k, v in it[3].items()})
        pairs = [(it[0], it[1]) for it in items]
        return gptq.quantize_entries(w, pairs, role, calibration, tensors, tally)
    if role.calibrated:  # data-aware routed experts (quant/dataaware.py)
        w = PackWriter(store, slots)
        return dataaware.quantize_entry(w, name, entry, role, calibration, tally)
    return pack_entry(store, name, entry, role, slots)


class QuantizeRun:
    """One artifact through a quantizing step: its tasks, their outputs into the packs as they
    come back, and the figures the output's meta reports."""

    def __init__(self, ctx: Context, art: Artifact, plan: dict, calibration: Artifact | None):
        from buildkit.quant import qerror  # numba: only once a step quantizes

        self.ctx, self.art, self.calibration = ctx, art, calibration
        self.rel_l1_key = qerror.REL_L1
        self.names = sorted(art.tensors)
        self.roles = plan["tensors"]
        self.recipe = Recipe(roles={r: Role(**d) for r, d in plan["roles"].items()})
        self.tally = dataaware.check_calibration(self.recipe, self.roles, calibration)
        self.outputs = {
            n: output_shapes(n, art.tensors[n], self.recipe.roles[self.roles[n]])
            for n in self.names
        }
        self.packset = PackSet(
            ctx.store, {k: v for o in self.outputs.values() for k, v in o.items()}
        )
        self.written: dict[str, dict] = {}
        self.rel_l1: dict[str, float] = {}  # weight -> its dequantization error, for verify
        self.quant_cfg: dict[str, dict] = {}
        self.table: dict[str, dict] = {}
        self.src_params = self.src_bits = self.out_bits = 0

    def item(self, name: str) -> tuple:
        role = self.recipe.roles[self.roles[name]]
        return name, self.art.tensors[name], role, self.packset.slots_for(self.outputs[name])

    def start(self) -> tuple[list[tuple[str, ...]], Iterator]:
        """(the tensors each task makes, in task order; the tasks' results, in that order).

        Every tensor goes into the packs publish will link (passthrough ones copied), as tasks:
        on two threads (two tensors in memory, never the model) or, under --dask, on the
        cluster. Each result is a few small dicts. Data-aware tasks share a tally, so they stay
        in this process."""
        if self.calibration is None:
            tasks = [(n, self.item(n)) for n in self.names]
            return [(n,) for n in self.names], self.ctx.map(pack_entry, tasks)
        units = task_units(self.names, self.roles, self.recipe)
        shared = (self.art.tensors, self.calibration, self.tally)
        tasks = [(u[0], (*shared, *(self.item(n) for n in u))) for u in units]
        return units, self.ctx.map(calibrated_task, tasks, local_only=True)

    def collect(self) -> None:
        units, results = self.start()
        try:
            with contextlib.closing(results):
                for unit in units:
                    made = next(results)
                    planned = {k for name in unit for k in self.outputs[name]}
                    if set(made) != planned:
                        raise StepError(
                            f"tensor {' and '.join(map(repr, unit))}: made {sorted(made)}, "
                            f"planned {sorted(planned)}"
                        )
                    for name in unit:
                        self.account(name, {k: made[k] for k in self.outputs[name]})
        finally:
            self.packset.discard()  # temp files of packs never completed (a failure)

    def account(self, name: str, entries: dict[str, dict]) -> None:
        """A tensor's outputs into the packs, its figures into the step's meta."""
        role_name = self.roles[name]
        role = self.recipe.roles[role_name]
        for k, e in entries.items():
            err = e.pop(self.rel_l1_key, None)
            if err is not None and math.isfinite(err):  # a NaN source: verify names it
                self.rel_l1[k] = round(err, 7)
        self.written.update(entries)
        for i in self.packset.written(entries):
            self.packset.finish(i)
        src = self.art.tensors[name]
        n = math.prod(src["shape"])
        if not role.passthrough:
            self.quant_cfg[module_path(name)] = role.quant()
        row = self.table.setdefault(
            role_name, {**role.model_dump(exclude_defaults=True), "tensors": 0, "params": 0}
        )
        row["tensors"] += 1
        row["params"] += n
        self.src_params += n
        self.src_bits += 8 * ITEMSIZE[src["dtype"]] * n
        self.out_bits += stored_bits(entries)
        self.ctx.progress.advance(1, nbytes(src["dtype"], src["shape"]))

    def artifact(self, plan: dict) -> Artifact:
        out = Artifact(meta={})
        out.tensors = {k: self.packset.entry(k, e) for k, e in sorted(self.written.items())}
        out.meta = {
            "quantization": self.quant_cfg,
            "roles": self.roles,
            "role_table": self.table,
            "bits_per_weight": round(self.out_bits / max(self.src_params, 1), 4),
            "rel_l1": dict(sorted(self.rel_l1.items())),
            "source_bits_per_weight": round(self.src_bits / max(self.src_params, 1), 4),
        }
        if "budget" in plan:
            out.meta["budget"] = plan["budget"]  # bits and sensitivity per budgeted group
        if self.tally:
            out.meta["calibration"] = self.tally.summary()
            if any(r.method == "gptq" for r in self.recipe.roles.values()):
                from buildkit.quant import gptq

                out.meta["calibration"]["method"] = gptq.METHOD
        return out


def quantize_artifact(
    ctx: Context,
    art: Artifact,
    params: QuantizeParams,
    calibration: Artifact | None = None,
    sensitivity: Artifact | None = None,
) -> Artifact:
    plan = resolved_plan(art.tensors, params, sensitivity)
    ctx.progress.start(len(art.tensors))
    run = QuantizeRun(ctx, art, plan, calibration)
    run.collect()
    out = run.artifact(plan)
    if "budget" in plan:
        b = plan["budget"]
        ctx.log(f"budget: target {b['target_bpw']} bits per weight, planned {b['bits_per_weight']}")
    if run.tally:
        ctx.log(
            f"data-aware: {run.tally.expert_slices} expert slices; "
            f"{out.meta['calibration']['fallback_experts']} experts "
            "reached by no calibration token fell back"
        )
    ctx.log(
        f"{len(run.quant_cfg)} quantized, {len(run.names) - len(run.quant_cfg)} passthrough, "
        f"{out.meta['bits_per_weight']:.3f} bits per weight"
    )
    return out


@register
class Quantize(Step):
    kind = "quantize"
    # bump when the output's bytes change; the search's and GPTQ's are versioned by their
    # METHOD, in QuantizeParams.key_params
    version = 3
    Params = QuantizeParams
    # calibration: a calibrate output; sensitivity: a sensitivity output (for recipe.target_bpw)
    inputs = {
        "model": Slot(),
        "calibration": Slot(required=False),
        "sensitivity": Slot(required=False),
    }

    def libraries(self) -> dict[str, str]:
        return {"mlx": library_version("mlx")}

    def estimate(self, params: QuantizeParams, inputs) -> dict[str, dict]:
        """The roles and stored bytes of its input's tensors, from their shapes alone."""
        if "model" not in inputs:
            raise UsageError(
                f"estimate follows {self.kind} over a step that estimates its output (sanitize, "
                "graft); this one's model input does not"
            )
        return {"out": quant_estimate.layout(inputs["model"][0]["tensors"], params)}

    def run(self, ctx: Context, params: QuantizeParams, inputs) -> dict[str, Artifact]:
        calibration, sensitivity = (
            (inputs.get(k) or [None])[0] for k in ("calibration", "sensitivity")
        )
        return {"out": quantize_artifact(ctx, inputs["model"][0], params, calibration, sensitivity)}


class RequantizeParams(QuantizeParams):
    require_all_rules: bool = False  # the trunk's rules need not all match a head
    budget: bool = False  # the budget is the trunk's (quantize's); the head keeps its roles' bits


@register
class Requantize(Quantize):
    """The same role allocation applied to a grafted head (inherited rules need not all match)."""

    kind = "requantize"
    version = 3  # as quantize's
    Params = RequantizeParams
