"""Data-aware quantization of routed experts: an activation-weighted affine search per group.

For one expert's weight W [out, in] and the per-channel mean square of the inputs
that expert saw in calibration, d_c = E[x_c²] (``calibration``), the expected
squared error of the expert's output, E||(W - Ŵ) x||², is approximated by its
diagonal part Σ_o Σ_c d_c (W_oc - Ŵ_oc)² (the importance-weighted objective of
llama.cpp's imatrix quantization). Each group of ``group_size`` weights of a row
gets the mlx affine parameters (scale s, bias b, codes q in [0, 2^bits - 1],
Ŵ = s q + b) that make its share of that sum small:

1. candidates: codes from the group's min-max range stretched by ``GRID`` extra
   steps (t < 0 widens the grid, t > 0 clips the extremes), each with the weighted
   least-squares (s, b) for its codes, rounded to the storage dtype of scales (that
   of the weight, as ``mx.quantize`` stores them); that fit's sums give its weighted
   error in closed form, a bound on the error of the codes re-rounded to its (s, b);
2. the ``TOP`` grids with the smallest bounds fit again: codes re-rounded against
   their rounded (s, b), and the least-squares (s, b) for those; then the best
   candidate so far ``REFINE`` times more;
3. the candidate with the smallest bound is re-rounded and its exact weighted error
   compared with mx.quantize's own (data-agnostic) result; each group keeps the
   better, so no group is worse than data-agnostic quantization on the
   calibration objective.

The loop over candidates is compiled (``groupsearch``, numba), near ``mx.quantize``'s time
per weight (bench/RESULTS.md, "oq4e speed").

No per-channel rescaling is folded anywhere (AWQ's equivalent transform needs a
preceding per-expert op, and the experts share their input), so the output is
ordinary affine ``(packed uint32, scales, biases)`` that stock mlx_lm loads as is.
Experts no calibration token reached keep mx.quantize's result and are counted.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

from buildkit.core.errors import StepError
from buildkit.core.lazy import lazy
from buildkit.formats import calibstats
from buildkit.formats.checkpoint import SWITCH
from buildkit.formats.tensors import (
    dequantize_codes,
    f32_to_bf16,
    picked_rows,
    to_float32,
    unpack,
)
from buildkit.quant.roles import Role
from buildkit.store.store import ROW_BLOCK_BYTES

np = lazy("numpy", __name__)

METHOD = "diag-weighted-affine-search/5"  # bump when the search changes its output or meta
# extra quantization steps over the min-max range: the grids that did best on the bench's
# tensor (bench/RESULTS.md, "The search, v4")
GRID = [-1.0, -0.5, -0.25, 0.25, 0.5, 1.0, 1.75]
TOP = 3  # the grids with the smallest estimates after one fit: fit once more
REFINE = 1  # further fits of the best candidate after those
IMPORTANCE_FLOOR = 1e-3  # of the mean importance: no channel is weighted zero


# ---- packing (the layout mx.quantize writes: codes LSB-first, little-endian uint32) -----


def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Integer codes [..., n] -> uint32 words [..., n * bits / 32] as mx.quantize packs them."""
    from buildkit.quant.groupsearch import (
        pack_rows,  # compiled: numpy's bit planes took most of quantize
    )

    shape = codes.shape
    if (shape[-1] * bits) % 32:
        raise StepError(f"cannot pack {shape[-1]} {bits}-bit codes into whole 32-bit words")
    rows = np.ascontiguousarray(codes, np.uint8).reshape(-1, shape[-1])
    out = np.empty((len(rows), shape[-1] * bits // 32), np.uint32)
    pack_rows(rows, bits, out)
    return out.reshape(*shape[:-1], -1)


# ---- the search ---------------------------------------------------------------------------

STORAGE = {"BF16": 1, "F16": 2}  # how (scale, bias) are rounded before codes are re-fit


def search(
    w: np.ndarray, d: np.ndarray, bits: int, dtype: str, base: tuple
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Best (codes, scales, biases) per group of w [rows, G, g] under importance d [1, G, g]
    (shared by the rows), starting from the data-agnostic ``base`` = (codes, scales, biases);
    also returns a boolean [rows, G] of the groups where a searched candidate beat ``base``."""
    R, G, g = w.shape
    d = np.asarray(d, np.float32)
    if d.size != G * g:
        raise ValueError(f"importance of shape {d.shape} is not one per column of {w.shape}")
    from buildkit.quant.groupsearch import (  # imports numba: only when a search runs
        KC,
        search_groups,
    )

    if g % KC:
        raise ValueError(f"group size {g} is not a multiple of {KC} (mx.quantize's are)")
    q = np.empty((R, G, g), np.uint8)
    s, b = np.empty((R, G), np.float32), np.empty((R, G), np.float32)
    won = np.empty((R, G), np.bool_)
    search_groups(
        np.ascontiguousarray(w, np.float32),
        np.ascontiguousarray(d.reshape(G, g)),
        np.asarray(GRID, np.float32),
        np.float32(2**bits - 1),
        TOP,
        REFINE,
        STORAGE.get(dtype, 0),
        np.ascontiguousarray(base[0].reshape(R, G, g), np.uint8).view(np.uint64),
        np.ascontiguousarray(base[1], np.float32),
        np.ascontiguousarray(base[2], np.float32),
        q.view(np.uint64),  # codes 8 to a word: the loop moves words, not bytes
        s,
        b,
        won,
    )
    return q, s, b, won


# ---- one routed-expert tensor --------------------------------------------------------------


class Tally:
    """What the calibrated tensors of one quantize step did (thread-safe); ``summary`` is meta."""

    def __init__(self):
        self.lock = threading.Lock()
        self.tensors = self.expert_slices = self.groups = self.groups_won = 0
        self.fallback: dict[str, set[int]] = {}
        self.no_statistics: list[str] = []

    def __bool__(self) -> bool:
        return bool(self.tensors)

    def summary(self) -> dict:
        by_layer = {k: sorted(v) for k, v in sorted(self.fallback.items()) if v}
        return {
            "method": METHOD,
            "tensors": self.tensors,
            "expert_slices": self.expert_slices,
            "groups_improved": round(self.groups_won / max(self.groups, 1), 4),
            "fallback_experts": sum(len(v) for v in by_layer.values()),
            "fallback_by_layer": by_layer,
            "no_statistics": sorted(self.no_statistics),
        }


def key() -> dict:
    """What, besides the recipe, fixes the bytes of the search: its version and the numpy and
    numba (the compiler of its loop) it runs on."""
    from importlib.metadata import version

    return {"method": METHOD, "numpy": version("numpy"), "numba": version("numba")}


def check_calibration(recipe, roles: dict[str, str], calibration) -> Tally:
    """A fresh Tally, or a StepError if calibrated roles and the calibration input disagree."""
    calibrated = sorted({r for r in roles.values() if recipe.roles[r].calibrated})
    if calibrated and calibration is None:
        raise StepError(
            f"role(s) {', '.join(map(repr, calibrated))} are calibrated (data-aware) but the "
            'step has no calibration input: add inputs.calibration = "<a calibrate step>", '
            "or drop calibrated = true"
        )
    if calibration is not None and not calibrated:
        raise StepError(
            "the step has a calibration input but no tensor has a calibrated role: "
            "set calibrated = true on the routed-expert role, or remove inputs.calibration"
        )
    return Tally()


def stored_parts(module: str, packed, scales, biases, s_dtype: str) -> dict:
    """A quantized weight's packed codes, scales and biases under its module's names, as the
    store takes a block of them (``qerror.put_measured``)."""
    return {
        f"{module}.weight": (packed, "U32"),
        f"{module}.scales": (scales, s_dtype),
        f"{module}.biases": (biases, s_dtype),
    }


def repack(codes, s32, b32, bits: int, s_dtype: str, s_np_dtype):
    """Codes and float32 scales and biases back to what is stored: packed uint32 codes, and
    scales and biases rounded to their storage dtype (bf16 as mlx rounds it)."""
    return pack(codes, bits), *stored_scales(s32, b32, s_dtype, s_np_dtype)


def stored_scales(s32, b32, s_dtype: str, s_np_dtype) -> tuple:
    """Float32 scales and biases as stored: rounded to their storage dtype (bf16 as mlx)."""
    return tuple(f32_to_bf16(x) if s_dtype == "BF16" else x.astype(s_np_dtype) for x in (s32, b32))


def expert_statistics(store, name: str, entry: dict, role: Role, calibration):
    """(importance [E, in] and tokens [E], or None where calibration has no statistics for it)
    of a routed-expert weight a calibrated role matches, once it is known to be one."""
    module, shape, g = name.removesuffix(".weight"), entry["shape"], role.group_size
    if SWITCH not in module or len(shape) != 3 or not name.endswith(".weight"):
        raise StepError(
            f"calibrated role matches {name!r} {shape}, which is not a routed-expert weight; "
            "calibration collects statistics for *.mlp.switch_mlp.* only: give this tensor a role "
            "without calibrated = true"
        )
    if shape[-1] % g:
        raise StepError(
            f"tensor {name!r}: last dimension {shape[-1]} is not a multiple of group_size {g}"
        )
    stats = calibstats.stats_for(store, calibration, module)
    E, _, C = shape
    if stats is not None and (stats[0].shape != (E, C) or stats[1].shape != (E,)):
        raise StepError(
            f"calibration statistics for {module} have shape {list(stats[0].shape)}, "
            f"expected {[E, C]}: the calibration was made from another model; point the "
            "calibrate step's input at this trunk's sanitize"
        )
    return stats


class SearchedBlocks:
    """A routed-expert weight's stored parts a block of experts at a time (what
    ``qerror.put_measured`` takes): the experts calibration reached searched with their own
    importance, the rest as mx.quantize does; ``won`` counts the groups the search improved."""

    def __init__(self, store, name: str, entry: dict, role: Role, stats, block_bytes: int):
        self.store, self.entry, self.role, self.block_bytes = store, entry, role, block_bytes
        self.module = name.removesuffix(".weight")
        self.importance = None if stats is None else stats[0]
        self.reached = np.zeros(entry["shape"][0], bool) if stats is None else stats[1] > 0
        self.won = 0

    def __iter__(self):
        from buildkit.quant import affine

        role, dtype = self.role, self.entry["dtype"]
        e0 = 0
        for raw in self.store.iter_rows(self.entry, self.block_bytes):
            ((packed, _), (s_np, s_dtype), (b_np, _)), sums = affine.like_mx(
                raw, dtype, role.bits, role.group_size, role.mode
            )
            here = np.flatnonzero(self.reached[e0 : e0 + len(raw)])
            if self.importance is not None and len(here):
                sums = None  # searched: its rel-L1 sums are put_measured's to take again
                packed, s_np, b_np = self.searched(raw, e0, here, packed, s_np, b_np, s_dtype)
            e0 += len(raw)
            made = stored_parts(self.module, packed, s_np, b_np, s_dtype)
            yield (raw, made) if sums is None else (raw, made, sums)

    def searched(self, raw, e0: int, here, packed, s_np, b_np, s_dtype: str) -> tuple:
        """The block's (packed, scales, biases) with the experts ``e0 + j`` (``j`` in ``here``)
        searched."""
        codes, s32, b32 = self.unpacked(packed, s_np, b_np, s_dtype)
        for j in here:
            self.search_expert(e0 + j, raw[j], codes[j], s32[j], b32[j], s_dtype)
        return repack(codes, s32, b32, self.role.bits, s_dtype, s_np.dtype)

    def unpacked(self, packed, s_np, b_np, s_dtype: str) -> tuple:
        """Stored (packed, scales, biases) as codes and float32 scales and biases to search in."""
        codes = unpack(packed, self.role.bits).copy()
        return codes, to_float32(s_np, s_dtype).copy(), to_float32(b_np, s_dtype).copy()

    def search_expert(self, e: int, raw, codes, s32, b32, s_dtype: str) -> None:
        """Expert e's codes [out, in] and float32 scales and biases [out, in / g], searched
        in place from the data-agnostic ones they hold, under its own importance."""
        bits, g = self.role.bits, self.role.group_size
        _, O, C = self.entry["shape"]
        imp = self.importance[e]
        d = imp + IMPORTANCE_FLOOR * max(float(imp.mean()), 1e-30)
        base = (codes.reshape(O, C // g, g), s32, b32)
        w = to_float32(raw, self.entry["dtype"]).reshape(O, C // g, g)  # one expert at a time
        q, s, b, better = search(w, d.reshape(1, C // g, g), bits, s_dtype, base)
        codes[...], s32[...], b32[...] = q.reshape(O, C), s, b
        self.won += int(better.sum())

    def dequantized(self, pick=None) -> Iterator[np.ndarray]:
        """The blocks iterating makes, dequantized to float32 as ``tensors.dequantize`` does the
        stored parts, but never packed: the experts calibration did not reach by the
        data-agnostic quantizer's one pass (``affine.dequantized_like_mx``), the reached ones
        searched and dequantized from their codes (sensitivity's candidates); with ``pick``
        (sorted row ids), the rows not in it are zero and cost nothing."""
        from buildkit.quant import affine

        role, dtype = self.role, self.entry["dtype"]
        bits, g = role.bits, role.group_size
        e0 = 0
        for raw in self.store.iter_rows(self.entry, self.block_bytes):
            wanted = np.zeros(len(raw), bool)
            wanted[picked_rows(pick, e0, len(raw))] = True
            reached = self.reached[e0 : e0 + len(raw)] & wanted  # none without statistics
            plain = wanted & ~reached
            if plain.all():  # the whole block by the one pass, not a copy of it
                out = affine.dequantized_like_mx(raw, dtype, bits, g, role.mode)
            else:
                out = np.zeros(raw.shape, np.float32)
                if plain.any():
                    out[plain] = affine.dequantized_like_mx(raw[plain], dtype, bits, g, role.mode)
            if reached.any():
                sub = raw[reached]
                ((packed, _), (s_np, s_dtype), (b_np, _)), _ = affine.like_mx(
                    sub, dtype, bits, g, role.mode
                )
                codes, s32, b32 = self.unpacked(packed, s_np, b_np, s_dtype)
                for j, e in enumerate(np.flatnonzero(reached) + e0):
                    self.search_expert(e, sub[j], codes[j], s32[j], b32[j], s_dtype)
                kept = stored_scales(s32, b32, s_dtype, s_np.dtype)
                s, b = (to_float32(x, s_dtype) for x in kept)
                out[reached] = dequantize_codes(codes, s, b, g)
            e0 += len(raw)
            yield out


def quantize_entry(
    store,
    name: str,
    entry: dict,
    role: Role,
    calibration,
    tally: Tally,
    block_bytes: int = ROW_BLOCK_BYTES,
) -> dict[str, dict]:
    """One routed-expert weight [E, out, in] -> weight/scales/biases, each expert reached by
    calibration searched with its own importance, the rest as mx.quantize does; a few experts
    at a time (``block_bytes``), so memory is a block, not the tensor."""
    from buildkit.quant import qerror

    stats = expert_statistics(store, name, entry, role, calibration)
    blocks = SearchedBlocks(store, name, entry, role, stats, block_bytes)
    module, (E, O, C), g = blocks.module, entry["shape"], role.group_size
    out = qerror.put_measured(store, E, iter(blocks), module, entry["dtype"], role.bits, g)
    reached = blocks.reached
    with tally.lock:
        tally.tensors += 1
        tally.expert_slices += int(reached.sum())
        if stats is None:
            tally.no_statistics.append(name)
        else:
            tally.groups += int(reached.sum()) * O * (C // g)
            tally.groups_won += blocks.won
            tally.fallback.setdefault(module.partition(SWITCH)[0], set()).update(
                np.flatnonzero(~reached).tolist()
            )
    return out
