"""A bits-per-weight budget: measure how sensitive each layer's routed experts are, then spend bits.

**Sensitivity** (step ``sensitivity``, cached per source and calibration text, not per
budget): for each group of routed-expert weights (a layer's three, or each tensor alone) and
each candidate bits b, the mean KL divergence of the model's next-token distributions from the
bf16 source's, on the calibration lines of the text, when that group alone is quantized at b
bits (as the build quantizes it: data-aware with the calibration's statistics, or
``mx.quantize``: ``dequantized``) and every other tensor is bf16. ``grade.sensitivity`` runs
the measurement; this module plans and runs no forward pass.

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
from collections.abc import Iterator

from buildkit.core.errors import StepError
from buildkit.core.lazy import lazy
from buildkit.formats import checkpoint as ckpt
from buildkit.formats.checkpoint import SWITCH
from buildkit.formats.tensors import ITEMSIZE
from buildkit.quant.roles import BF16, Role
from buildkit.store.artifact import Artifact

np = lazy("numpy", __name__)

MEASURE = (
    "mean KL divergence from bf16 of next-token distributions on the calibration text, "
    "that group alone quantized at each bits"
)
LOCAL = (
    "mean KL divergence from bf16 of next-token distributions on the calibration text, "
    "estimated from the group's error in its own layer's output, as a power of it fitted "
    "where the KL was measured at a few layers"
)
MAX_STATES = 1 << 18  # cells of the knapsack's table (a row per group, a byte per cell)


EMBED = "language_model.model.embed_tokens.weight"
LM_HEAD = ckpt.LM_HEAD
LAYERS = ckpt.LAYERS
SHARED = ".mlp.shared_expert"  # the shared expert and its gate


def routed_weights(tensors: dict[str, dict]) -> list[str]:
    """Names of routed-expert weights ([E, out, in] under ``*.mlp.switch_mlp.*``), sorted."""
    return sorted(
        n
        for n, e in tensors.items()
        if SWITCH in n and n.endswith(".weight") and len(e["shape"]) == 3
    )


def measurable(name: str) -> bool:
    """A weight the sensitivity can quantize alone and run: a decoder layer's, the
    embeddings or lm_head (not the vision tower, which text does not reach, nor the MTP head)."""
    return name.endswith(".weight") and (name.startswith(LAYERS) or name in (EMBED, LM_HEAD))


def budgeted_weights(tensors: dict[str, dict], roles: dict[str, str], recipe_roles) -> list[str]:
    """The tensors whose role has ``budget_bits``, sorted; they must be measurable."""
    names = sorted(n for n, r in roles.items() if recipe_roles[r].budget_bits)
    bad = [n for n in names if not measurable(n)]
    if bad:
        raise StepError(
            f"{bad[0]} (role {roles[bad[0]]!r}) has budget_bits, but the sensitivity measures "
            "only the text model's decoder layers, embeddings and lm_head: remove budget_bits "
            "from that role or give those tensors another role"
        )
    return names


def layer_index(name: str) -> int:
    """N of ``language_model.model.layers.N.…``; -1 for the embeddings (before layer 0) and a
    large number for lm_head (after the last layer)."""
    if name == EMBED:
        return -1
    if name == LM_HEAD:
        return 1 << 30
    return int(name.split(".layers.", 1)[1].split(".", 1)[0])


def group_of(name: str, granularity: str) -> str:
    """The group a budget gives one bits: per ``tensor`` its module path; per ``layer`` the
    module it belongs to (``<layer>.mlp.switch_mlp``: its gate, up and down; ``self_attn``,
    ``linear_attn``, ``mlp.shared_expert``), or the module itself where that is the MoE block
    (router, shared-expert gate) or the model (embeddings, lm_head)."""
    module = name.removesuffix(".weight")
    if granularity == "tensor":
        return module
    if SWITCH in module:
        return module.partition(SWITCH)[0] + SWITCH
    parent = module.rpartition(".")[0]
    return parent if name.startswith(LAYERS) and not parent.endswith(".mlp") else module


def groups_of(names: list[str], granularity: str) -> dict[str, list[str]]:
    """The groups of ``names`` (``group_of``), each with its tensors, sorted."""
    out: dict[str, list[str]] = {}
    for n in sorted(names):
        out.setdefault(group_of(n, granularity), []).append(n)
    return out


def dequantized(store, model: Artifact, name: str, role: Role, calibration) -> np.ndarray:
    """The tensor as quantize stores it under ``role`` (data-aware if the role is calibrated),
    dequantized to float32 ([E, out, in] or [out, in]). The quantized objects go to the store
    as objects of their own (quantize writes its tensors into packs, so these are not reused;
    gc frees them)."""
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


def dequantized_rows(
    store, model: Artifact, name: str, role: Role, calibration, rows: int, pick=None
) -> Iterator[np.ndarray]:
    """``dequantized`` a block of ``rows`` rows (experts, of a routed-expert weight) at a time,
    made in memory and never stored: the same codes, scales and biases (dequantized in numpy),
    memory a block, not the tensor (the real lm_head is 2 GB in float32). With ``pick``
    (sorted row ids), only those rows are made, the others zero: a candidate's experts no
    token is routed to, or embedding rows of tokens not in the text, cost nothing."""
    from buildkit.formats.tensors import nbytes
    from buildkit.quant import dataaware

    entry = model.tensors[name]
    shape = entry["shape"]
    block = rows * max(nbytes(entry["dtype"], shape) // max(shape[0], 1), 1)
    stats = None
    if role.calibrated:
        stats = dataaware.expert_statistics(store, name, entry, role, calibration)
    yield from dataaware.SearchedBlocks(store, name, entry, role, stats, block).dequantized(pick)


def probed(layers: list[int], probes: int) -> list[int]:
    """The decoder layers where the local sensitivity measures its gain: ``probes`` of
    ``layers`` evenly spaced, the first and the last among them (all when there are no more)."""
    layers = sorted({i for i in layers if i >= 0})
    if len(layers) <= probes:
        return layers
    picks = np.linspace(0, len(layers) - 1, max(probes, 2)).round().astype(int)
    return sorted({layers[k] for k in picks})


def cost(
    config: dict,
    tensors: dict[str, dict],
    groups: dict[str, list[str]],
    bits,
    tokens: int,
    method: str = "measured",
    probes: int = 4,
) -> dict:
    """What the sensitivity runs, before it runs, the reference pass aside: decoder-layer
    passes over the tokens, output-head passes (lm_head over every token, vocabulary wide) and
    their matmul flops (2 per weight a token meets: a layer's routed experts at top-k of E).
    ``measured``: a candidate of layer i runs layers i..L-1 (of the embeddings, all L) and the
    head. ``local``: a decoder layer's candidate its layer (a pass; its flops only what it
    changes where that is the MoE: ``_local_weights``); a group of a probed layer (or the
    embeddings) carries two candidates on, then the head, the source's once a KL_GROUP of KLs:
    an upper bound, as a candidate that moves nothing is not carried."""
    # imported here: `buildkit estimate` loads this module, and needs no forward pass's modules
    from buildkit.grade.sensitivity import CARRIED, KL_GROUP

    n = ckpt.text_config(config)["num_hidden_layers"]
    active, head = ckpt.active_weights(config, {k: e["shape"] for k, e in tensors.items()})
    layer_passes = head_passes = flops = 0

    def runs(k: int, first: int, last: int, with_head: bool = True, only=None) -> None:
        nonlocal layer_passes, head_passes, flops
        layer_passes += k * max(last - first, 0)
        head_passes += k * with_head
        layers = sum(active[first:last]) if only is None else only
        flops += k * 2 * tokens * (layers + head * with_head)

    per_layer: dict[int, int] = {}  # candidates each decoder layer's probes carry
    embeddings = heads = 0  # (local) candidates the embeddings' probe carries; lm_head's
    for g, names in groups.items():
        k = len([b for b in bits[g] if b != BF16])
        i = layer_index(names[0])
        if method == "measured" or i >= n:
            runs(k, max(i, 0), n)
            heads += k * (i >= n)
        elif i >= 0:
            runs(k, i, i + 1, with_head=False, only=_local_weights(config, tensors, i, names[0]))
            per_layer[i] = per_layer.get(i, 0) + min(k, CARRIED)
        else:
            embeddings += min(k, CARRIED)
    if method == "local":  # a probed group's ends (largest, smallest error) carried on
        ends = embeddings
        for p in probed(list(per_layer), probes):
            runs(per_layer[p], p + 1, n)
            ends += per_layer[p]
        runs(embeddings, 0, n)
        runs(-(-ends // KL_GROUP) + -(-heads // KL_GROUP), n, n)  # the source's side of the KLs
    return {
        "candidates": sum(len([b for b in bits[g] if b != BF16]) for g in groups),
        "layer_passes": layer_passes,
        "head_passes": head_passes,
        "tflop": round(flops / 1e12, 3),
    }


def measured_bytes(config: dict, tensors: dict[str, dict], tokens: int) -> int:
    """About what the measured sensitivity holds at once, in bytes (float32): the source's
    log-probabilities (tokens x vocabulary) and its output head, every layer's hidden states,
    and its widest decoder layer three times over (the layer, a candidate, the swapped-in copy)."""
    text = ckpt.text_config(config)
    n = text["num_hidden_layers"]
    vocab, hidden = (tensors.get(LM_HEAD) or tensors.get(EMBED) or {"shape": [0, 0]})["shape"]
    layer = [0] * n
    for name, e in tensors.items():
        if name.startswith(LAYERS) and 0 <= layer_index(name) < n:
            layer[layer_index(name)] += math.prod(e["shape"])
    return 4 * (
        tokens * vocab + vocab * hidden + (n + 1) * tokens * hidden + 3 * max(layer, default=0)
    )


def _local_weights(config: dict, tensors: dict[str, dict], i: int, name: str) -> float | None:
    """The weights a token meets when local runs a candidate of ``name``'s group in layer
    ``i`` (``LocalPass.output``): the routed experts' and the shared expert's on the source's
    routing, or the shared expert's alone; None where it runs the whole layer."""
    if SWITCH in name:
        parts = (SWITCH, SHARED)
    elif SHARED in name:
        parts = (SHARED,)
    else:
        return None
    prefix = f"{LAYERS}{i}."
    shapes = {
        k: e["shape"]
        for k, e in tensors.items()
        if k.startswith(prefix) and any(p in k for p in parts)
    }
    return ckpt.active_weights(config, shapes)[0][i]


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
    r = role.at(bits)
    return sum(stored_bits(tensors[n], r) for n in names)


def _sens(sens: dict, group: str, bits: int) -> float | None:
    """A group's measured sensitivity at ``bits``; bf16 is the source itself, 0."""
    return 0.0 if bits == BF16 else sens[group].get(str(bits))


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
        missing = [b for b in role.budget_bits if _sens(sens, g, b) is None]
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
        [[_sens(sens, g, b) for b in budgeted[g][0].budget_bits] for g in groups],
        room,
    )
    group_bits = {g: budgeted[g][0].budget_bits[j] for g, j in zip(groups, choice, strict=True)}
    used = floor + sum(c[j] - c[0] for c, j in zip(cost, choice, strict=True))
    summary = {
        "target_bpw": target_bpw,
        "bits_per_weight": round(used / weights, 4),
        "measure": measured.get("measure", MEASURE),
        "bits": group_bits,
        "sensitivity": {
            g: sens[g] | ({str(BF16): 0.0} if BF16 in budgeted[g][0].budget_bits else {})
            for g in groups
        },
        "total_sensitivity": float(f"{sum(_sens(sens, g, b) for g, b in group_bits.items()):.6g}"),
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
