"""verify's measures: each source tensor against what a build stored from it, and each
data-aware expert's output error against data-agnostic quantization of the same weights.

Every reference is recomputed from the raw source files in buildkit's own float32 numpy
arithmetic (``tensors.dequantize``), independent of mlx's kernels: norms and passthrough
tensors byte for byte, quantized tensors by rel-L1 of their dequantized rows, fused experts
by reassembling them (``Inspect``, ``Measure``), experts by their outputs on held-out rows
(``layer_expert_errors``, ``compare_experts``). Degenerate weights (all-zero experts, rows or
groups; an expert no token reaches) give figures or a counted skip, never a division by zero.
"""

from __future__ import annotations

import math

from buildkit.core.errors import VerifyError
from buildkit.core.lazy import lazy
from buildkit.formats import checkpoint as ckpt
from buildkit.formats.convert import mlx_layout
from buildkit.formats.tensors import dequantize as dequantize_np
from buildkit.formats.tensors import nbytes, non_finite, read_slice, to_float32
from buildkit.grade import calibration as cal

np = lazy("numpy", __name__)


def read_raw(store, hf: str, digest: str, info) -> np.ndarray:
    return store.read_tensor(
        {"dtype": info.dtype, "shape": list(info.shape), "view": {"file": digest, "tensor": hf}}
    )


BLOCK_BYTES = 1 << 20  # rows of source compared at a time: temporaries stay small and reused


def inspect_tensor(store, item, model: dict, roles_q: dict, recorded: dict) -> dict:
    """``Inspect`` as a task (``Context.map``): ``model``, ``roles_q`` and ``recorded`` need
    hold only the entries of the MLX tensors made from ``item``'s source tensor."""
    return Inspect(store, model, roles_q, recorded)(item)


def task_slice(item, model: dict, roles_q: dict, recorded: dict) -> tuple[dict, dict, dict]:
    """The entries, quantization records and recorded errors ``Inspect`` reads for one source
    tensor."""
    bases = {n.removesuffix(".weight") for n, _, _ in item[3]}
    names = {f"{b}.{k}" for b in bases for k in ("weight", "scales", "biases")} | {
        n for n, _, _ in item[3]
    }
    return (
        {n: model[n] for n in sorted(names) if n in model},
        {b: roles_q[b] for b in sorted(bases) if b in roles_q},
        {n: recorded[n] for n in sorted(names) if n in recorded},
    )


