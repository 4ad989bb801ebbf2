"""A bits-per-weight budget: measure how sensitive each layer's routed experts are, then spend bits.

**Sensitivity** (step ``sensitivity``, cached per source and calibration text, not per
budget): for each group of routed-expert weights (a layer's three, or each tensor alone) and
each candidate bits b, the mean KL divergence of the model's next-token distributions from the
bf16 source's, on the calibration lines of the text, when that group alone is quantized at b
bits (as the build quantizes it: data-aware with the calibration's statistics, or
``mx.quantize``) and every other tensor is bf16. It runs ``evaluate``'s layers: the bf16 trunk
once, keeping the hidden states entering each layer and the final log-probabilities; then, per
layer, every candidate of that layer's groups from its kept input, all of them together
through each later bf16 layer (each later layer read once per measured layer, not per
candidate), and the output head.

**Plan**: each budgeted group gets one of its role's ``budget_bits`` so that the summed
sensitivity is least while the stored bits of all tensors stay at or under ``target_bpw`` x
weights: a multiple-choice knapsack, solved exactly by dynamic programming over the stored
bits that upgrades add (``MAX_STATES`` cells at most; beyond that the costs are rounded up,
so the budget still holds). Every other tensor's stored bits are fixed by its role. The
tensors of a group take its bits, each with its own ``quantization`` entry (as mlx_lm loads
them).
"""

from __future__ import annotations

import math

from buildkit.core.errors import StepError
from buildkit.core.lazy import lazy
from buildkit.formats.tensors import ITEMSIZE
from buildkit.grade import calibration as cal
from buildkit.grade import evaluate as ev
from buildkit.quant.roles import Role
from buildkit.store.artifact import Artifact

np = lazy("numpy", __name__)

MEASURE = (
    "mean KL divergence from bf16 of next-token distributions on the calibration text, "
    "that group alone quantized at each bits"
)
MAX_STATES = 1 << 16  # cells of the knapsack's table (a row per group, a byte per cell)


def routed_weights(tensors: dict[str, dict]) -> list[str]:
    """Names of routed-expert weights ([E, out, in] under ``*.mlp.switch_mlp.*``), sorted."""
    return sorted(
        n
        for n, e in tensors.items()
        if cal.SWITCH in n and n.endswith(".weight") and len(e["shape"]) == 3
    )


def layer_index(name: str) -> int:
    """N of ``language_model.model.layers.N.…``."""
    return int(name.split(".layers.", 1)[1].split(".", 1)[0])


def groups_of(names: list[str], granularity: str) -> dict[str, list[str]]:
    """The groups a budget gives one bits each: per ``layer`` (``<layer>.mlp.switch_mlp``: its
    gate, up and down) or per ``tensor`` (its module path)."""
    out: dict[str, list[str]] = {}
    for n in sorted(names):
        module = n.removesuffix(".weight")
        key = module.partition(cal.SWITCH)[0] + cal.SWITCH if granularity == "layer" else module
        out.setdefault(key, []).append(n)
    return out


def _dequantized(store, model: Artifact, name: str, role: Role, calibration) -> np.ndarray:
    """The tensor as quantize stores it under ``role`` (data-aware if the role is calibrated),
    dequantized to float32 [E, out, in]. The quantized objects go to the store as objects of
    their own (quantize writes its tensors into packs, so these are not reused; gc frees
    them)."""
    import mlx.core as mx

    from buildkit.formats.tensors import to_mlx
    from buildkit.quant import dataaware
    from buildkit.quant.quantize import quantize_entry

    entry = model.tensors[name]
    if role.calibrated:
        q = dataaware.quantize_entry(store, name, entry, role, calibration, dataaware.Tally())
    else:
        q = quantize_entry(store, name, entry, role)
    module = name.removesuffix(".weight")
    w, s, b = (
        to_mlx(store.read_tensor(q[f"{module}.{k}"]), q[f"{module}.{k}"]["dtype"])
        for k in ("weight", "scales", "biases")
    )
    deq = mx.dequantize(w, s, b, group_size=role.group_size, bits=role.bits, mode=role.mode)
    return np.array(deq.astype(mx.float32))


