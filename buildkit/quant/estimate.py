"""A variant's size and bits per weight from layouts alone (``buildkit estimate``).

No tensor data is read. Each quantizing step estimates its output from the layout of its input
(``layout``: the roles ``assign_roles`` gives, what ``output_shapes`` stores for each), the
engine walks the graph with those hooks (``engine/estimate.py``), and ``summary`` adds up the
quantizing steps' outputs: the published model's tensor bytes (safetensors payloads, headers
not counted).

Bits per weight are counted the way the clients count them: bytes x 8 over source parameters,
with the vision tower (mlx_vlm loads it) and without (mlx_lm drops it); neither loads the MTP
head, which is reported on its own.
"""

from __future__ import annotations

import math

from buildkit.formats import checkpoint as ckpt
from buildkit.formats.tensors import nbytes
from buildkit.quant import budget
from buildkit.quant.quantize import assign_roles, output_shapes

PARTS = ("language_model", "vision_tower", "mtp")


def layout(given: dict[str, dict], params) -> dict:
    """A quantizing step's estimated output from its input's tensors (name -> dtype, shape):
    each tensor's params and stored bytes, its rows by role and its budget, if any."""
    roles = assign_roles(sorted(given), params)
    tensors = {}
    for name, role_name in sorted(roles.items()):
        role, t = params.recipe.roles[role_name], given[name]
        # what quantize stores for it (a shape it cannot quantize refused as quantize does)
        size = sum(nbytes(d, s) for d, s in output_shapes(name, t, role).values())
        tensors[name] = {"role": role_name, "params": math.prod(t["shape"]), "bytes": size}
    return {
        "tensors": tensors,
        "roles": _role_rows(params, tensors),
        "budget": _budget(params, given, roles),
    }


def _budget(params, given: dict[str, dict], roles: dict[str, str]) -> dict | None:
    """A node's bits-per-weight budget, if it has one: its target and the range it can reach.
    The bits per layer are planned at build time, from measured sensitivities."""
    recipe = params.recipe
    if recipe.target_bpw is None or not params.budget:
        return None
    names = budget.budgeted_weights(given, roles, recipe.roles)
    if not names:
        return None
    measured = {"groups": budget.groups_of(names, "tensor"), "sensitivity": {}}
    lo, hi = budget.reachable(given, roles, recipe.roles, measured)
    return {
        "target_bpw": recipe.target_bpw,
        "lowest_bpw": round(lo, 4),
        "highest_bpw": round(hi, 4),
        "tensors": len(names),
    }


def _role_rows(params, tensors: dict[str, dict]) -> list[dict]:
    """One quantizing step's rows, a role each, largest first."""
    rows: dict[str, dict] = {}
    for t in tensors.values():
        role = params.recipe.roles[t["role"]]
        row = rows.setdefault(
            t["role"],
            {
                "role": t["role"],
                "bits": None if role.passthrough else role.bits,
                "group_size": None if role.passthrough else role.group_size,
                "tensors": 0,
                "params": 0,
                "bytes": 0,
            },
        )
        row["tensors"] += 1
        row["params"] += t["params"]
        row["bytes"] += t["bytes"]
    return sorted(rows.values(), key=lambda r: -r["bytes"])


def summary(variant: str, source: str, layouts: dict[str, dict[str, dict]]) -> dict:
    """The estimate of a variant from its nodes' estimated outputs (``engine.estimate``): the
    quantizing steps' (those with role rows) added up by part of the model."""
    roles_rows: list[dict] = []
    budgets: list[dict] = []
    parts = {p: {"params": 0, "bytes": 0} for p in PARTS}
    tensors = 0
    for node, outputs in layouts.items():
        for out in outputs.values():
            if "roles" not in out:
                continue
            roles_rows += [{"step": node, **r} for r in out["roles"]]
            budgets += [{"step": node, **out["budget"]}] if out["budget"] else []
            for name, t in out["tensors"].items():
                part = parts[ckpt.model_part(name)]
                part["params"] += t["params"]
                part["bytes"] += t["bytes"]
            tensors += len(out["tensors"])
    return _summary(variant, source, parts, tensors, roles_rows, budgets)


def _summary(
    variant: str, source: str, parts: dict, tensors: int, roles_rows: list, budgets: list
) -> dict:
    def bpw(names) -> float:
        p = sum(parts[n]["params"] for n in names)
        return round(8 * sum(parts[n]["bytes"] for n in names) / p, 4) if p else 0.0

    for name, part in parts.items():
        part["bits_per_weight"] = bpw([name])
    total_bytes = sum(p["bytes"] for p in parts.values())
    out = {
        "variant": variant,
        "source": source,
        "bits_per_weight": bpw(["language_model", "vision_tower"]),  # as mlx_vlm counts
        "bits_per_weight_text": bpw(["language_model"]),  # as mlx_lm counts
        "bytes": total_bytes,  # every published tensor, the head's too
        "bytes_without_head": total_bytes - parts["mtp"]["bytes"],
        "params": sum(p["params"] for p in parts.values()),
        "tensors": tensors,
        "parts": parts,
        "roles": roles_rows,
        "budgets": budgets,
    }
    if not parts["mtp"]["params"]:
        del parts["mtp"]
    return out


def render(e: dict) -> str:
    """The estimate as a table for people."""
    lines = [
        f"{e['variant']} from {e['source']} "
        "(config.json and safetensors headers; no tensor data read)",
        "",
        f"{'step':12} {'role':18} {'bits':>4} {'group':>5} "
        f"{'tensors':>7} {'params':>16} {'bytes':>16}",
    ]
    for r in e["roles"]:
        bits = "bf16" if r["bits"] is None else str(r["bits"])
        group = "" if r["group_size"] is None else str(r["group_size"])
        lines.append(
            f"{r['step']:12} {r['role']:18} {bits:>4} {group:>5} {r['tensors']:>7} "
            f"{r['params']:>16,} {r['bytes']:>16,}"
        )
    for b in e.get("budgets", []):
        lines += [
            "",
            f"{b['step']}: a budget of {b['target_bpw']} bits per weight over its tensors "
            f"(reachable {b['lowest_bpw']:.3f} to {b['highest_bpw']:.3f}) gives the "
            f"{b['tensors']} budgeted tensors their bits at build time, by measured "
            "sensitivity; the rows above count them at their role's bits"
            + (
                ""
                if b["lowest_bpw"] <= b["target_bpw"]
                else "; the target is below the lowest reachable and the build will refuse it"
            ),
        ]
    lines += ["", f"{'part':18} {'params':>16} {'bytes':>16} {'bits/weight':>11}"]
    for name, p in e["parts"].items():
        lines.append(
            f"{name:18} {p['params']:>16,} {p['bytes']:>16,} {p['bits_per_weight']:>11.3f}"
        )
    lines += [
        "",
        f"bits per weight: {e['bits_per_weight']:.3f} with the vision tower (as mlx_vlm counts), "
        f"{e['bits_per_weight_text']:.3f} text only (as mlx_lm counts)",
        f"size: {e['bytes'] / 1e9:.2f} GB ({e['bytes']:,} bytes of tensors)"
        + (
            f"; without the MTP head {e['bytes_without_head'] / 1e9:.2f} GB, the head "
            f"{e['parts']['mtp']['bytes'] / 1e9:.2f} GB"
            if "mtp" in e["parts"]
            else ""
        ),
    ]
    return "\n".join(lines)
