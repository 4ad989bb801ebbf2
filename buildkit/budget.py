"""A bits-per-weight budget: measure each routed-expert tensor's sensitivity, then spend bits.

**Sensitivity** (step ``sensitivity``, cached per source and calibration text, not per
budget): for each routed-expert weight W [E, out, in] with calibration statistics, and each
candidate bits b, the activation-weighted reconstruction error of that tensor alone quantized
at b bits (data-agnostic ``mx.quantize``, group size g):

    S(b) = Σ_e tokens_e · Σ_o Σ_c E[x_c²]_e (W_eoc − Ŵ_eoc)²

the diagonal approximation (as in ``dataaware``) of the summed squared error of the tensor's
output over the calibration tokens routed to each expert. It is a proxy for the change in
the final logits' KL divergence when that tensor alone is quantized lower (a forward per
candidate would cost a calibration pass each). Rows are sampled (every k-th output row of
each expert, at most ``max_rows``) and the sum scaled back up: the error is a sum over rows.

**Plan**: every budgeted tensor starts at its role's lowest ``budget_bits``; then, greedily,
the upgrade (tensor, higher bits) with the largest drop in S per stored bit that still fits
under ``target_bpw`` × weights is taken, until none fits. Every other tensor's stored bits are
fixed by its role. Bits are per tensor (one ``quantization`` entry per module path, as mlx_lm
loads them), so a budget is met to within the smallest upgrade left.
"""

from __future__ import annotations

from . import calibration as cal
from .errors import StepError
from .lazy import lazy
from .roles import Role
from .store import ROW_BLOCK_BYTES
from .tensors import ITEMSIZE, to_mlx

np = lazy("numpy", __name__)

PROXY = (
    "activation-weighted reconstruction error of the tensor alone at each bits "
    "(mx.quantize, diagonal E[x^2], routed tokens)"
)


def routed_weights(tensors: dict[str, dict]) -> list[str]:
    """Names of routed-expert weights ([E, out, in] under ``*.mlp.switch_mlp.*``), sorted."""
    return sorted(
        n
        for n, e in tensors.items()
        if cal.SWITCH in n and n.endswith(".weight") and len(e["shape"]) == 3
    )