def measure(
    store,
    model: Artifact,
    calibration: Artifact | None,
    groups: dict[str, list[str]],
    bits: list[int],
    group_size: int,
    tokens: list[int],
    seq_len: int,
    progress=None,
) -> dict[str, dict[int, float]]:
    """S(b) for each group and bits b: the mean KL on ``tokens`` with that group's tensors
    alone quantized (data-aware if ``calibration`` is given). The layers' matmuls run in numpy
    (calibrate's modules: mlx's CPU BLAS is much slower), the candidate tensors dequantized,
    so the reference and every candidate share one arithmetic and differ only by the group."""
    NpLinear, NpSwitchGLU = cal.numpy_modules()
    config = model.meta["config"]
    src = ev.StoreWeights(store, [model], config, None)
    args = cal.build_model(config).language_model.args
    n_layers = args.num_hidden_layers

    def layer(i: int):
        module = ev.decoder_layer(src, i, args)
        sw = module.mlp.switch_mlp
        gate_up = np.concatenate([np.array(sw.gate_proj.weight), np.array(sw.up_proj.weight)], 1)
        switch = module.mlp.switch_mlp = NpSwitchGLU(gate_up, np.array(sw.down_proj.weight))
        cal.linears_to_numpy(module, NpLinear)
        return module, switch

    seqs = ev.sequences(tokens, seq_len)
    hs = [ev.embed(src, seqs)]  # hs[i]: what enters layer i, then the last layer's output
    for i in range(n_layers):
        hs.append(ev.run_layer(layer(i)[0], hs[i]))
    out = ev.Output(src)
    out.lm_head = NpLinear(np.array(out.lm_head.weight))
    ref = ev.reference_logprobs(out, hs[-1], seqs)
    by_layer: dict[int, list[str]] = {}
    for g, names in groups.items():
        if len({layer_index(n) for n in names}) != 1:
            raise StepError(f"sensitivity group {g} spans layers: {names}")
        by_layer.setdefault(layer_index(names[0]), []).append(g)
    if progress:
        progress.start(len(groups) * len(bits), "candidates")
    result: dict[str, dict[int, float]] = {g: {} for g in groups}
    for i, layer_groups in sorted(by_layer.items()):
        module, switch = layer(i)
        inter = switch.down.shape[-1]
        own = {
            "gate_proj": switch.gate_up[:, :inter],
            "up_proj": switch.gate_up[:, inter:],
            "down_proj": switch.down,
        }
        cands = {}
        for g in layer_groups:
            for b in bits:
                role = Role(bits=b, group_size=group_size, calibrated=calibration is not None)
                w = dict(own)
                for n in groups[g]:
                    proj = n.removesuffix(".weight").rpartition(".")[2]
                    w[proj] = _dequantized(store, model, n, role, calibration)
                module.mlp.switch_mlp = NpSwitchGLU(
                    np.concatenate([w["gate_proj"], w["up_proj"]], 1), w["down_proj"]
                )
                cands[g, b] = ev.run_layer(module, hs[i])
        for k in range(i + 1, n_layers):  # the later layers are bf16, read once for all
            later = layer(k)[0]
            cands = {c: ev.run_layer(later, h) for c, h in cands.items()}
        for (g, b), h in cands.items():
            result[g][b] = float(f"{ev.mean_kl(out, ref, h, seqs):.6g}")
            if progress:
                progress.advance(1)
    return result


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
    roles: dict[str, str], recipe_roles: dict[str, Role], measured: dict
) -> dict[str, tuple[Role, list[str]]]:
    """group -> (its role, its tensors) for the measured groups whose role has budget_bits."""
    out = {}
    for g, names in sorted(measured["groups"].items()):
        rs = {roles.get(n) for n in names}
        if None in rs or not any(recipe_roles[r].budget_bits for r in rs):
            continue
        if len(rs) > 1:
            raise StepError(
                f"the tensors of sensitivity group {g} have roles {sorted(rs)}: a group takes one "
                "bits, so give them one role (or measure per tensor: granularity = 'tensor')"
            )
        out[g] = (recipe_roles[rs.pop()], names)
    return out


def _accounts(
    tensors: dict[str, dict], roles: dict[str, str], recipe_roles: dict[str, Role], budgeted
) -> tuple[int, int]:
    """(source weights, stored bits of every tensor that is not budgeted)."""
    inside = {n for _, names in budgeted.values() for n in names}
    weights = fixed = 0
    for n, e in tensors.items():
        k = 1
        for d in e["shape"]:
            k *= d
        weights += k
        if n not in inside:
            fixed += stored_bits(e, recipe_roles[roles[n]])
    return weights, fixed


def _cost(tensors: dict[str, dict], role: Role, names: list[str], bits: int) -> int:
    r = role.model_copy(update={"bits": bits})
    return sum(stored_bits(tensors[n], r) for n in names)


