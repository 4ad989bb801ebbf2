"""One tensor quantized by role: what ``mx.quantize`` stores for it, and its bytes in blocks."""

from __future__ import annotations

import json
from collections import Counter

from buildkit.core.errors import StepError
from buildkit.formats.tensors import nbytes
from buildkit.quant.roles import Recipe, Role
from buildkit.store.artifact import Artifact
from buildkit.store.store import ROW_BLOCK_BYTES


def module_path(name: str) -> str:
    return name.removesuffix(".weight")


def check_quantizable(name: str, shape, role: Role) -> None:
    if not name.endswith(".weight") or len(shape) < 2:
        raise StepError(
            f"tensor {name!r} {list(shape)} cannot be quantized (needs a 2-D or 3-D X.weight)"
        )
    if shape[-1] % role.group_size:
        raise StepError(
            f"tensor {name!r}: last dimension {shape[-1]} "
            f"is not a multiple of group_size {role.group_size}"
        )


def quantize_entry(
    store, name: str, entry: dict, role: Role, block_bytes: int = ROW_BLOCK_BYTES
) -> dict[str, dict]:
    """One tensor -> its stored entries under ``role``, in blocks of rows: mx.quantize's groups
    run along the last axis, so the blocks give the bytes of quantizing the tensor whole."""
    if role.passthrough:
        return {name: entry}
    from buildkit.quant import (  # numba: imported by the first quantizing task, not by all
        affine,
        qerror,
    )

    shape = entry["shape"]
    check_quantizable(name, shape, role)
    base = module_path(name)

    def blocks():
        for block in store.iter_rows(entry, block_bytes):
            # bf16 (every weight of the real model): mx.quantize's bytes and verify's figure
            # in one compiled pass; else, or for a non-finite block, mx.quantize then measure
            parts, sums = affine.like_mx(
                block, entry["dtype"], role.bits, role.group_size, role.mode
            )
            named = dict(zip((f"{base}.{k}" for k in ("weight", "scales", "biases")), parts))
            yield (block, named, sums) if sums is not None else (block, named)

    return qerror.put_measured(
        store, shape[0], blocks(), base, entry["dtype"], role.bits, role.group_size
    )


def output_shapes(name: str, entry: dict, role: Role) -> dict[str, tuple[str, list[int]]]:
    """What a tensor becomes under ``role``: name -> (dtype, shape) of each stored tensor."""
    if role.passthrough:
        return {name: (entry["dtype"], list(entry["shape"]))}
    check_quantizable(name, entry["shape"], role)
    base = module_path(name)
    return {
        f"{base}.{k}": (dt, list(shape))
        for k, (dt, shape) in quantized_shapes(entry["shape"], role, entry["dtype"]).items()
    }


def stored_bits(entries: dict[str, dict]) -> int:
    return 8 * sum(nbytes(e["dtype"], e["shape"]) for e in entries.values())


def assign_roles(names: list[str], params) -> dict[str, str]:
    """Role of every tensor: the step's own rules first (each must match), then the recipe's,
    first match wins. The one place rules become a per-tensor plan (quantize, its key, estimate)."""
    recipe = params.recipe
    roles: dict[str, str] = {}
    if params.rules:
        local = Recipe(roles=recipe.roles, rules=params.rules)
        hits = {n: local.match(n) for n in names}
        roles = {n: h[1] for n, h in hits.items() if h}
        dead = sorted(set(params.rules) - {h[0] for h in hits.values() if h})
        if dead:
            raise StepError(
                f"step rule(s) {', '.join(map(repr, dead))} match no tensor; fix the pattern"
            )
    rest = [n for n in names if n not in roles]
    return roles | recipe.assign(rest, require_all_rules=params.require_all_rules)


def quantized_shapes(shape, role: Role, dtype: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """suffix -> (dtype, shape) of what ``mx.quantize`` stores for a weight of ``shape``:
    packed uint32 codes, and scales and biases in the weight's dtype, one per group."""
    *rows, cols = shape
    return {
        "weight": ("U32", (*rows, cols * role.bits // 32)),
        "scales": (dtype, (*rows, cols // role.group_size)),
        "biases": (dtype, (*rows, cols // role.group_size)),
    }


def quantization_config(parts: list[Artifact]) -> dict | None:
    """Defaults from the quantization covering the most parameters, per-path entries for the
    rest."""
    per_path: dict[str, dict] = {}
    weight = Counter()
    for a in parts:
        q = a.meta.get("quantization", {})
        per_path.update(q)
        for role in a.meta.get("role_table", {}).values():
            if not role.get("passthrough"):
                weight[
                    json.dumps(
                        {
                            k: role.get(k, d)
                            for k, d in (("group_size", 64), ("bits", None), ("mode", "affine"))
                        },
                        sort_keys=True,
                    )
                ] += role["params"]
    if not per_path:
        return None
    default = json.loads(weight.most_common(1)[0][0]) if weight else next(iter(per_path.values()))
    cfg = dict(default)
    for path in sorted(per_path):
        if per_path[path] != default:
            cfg[path] = per_path[path]
    return cfg