def measure(
    store,
    entry: dict,
    importance: np.ndarray,
    tokens: np.ndarray,
    bits: list[int],
    group_size: int,
    max_rows: int,
    block_bytes: int = ROW_BLOCK_BYTES,
) -> dict[int, float]:
    """S(b) for each bits b of one routed-expert weight, a block of experts at a time."""
    import mlx.core as mx

    E, O, C = entry["shape"]
    stride = -(-O // max_rows)
    out = dict.fromkeys(bits, 0.0)
    e0 = 0
    for raw in store.iter_rows(entry, block_bytes):
        n = len(raw)
        w = to_mlx(raw[:, ::stride], entry["dtype"])
        wf = w.astype(mx.float32)
        weight = mx.array((importance[e0 : e0 + n] * tokens[e0 : e0 + n, None]).astype(np.float32))[
            :, None, :
        ]
        for b in bits:
            deq = mx.dequantize(
                *mx.quantize(w, group_size=group_size, bits=b), group_size=group_size, bits=b
            )
            out[b] += float((weight * mx.square(deq.astype(mx.float32) - wf)).sum().item()) * stride
        e0 += n
    return {b: float(f"{v:.6g}") for b, v in out.items()}


def stored_bits(entry: dict, role: Role) -> int:
    """Bits a tensor takes stored under a role (mx.quantize: packed codes, plus a scale and a
    bias per group in the weight's dtype)."""
    n = 1
    for d in entry["shape"]:
        n *= d
    if role.passthrough:
        return 8 * ITEMSIZE[entry["dtype"]] * n
    return n * role.bits + (n // role.group_size) * 2 * 8 * ITEMSIZE[entry["dtype"]]


def _budgeted(
    roles: dict[str, str], recipe_roles: dict[str, Role], sensitivity: dict
) -> dict[str, Role]:
    return {
        n: recipe_roles[r]
        for n, r in sorted(roles.items())
        if recipe_roles[r].budget_bits and n in sensitivity
    }


def _accounts(
    tensors: dict[str, dict], roles: dict[str, str], recipe_roles: dict[str, Role], budgeted
) -> tuple[int, int]:
    """(source weights, stored bits of every tensor that is not budgeted)."""
    weights = fixed = 0
    for n, e in tensors.items():
        k = 1
        for d in e["shape"]:
            k *= d
        weights += k
        if n not in budgeted:
            fixed += stored_bits(e, recipe_roles[roles[n]])
    return weights, fixed


def _cost(entry: dict, role: Role, bits: int) -> int:
    return stored_bits(entry, role.model_copy(update={"bits": bits}))


def reachable(
    tensors: dict[str, dict],
    roles: dict[str, str],
    recipe_roles: dict[str, Role],
    sensitivity: dict,
) -> tuple[float, float]:
    """(lowest, highest) bits per weight a budget can reach: every budgeted tensor at its
    role's lowest, or highest, ``budget_bits``."""
    budgeted = _budgeted(roles, recipe_roles, sensitivity)
    weights, fixed = _accounts(tensors, roles, recipe_roles, budgeted)
    return tuple(
        (fixed + sum(_cost(tensors[n], r, r.budget_bits[i]) for n, r in budgeted.items())) / weights
        for i in (0, -1)
    )


def plan(
    tensors: dict[str, dict],
    roles: dict[str, str],
    recipe_roles: dict[str, Role],
    target_bpw: float,
    sensitivity: dict[str, dict[str, float]],
) -> tuple[dict[str, int], dict]:
    """(bits of each budgeted tensor, a summary) for ``target_bpw`` over all ``tensors``.
    ``sensitivity``: tensor -> {str(bits): S}; tensors of a role with ``budget_bits`` that
    have an entry are budgeted, every other tensor is fixed by its role."""
    budgeted = _budgeted(roles, recipe_roles, sensitivity)
    if not budgeted:
        raise StepError(
            "recipe.target_bpw is set but no tensor is budgeted: give the routed-expert role "
            "budget_bits (e.g. [3, 4, 6, 8]) and measure it in the sensitivity input"
        )
    for n, role in budgeted.items():
        missing = [b for b in role.budget_bits if str(b) not in sensitivity[n]]
        if missing:
            raise StepError(
                f"sensitivity of {n} was not measured at bits {missing}: add them to the "
                "sensitivity step's params.bits"
            )
    weights, fixed = _accounts(tensors, roles, recipe_roles, budgeted)
    limit = target_bpw * weights

    def cost(n: str, b: int) -> int:
        return _cost(tensors[n], budgeted[n], b)

    bits = {n: role.budget_bits[0] for n, role in budgeted.items()}
    used = fixed + sum(cost(n, b) for n, b in bits.items())
    if used > limit:
        lo, hi = reachable(tensors, roles, recipe_roles, sensitivity)
        raise StepError(
            f"recipe.target_bpw {target_bpw} is below the lowest this recipe reaches, {lo:.4f} "
            f"(every budgeted tensor at its lowest budget_bits; the highest is {hi:.4f}): raise it"
        )
    while True:
        best = None
        for n in budgeted:
            s_now, c_now = sensitivity[n][str(bits[n])], cost(n, bits[n])
            for b in budgeted[n].budget_bits:
                if b <= bits[n] or used - c_now + cost(n, b) > limit:
                    continue
                gain = (s_now - sensitivity[n][str(b)]) / (cost(n, b) - c_now)
                if best is None or gain > best[0]:
                    best = (gain, n, b)
        if best is None:
            break
        _, n, b = best
        used += cost(n, b) - cost(n, bits[n])
        bits[n] = b
    summary = {
        "target_bpw": target_bpw,
        "bits_per_weight": round(used / weights, 4),
        "proxy": PROXY,
        "sensitivity": {n: sensitivity[n] for n in budgeted},
        "total_sensitivity": float(f"{sum(sensitivity[n][str(b)] for n, b in bits.items()):.6g}"),
    }
    return bits, summary