class Inspect:
    """All per-tensor checks for one source tensor and the MLX tensors made from it.

    The source is read once; gate and up of a fused tensor are checked against it together,
    block by block along the first axis, in float32 numpy arithmetic of buildkit's own
    (``tensors.dequantize``), independent of mlx's kernels.
    """

    def __init__(self, store, model: dict, roles_q: dict, recorded: dict | None = None):
        self.store, self.model, self.roles_q = store, model, roles_q
        self.recorded = recorded or {}  # weight -> rel-L1 quantize measured on what it wrote

    def quant(self, name: str) -> dict | None:
        base = name.removesuffix(".weight")
        if name.endswith(".weight") and base in self.roles_q and f"{base}.scales" in self.model:
            return self.roles_q[base]
        return None

    def streamed(self, hf: str, info, pieces) -> bool:
        """A large passthrough tensor stored as its source lies (a plain view: bf16 lm_head,
        1 GB in the real model), compared block by block instead of read whole, twice."""
        if len(pieces) != 1 or info.nbytes <= BLOCK_BYTES or not info.shape:
            return False
        name, slc, shape = pieces[0]
        return (
            self.quant(name) is None
            and name in self.model
            and slc is None
            and tuple(shape) == tuple(info.shape)
            and not (ckpt.is_offset_norm(hf) or ckpt.is_conv1d(hf) or ckpt.is_patch_embed(hf))
        )

    def same_in_blocks(self, digest: str, info, entry: dict) -> tuple[bool, bool]:
        """(stored bytes equal the source's, the source has a NaN or Inf), a block of rows at a
        time."""
        path, _ = self.store.header(digest)
        rows = info.shape[0]
        row_bytes = info.nbytes // max(rows, 1)
        step = max(1, BLOCK_BYTES // max(row_bytes, 1))
        same = entry["dtype"] == info.dtype and list(entry["shape"]) == list(info.shape)
        stored = self.store.iter_rows(entry, step * row_bytes) if same else None
        bad = False
        for a in range(0, rows, step):
            src = read_slice(info, path, 0, a, min(rows, a + step))
            bad = bad or non_finite(src, info.dtype)
            if same:
                got = next(stored, None)
                same = got is not None and got.shape == src.shape and got.tobytes() == src.tobytes()
        if same and next(stored, None) is not None:  # runs the reader to its end (digest check)
            same = False
        return same, bad

    def __call__(self, item) -> dict:
        hf, digest, info, pieces = item
        r = {
            "hf": hf,
            "norm": [],
            "pass": [],
            "nonfinite": [],
            "shape_bad": [],
            "err": {},
            "sampled": {},  # first rows only, beside quantize's figure for all of them
            "split": None,
            "bytes": info.nbytes,
        }
        if self.streamed(hf, info, pieces):
            name = pieces[0][0]
            same, bad = self.same_in_blocks(digest, info, self.model[name])
            r["pass"].append((name, same))
            if bad:
                r["nonfinite"].append(name)
            return r
        exact = any(self.quant(n) is None and n in self.model for n, _, _ in pieces)
        # Compared byte for byte: read whole (norms, passthrough: small tensors). Quantized
        # pieces are compared block by block, reading only those rows of the source.
        raw = read_raw(self.store, hf, digest, info) if exact else None
        if raw is not None and non_finite(raw, info.dtype):  # named as the MLX tensors made from it
            r["nonfinite"] += [name for name, _, _ in pieces]
        dense = self.compare_exact(r, hf, raw, info, pieces)
        if dense:
            Measure(self, r, item, raw, dense).run()
        return r

    def compare_exact(self, r: dict, hf: str, raw, info, pieces) -> list[tuple]:
        """Records in ``r`` the pieces stored as their source lies, compared byte for byte, and
        quantized pieces of the wrong shape; returns the pieces to compare numerically
        (``Measure``): quantized ones and the slices of a fused tensor found identical."""
        dense = []  # (name, slice, shape, quantization or None)
        for name, slc, shape in pieces:
            q = self.quant(name)
            if q is not None:
                pack = 32 // q["bits"] if 32 % q["bits"] == 0 else None
                w = self.model[f"{name.removesuffix('.weight')}.weight"]
                if w["shape"][:-1] != list(shape[:-1]) or (
                    pack and w["shape"][-1] * pack != shape[-1]
                ):
                    r["shape_bad"].append(name)
                else:
                    dense.append((name, slc, shape, q))
                continue
            if name not in self.model:
                continue  # the key-set check reports it
            ref = mlx_layout(hf, raw, info.dtype, slc, shape)
            got = self.store.read_tensor(self.model[name])
            same = (
                got.dtype == ref.dtype and got.shape == ref.shape and got.tobytes() == ref.tobytes()
            )
            (r["norm"] if ckpt.is_offset_norm(hf) else r["pass"]).append((name, same))
            if slc is not None and same:  # a slice of a fused tensor: counts in the split check
                dense.append((name, slc, shape, None))
        return dense


class Measure:
    """rel-L1 of one source tensor's numerically compared pieces, block by block along its
    first axis, and for a fused pair the same figure with the two pieces exchanged; the
    results go into the ``Inspect`` report ``r``."""

    def __init__(self, inspect: Inspect, r: dict, item, raw, dense: list[tuple]):
        self.inspect, self.r, self.raw, self.dense = inspect, r, raw, dense
        hf, digest, self.info, self.pieces = item
        self.path, _ = inspect.store.header(digest)
        self.rows = self.info.shape[0]
        self.step = max(1, BLOCK_BYTES // max(1, self.info.nbytes // max(self.rows, 1)))
        # name -> (blocks of the stored weight, float32 scales, float32 biases)
        self.stored = {n: self.stored_of(n, q) for n, _, _, q in dense}
        # Where quantize measured a tensor's error on every row as it wrote it (the figure
        # checked below), this independent measure reads only the first block of rows: enough
        # to catch a wrong mapping from the source (a swapped, transposed or misnamed tensor
        # errs in every row); the digests check the stored bytes.
        quantized = [n for n, _, _, q in dense if q is not None]
        self.sample = bool(quantized) and all(n in inspect.recorded for n in quantized)
        self.num = {n: 0.0 for n, *_ in dense}
        self.den = dict(self.num)
        self.swapped = self.swapped_den = 0.0  # gate|up against up|gate, in the first block
        self.bad_rows = False
        self.scratch: dict[tuple, np.ndarray] = {}  # float32 buffers, one per block shape

    def blocks(self, entry: dict):
        """The stored tensor's rows, ``step`` at a time, alongside the source's (its digest is
        checked once the last block has passed)."""
        row = nbytes(entry["dtype"], entry["shape"]) // max(entry["shape"][0], 1)
        return self.inspect.store.iter_rows(entry, self.step * row)

    def stored_of(self, n: str, q: dict | None) -> tuple:
        model = self.inspect.model
        if q is None:
            return self.blocks(model[n]), None, None
        base = n.removesuffix(".weight")
        # scales and biases (1/32 of the weight at most) whole, to float32 once
        return (
            self.blocks(model[f"{base}.weight"]),
            *(
                to_float32(
                    self.inspect.store.read_tensor(model[f"{base}.{k}"]),
                    model[f"{base}.{k}"]["dtype"],
                )
                for k in ("scales", "biases")
            ),
        )

    def abs_sum(self, x: np.ndarray, y: np.ndarray | None = None) -> np.float32:
        """sum |x - y| (or sum |x|), through a reused buffer instead of fresh temporaries."""
        buf = self.scratch.get(x.shape)
        if buf is None:
            buf = self.scratch[x.shape] = np.empty(x.shape, np.float32)
        if y is None:
            np.abs(x, out=buf)
        else:
            np.abs(np.subtract(x, y, out=buf), out=buf)
        return buf.sum()

    def run(self) -> None:
        rows, step = self.rows, self.step
        for a in range(0, min(rows, step) if self.sample else rows, step):
            self.block(a, min(rows, a + step))
        for it, _, _ in self.stored.values():
            if self.sample:
                it.close()
            elif next(it, None) is not None:  # runs the reader to its end: the digest check
                raise VerifyError(f"{self.r['hf']}: a stored tensor has more rows than its source")
        self.report()

    def block(self, a: int, b: int) -> None:
        info = self.info
        block = self.raw[a:b] if self.raw is not None else read_slice(info, self.path, 0, a, b)
        src = to_float32(block, info.dtype)
        refs, outs = [], []
        for n, slc, shape, q in self.dense:
            if slc is not None:
                axis, lo, hi = slc
                idx = [slice(None)] * src.ndim
                idx[axis] = slice(lo, hi)
                ref = src[tuple(idx)].reshape(b - a, *shape[1:])
            else:
                ref = src.reshape(b - a, *shape[1:])
            it, sc, bi = self.stored[n]
            if q is not None:
                got = dequantize_np(next(it), sc[a:b], bi[a:b], q["bits"], q["group_size"])
            else:
                got = to_float32(next(it), self.inspect.model[n]["dtype"])
            self.accumulate(n, ref, got, block)
            refs.append(ref)
            outs.append(got)
        # The order figure: the pieces exchanged, in the first block of rows (the first
        # experts). An exchange anywhere shows in the error of every row, measured above.
        if len(self.dense) == 2 and a == 0:
            self.swapped = float(self.abs_sum(refs[0], outs[1]) + self.abs_sum(refs[1], outs[0]))
            self.swapped_den = sum(self.den.values())

    def accumulate(self, n: str, ref: np.ndarray, got: np.ndarray, block: np.ndarray) -> None:
        nonfinite = self.r["nonfinite"]
        # A NaN or Inf in the source makes sum |ref| one too, and one in got makes err
        # one: only then look for it (the source's on its bits), not in every block.
        d = float(self.abs_sum(ref))
        if (
            not math.isfinite(d)
            and self.raw is None
            and not self.bad_rows
            and non_finite(block, self.info.dtype)
        ):
            self.bad_rows = True  # named as the MLX tensors made from it
            nonfinite += [name for name, _, _ in self.pieces if name not in nonfinite]
        err = float(self.abs_sum(ref, got))
        if not math.isfinite(err) and not np.isfinite(got).all() and n not in nonfinite:
            nonfinite.append(n)
        self.num[n] += err
        self.den[n] += d

    def report(self) -> None:
        r, num, den = self.r, self.num, self.den
        for n, _, _, q in self.dense:
            if q is not None:
                mine = num[n] / max(den[n], 1e-30)
                r["err"][n] = (str(q["bits"]), self.inspect.recorded[n] if self.sample else mine)
                if self.sample:
                    r["sampled"][n] = (str(q["bits"]), mine)
        if len(self.dense) == 2:
            tot = max(sum(den.values()), 1e-30)
            r["split"] = (sum(num.values()) / tot, self.swapped / max(self.swapped_den, 1e-30))


class ExpertWeights:
    """One MoE layer's experts, one at a time, for ``calibration.expert_errors``: iterating
    yields, for each expert, ``weights(variant)``: its float32 gate/up/down from the raw source
    (``"ref"``), dequantized from the stored bytes (``"aware"``), or quantized data-agnostic by
    ``mx.quantize``'s arithmetic (``"agnostic"``). ``sources``: per projection, a view of the raw
    source file; ``stored``: its weight, scales and biases entries; ``qargs``: its (bits, group
    size, mode). An expert with an all-zero gate, up or down outputs zero, so no relative error
    is defined: it joins ``skip`` (asked after each expert is yielded) and is counted in
    ``zero``."""

    def __init__(self, store, sources: dict, stored: dict, qargs: dict, skip: set[int]):
        self.sources, self.stored, self.qargs = sources, stored, qargs
        self.skip, self.zero = skip, []
        self.projs = list(sources)
        # one expert a block: the source, then each projection's weight, scales and biases
        self.its = [store.iter_rows(sources[p], 1) for p in self.projs]
        self.its += [store.iter_rows(e, 1) for p in self.projs for e in stored[p]]

    def dequantized(self, p: str, w, s, b) -> np.ndarray:
        bits, group, _ = self.qargs[p]
        sdt = self.stored[p][1]["dtype"]
        return dequantize_np(w[0], to_float32(s[0], sdt), to_float32(b[0], sdt), bits, group)

    def agnostic(self, p: str, raw) -> np.ndarray:
        from buildkit.quant import affine  # numba: mx.quantize's values, dequantized, one pass

        bits, group, mode = self.qargs[p]
        return affine.dequantized_like_mx(raw, self.sources[p]["dtype"], bits, group, mode)[0]

    def __iter__(self):
        projs, n = self.projs, len(self.projs)
        for e, got in enumerate(zip(*self.its)):
            raw = dict(zip(projs, got[:n]))
            q = {p: got[n + 3 * i : n + 3 * i + 3] for i, p in enumerate(projs)}
            if e not in self.skip and not all(raw[p][0].any() for p in projs):
                self.zero.append(e)
                self.skip.add(e)

            def weights(variant: str, raw=raw, q=q) -> dict[str, np.ndarray]:
                if variant == "ref":
                    return {p: to_float32(raw[p][0], self.sources[p]["dtype"]) for p in projs}
                if variant == "aware":
                    return {p: self.dequantized(p, *q[p]) for p in projs}
                return {p: self.agnostic(p, raw[p]) for p in projs}

            yield weights
        for it in self.its:  # each reader run to its end: the stored tensors' digest checks
            if next(it, None) is not None:
                raise VerifyError(
                    f"{self.sources[projs[0]]['view']['tensor']}: a stored expert tensor and its "
                    "source have different numbers of experts"
                )


def layer_expert_errors(
    store, heldout: dict, sources: dict, stored: dict, qargs: dict, skip: list[int]
) -> dict:
    """One MoE layer's part of ``calibrated_expert_error`` (a task: ``Context.map``): each
    expert's relative output error (``calibration.expert_errors``) on its held-out rows, of the
    stored (data-aware) weights and of data-agnostic ``mx.quantize`` of the raw source (NaN
    where no row reaches it or it outputs zero; the experts in ``skip`` left out). One expert
    is in memory at a time, dequantized by buildkit's own float32 arithmetic (as the rel-L1
    checks: faster than ``mx.dequantize`` on the CPU); the stored tensors' digests are checked
    as they stream (``ExpertWeights``)."""
    experts = ExpertWeights(store, sources, stored, qargs, set(skip))
    x = to_float32(store.read_tensor(heldout["inputs"]), "BF16")
    chosen = store.read_tensor(heldout["experts"])
    errs = cal.expert_errors(x, chosen, experts, ["aware", "agnostic"], skip=experts.skip)
    keep = [e for e in range(len(errs["aware"])) if e not in set(skip)]
    figures = {v: [float(e[i]) for i in keep] for v, e in errs.items()}
    return {"tokens": len(x), "zero": len(experts.zero), **figures}


def compare_experts(results, fallback_experts: int) -> tuple[dict, list[str]]:
    """(figure, problems) of the per-layer results of ``layer_expert_errors``: the mean error
    of data-aware and of data-agnostic experts over the experts a held-out token reaches. An
    expert neither variant errs on (all-zero weights, or exactly representable) says nothing
    of which is better: counted as exact, left out of the means; so is an expert whose source
    outputs zero (``zero_experts``), whose relative error is undefined."""
    aware, agnostic = [], []
    unseen = exact = tokens = zero = 0
    for r in results:
        tokens = max(tokens, r["tokens"])
        zero += r["zero"]
        unseen -= r["zero"]  # NaN too, but for want of a reference, not of a token
        for a, b in zip(r["aware"], r["agnostic"]):
            if math.isnan(a) or math.isnan(b):
                unseen += 1
            elif a == b == 0:
                exact += 1
            else:
                aware.append(a)
                agnostic.append(b)
    mean_a = sum(aware) / len(aware) if aware else None
    mean_b = sum(agnostic) / len(agnostic) if agnostic else None
    figure = {
        "experts": len(aware),
        "heldout_tokens": tokens,
        "data_aware": round(mean_a, 5) if aware else None,
        "data_agnostic": round(mean_b, 5) if aware else None,
        "reduction": f"{100 * (1 - mean_a / mean_b):.1f}%" if aware and mean_b else None,
        "worse_experts": int(sum(a > b for a, b in zip(aware, agnostic))),
        "fallback_experts": fallback_experts,
        "no_heldout_token": unseen,
        # reports without such experts keep their bytes
        **({"zero_experts": zero} if zero else {}),
        **({"exact_experts": exact} if exact else {}),
    }
    problems = []
    if not aware and not exact and not zero:
        problems.append("no data-aware expert is reached by a held-out token; nothing to compare")
    elif aware and not mean_a < mean_b:
        problems.append(
            f"data-aware mean error {mean_a:.5f} is not below data-agnostic {mean_b:.5f}"
        )
    return figure, problems
