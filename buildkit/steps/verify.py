"""verify: the tensor-level checks a release must pass, each with its figure.

The reference for every check is recomputed from the raw source files, not
taken from the steps under test: norms with mlx's own ``bf16 + 1.0`` (what
mlx_lm's sanitize does), passthrough tensors byte for byte, quantized tensors
by dequantizing and measuring rel-L1 against the source, fused experts by
reassembling them. The report is the step's output (``verify.json``); any
failed check fails the build and names the tensors.

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
from buildkit.core.lazy import lazy
from buildkit.engine.step import Context, Params, Slot, Step, library_version, register
from buildkit.formats import checkpoint as ckpt
from buildkit.formats.checkpoint import PROJS, SWITCH
from buildkit.formats.convert import mlx_layout, view
from buildkit.formats.tensors import dequantize as dequantize_np
from buildkit.formats.tensors import nbytes, non_finite, read_slice, to_float32
from buildkit.grade import calibration as cal
from buildkit.store.artifact import Artifact

np = lazy("numpy", __name__)

DEFAULT_REL_L1 = {"2": 0.6, "3": 0.3, "4": 0.16, "5": 0.08, "6": 0.045, "8": 0.012}


class VerifyParams(Params):
    max_rel_l1: dict[str, float] = Field(default_factory=lambda: dict(DEFAULT_REL_L1))
    only: str | None = None  # check only the tensors whose MLX names match this glob


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


def layer_expert_errors(
    store, heldout: dict, sources: dict, stored: dict, qargs: dict, skip: list[int]
) -> dict:
    """One MoE layer's part of ``calibrated_expert_error`` (a task: ``Context.map``): each
    expert's relative output error (``calibration.expert_errors``) on its held-out rows, of the
    stored (data-aware) weights and of data-agnostic ``mx.quantize`` of the raw source (NaN
    where no row reaches it; the experts in ``skip`` left out). ``sources``: per projection, a
    view of the raw source file; ``stored``: per projection, its weight, scales and biases
    entries; ``qargs``: per projection, (bits, group size, mode). One expert is in memory at a
    time, dequantized by buildkit's own float32 arithmetic (as the rel-L1 checks: faster than
    ``mx.dequantize`` on the CPU); the stored tensors' digests are checked as they stream."""
    from buildkit.quant import (
        affine,  # numba: mx.quantize's values, dequantized, in one compiled pass
    )

    projs = list(sources)
    n = len(projs)
    # one expert a block: the source, then each projection's weight, scales and biases
    its = [store.iter_rows(sources[p], 1) for p in projs]
    its += [store.iter_rows(e, 1) for p in projs for e in stored[p]]

    def dequantized(p: str, w, s, b) -> np.ndarray:
        bits, group, _ = qargs[p]
        sdt = stored[p][1]["dtype"]
        return dequantize_np(w[0], to_float32(s[0], sdt), to_float32(b[0], sdt), bits, group)

    def agnostic(p: str, raw) -> np.ndarray:
        bits, group, mode = qargs[p]
        return affine.dequantized_like_mx(raw, sources[p]["dtype"], bits, group, mode)[0]

    def blocks():
        for got in zip(*its):
            raw, q = (
                dict(zip(projs, got[:n])),
                {p: got[n + 3 * i : n + 3 * i + 3] for i, p in enumerate(projs)},
            )

            def weights(variant: str, raw=raw, q=q) -> dict[str, np.ndarray]:
                if variant == "ref":
                    return {p: to_float32(raw[p][0], sources[p]["dtype"]) for p in projs}
                if variant == "aware":
                    return {p: dequantized(p, *q[p]) for p in projs}
                return {p: agnostic(p, raw[p]) for p in projs}

            yield weights
        for it in its:  # each reader run to its end: the stored tensors' digest checks
            if next(it, None) is not None:
                raise VerifyError(
                    f"{sources[projs[0]]['view']['tensor']}: a stored expert tensor and its "
                    "source have different numbers of experts"
                )

    x = to_float32(store.read_tensor(heldout["inputs"]), "BF16")
    chosen = store.read_tensor(heldout["experts"])
    errs = cal.expert_errors(x, chosen, blocks(), ["aware", "agnostic"], skip=set(skip))
    keep = [e for e in range(len(errs["aware"])) if e not in set(skip)]
    return {"tokens": len(x), **{v: [float(e[i]) for i in keep] for v, e in errs.items()}}


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
    aware, agnostic = [], []
    unseen = tokens = 0
    for r in ctx.map(layer_expert_errors, tasks):
        tokens = max(tokens, r["tokens"])
        for a, b in zip(r["aware"], r["agnostic"]):
            if math.isnan(a):
                unseen += 1
                continue
            aware.append(a)
            agnostic.append(b)
    mean_a = sum(aware) / len(aware) if aware else math.nan
    mean_b = sum(agnostic) / len(agnostic) if agnostic else math.nan
    figure = {
        "experts": len(aware),
        "heldout_tokens": tokens,
        "data_aware": round(mean_a, 5) if aware else None,
        "data_agnostic": round(mean_b, 5) if aware else None,
        "reduction": f"{100 * (1 - mean_a / mean_b):.1f}%" if aware else None,
        "worse_experts": int(sum(a > b for a, b in zip(aware, agnostic))),
        "fallback_experts": sum(map(len, fallback.values())),
        "no_heldout_token": unseen,
    }
    if not aware:
        problems.append("no data-aware expert is reached by a held-out token; nothing to compare")
    elif not mean_a < mean_b:
        problems.append(
            f"data-aware mean error {mean_a:.5f} is not below data-agnostic {mean_b:.5f}"
        )
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
        if r["split"] is not None:
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
    return not bad and split["checked"] > 0, split, bad or None


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