def reachable(
    tensors: dict[str, dict],
    roles: dict[str, str],
    recipe_roles: dict[str, Role],
    measured: dict,
) -> tuple[float, float]:
    """(lowest, highest) bits per weight a budget can reach: every budgeted group at its
    role's lowest, or highest, ``budget_bits``. ``measured``: a sensitivity artifact's meta."""
    budgeted = _budgeted(roles, recipe_roles, measured)
    weights, fixed = _accounts(tensors, roles, recipe_roles, budgeted)
    return tuple(
        (fixed + sum(_cost(tensors, r, ns, r.budget_bits[i]) for r, ns in budgeted.values()))
        / weights
        for i in (0, -1)
    )


def plan(
    tensors: dict[str, dict],
    roles: dict[str, str],
    recipe_roles: dict[str, Role],
    target_bpw: float,
    measured: dict,
) -> tuple[dict[str, int], dict]:
    """(bits of each budgeted tensor, a summary) for ``target_bpw`` over all ``tensors``.
    ``measured``: a sensitivity artifact's meta (``groups``: group -> tensors; ``sensitivity``:
    group -> {str(bits): S}); the groups whose role has ``budget_bits`` are budgeted, every
    other tensor is fixed by its role."""
    budgeted = _budgeted(roles, recipe_roles, measured)
    sens = measured["sensitivity"]
    if not budgeted:
        raise StepError(
            "recipe.target_bpw is set but no tensor is budgeted: give the routed-expert role "
            "budget_bits (e.g. [3, 4, 5, 6, 8]) and measure it in the sensitivity input"
        )
    for g, (role, _) in budgeted.items():
        missing = [b for b in role.budget_bits if str(b) not in sens[g]]
        if missing:
            raise StepError(
                f"sensitivity of {g} was not measured at bits {missing}: add them to the "
                "sensitivity step's params.bits"
            )
    weights, fixed = _accounts(tensors, roles, recipe_roles, budgeted)
    groups = list(budgeted)
    cost = [[_cost(tensors, r, ns, b) for b in r.budget_bits] for r, ns in budgeted.values()]
    floor = fixed + sum(c[0] for c in cost)
    room = math.floor(target_bpw * weights) - floor
    if room < 0:
        lo, hi = reachable(tensors, roles, recipe_roles, measured)
        raise StepError(
            f"recipe.target_bpw {target_bpw} is below the lowest this recipe reaches, {lo:.4f} "
            f"(every budgeted tensor at its lowest budget_bits; the highest is {hi:.4f}): raise it"
        )
    choice = _knapsack(
        [[x - c[0] for x in c] for c in cost],
        [[sens[g][str(b)] for b in budgeted[g][0].budget_bits] for g in groups],
        room,
    )
    group_bits = {g: budgeted[g][0].budget_bits[j] for g, j in zip(groups, choice, strict=True)}
    used = floor + sum(c[j] - c[0] for c, j in zip(cost, choice, strict=True))
    summary = {
        "target_bpw": target_bpw,
        "bits_per_weight": round(used / weights, 4),
        "measure": MEASURE,
        "bits": group_bits,
        "sensitivity": {g: sens[g] for g in groups},
        "total_sensitivity": float(f"{sum(sens[g][str(b)] for g, b in group_bits.items()):.6g}"),
    }
    bits = {n: group_bits[g] for g, (_, names) in budgeted.items() for n in names}
    return bits, summary


def _knapsack(extra: list[list[int]], loss: list[list[float]], room: int) -> list[int]:
    """The option j of each item that minimises Σ loss[i][j] with Σ extra[i][j] <= room
    (extra[i][0] == 0: the cheapest option costs nothing extra). Exact in units of the costs'
    greatest common divisor (for equal-sized tensors, one bit per weight of one tensor); if
    that needs more than ``MAX_STATES`` cells, costs are rounded up to a coarser unit."""
    unit = math.gcd(*(x for row in extra for x in row if x)) or 1
    if room // unit >= MAX_STATES:
        unit = -(-room // (MAX_STATES - 1))
    cells = room // unit + 1
    best = np.zeros(cells)  # least loss of the items so far within c units, for every c
    picks = []
    for ex, ls in zip(extra, loss, strict=True):
        new = np.full(cells, np.inf)
        pick = np.zeros(cells, np.int8)
        for j, (x, v) in enumerate(zip(ex, ls, strict=True)):
            k = -(-x // unit)
            if k >= cells:
                continue
            cand = np.full(cells, np.inf)
            cand[k:] = best[: cells - k] + v
            better = cand < new  # strict: on a tie the cheaper option (lower j) stays
            new[better], pick[better] = cand[better], j
        best = new
        picks.append(pick)
    c, out = cells - 1, []
    for ex, pick in zip(reversed(extra), reversed(picks), strict=True):
        j = int(pick[c])
        out.append(j)
        c -= -(-ex[j] // unit)
    return out[::-1]
