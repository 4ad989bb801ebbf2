"""Sensitivity's measurement: how far the model's next-token distributions move from the bf16
source's when one group of tensors alone is quantized.

The bf16 trunk runs once (``forward.whole_layer``: every matmul in numpy, the candidates'
tensors dequantized, so the reference and every candidate share one arithmetic and differ
only by the group), keeping the hidden states entering each layer and the final
log-probabilities; then, per layer, every candidate of that layer's groups from its kept
input, all of them together through each later bf16 layer (each later layer read once per
measured layer, not per candidate), and the output head. What a candidate's tensors are is
the caller's (``quant.budget.dequantized``: as the build quantizes them).

``local`` estimates the same figures for about one layer pass per candidate instead of a pass
through every later layer: each candidate's error in its own layer's output, as a power of it
fitted where the KL was measured at a few layers. The 35B model's oq runs ~9x fewer layer
passes so; the plans it gives are checked against ``measure``'s in tests/quant. It streams
(``forward.streamed_layer``, candidates a block of rows at a time, KL by ``forward.HeadScan``),
so its memory does not grow with the model; ``measure`` holds layers whole and the source's
log-probabilities (tokens x vocabulary floats), for small models.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator

from buildkit.core.errors import StepError
from buildkit.core.lazy import lazy
from buildkit.formats.checkpoint import SWITCH
from buildkit.grade import forward as fw
from buildkit.grade import texts
from buildkit.grade.weights import Swapped, Weights

np = lazy("numpy", __name__)

EMBED = "language_model.model.embed_tokens.weight"

# a group's tensors at ``bits``, dequantized to float32, as the build would store them
Candidate = Callable[[str, int], "np.ndarray"]


def reference_logprobs(out: fw.Output, h: list, seqs: list[np.ndarray]) -> list[np.ndarray]:
    """Log-probabilities of each sequence (``forward.rows``' order) from final hidden states."""
    return [fw.np_logprobs(np.array(out(h[j][r]))) for j, r, _ in fw.rows(seqs)]


def mean_kl(out: fw.Output, ref: list[np.ndarray], h: list, seqs: list[np.ndarray]) -> float:
    """Mean KL(ref || model) over the positions that have a next token, of final hidden
    states ``h`` against ``ref`` (``reference_logprobs``)."""
    total, n = 0.0, 0
    for lp_ref, (j, r, s) in zip(ref, fw.rows(seqs), strict=True):
        m = len(s) - 1
        lp = fw.np_logprobs(np.array(out(h[j][r])[:m]))
        k = (np.exp(lp_ref[:m]) * (lp_ref[:m] - lp)).sum(axis=-1)
        total, n = total + float(np.maximum(k, 0.0).astype(np.float64).sum()), n + m
    return total / max(n, 1)


def swap(module, names: list[str], deq: dict[str, np.ndarray]) -> Callable[[], None]:
    """Set a group's weights in a numpy layer to ``deq`` (name -> float32); returns how to put
    the originals back."""
    sw = module.mlp.switch_mlp
    inter = sw.down.shape[-1]
    undo, expert = [], {}
    for n in names:
        rel = n.removesuffix(".weight").split(".", 4)[4]  # after language_model.model.layers.N
        if SWITCH.lstrip(".") + "." in rel:
            expert[rel.rpartition(".")[2]] = deq[n]
            continue
        owner = module
        for part in rel.split("."):
            owner = getattr(owner, part)
        undo.append((owner, owner.w))
        owner.w = deq[n]
    if expert:
        own = {
            "gate_proj": sw.gate_up[:, :inter],
            "up_proj": sw.gate_up[:, inter:],
            "down_proj": sw.down,
        } | expert
        module.mlp.switch_mlp = fw.whole_switch(
            np.concatenate([own["gate_proj"], own["up_proj"]], 1), own["down_proj"]
        )

    def undo_all():
        for owner, w in undo:
            owner.w = w
        module.mlp.switch_mlp = sw

    return undo_all


class Measure:
    """One sensitivity run over ``w`` (a bf16 model) on ``tokens``."""

    def __init__(self, w: Weights, tokens: list[int], seq_len: int, progress=None):
        self.w, self.progress = w, progress
        self.args = fw.text_args(w)
        self.n_layers = self.args.num_hidden_layers
        self.seqs = texts.windows(tokens, seq_len)
        self.hs = [fw.embed(w, self.seqs)]  # hs[i]: what enters layer i, then the last output
        for i in range(self.n_layers):
            self.hs.append(fw.run_layer(self.layer(i), self.hs[i]))
        self.out = fw.Output(w)
        self.out.lm_head = fw.np_linear(np.array(self.out.lm_head.weight))
        self.ref = reference_logprobs(self.out, self.hs[-1], self.seqs)

    def layer(self, i: int):
        return fw.whole_layer(self.w, i, self.args)

    def kl(self, h: list) -> float:
        if self.progress:
            self.progress.advance(1)
        return float(f"{mean_kl(self.out, self.ref, h, self.seqs):.6g}")

    def at(self, i: int, cands: dict[tuple, Callable]) -> dict[tuple, float]:
        """KL of each candidate of layer ``i`` (-1 the embeddings, ``n_layers`` or more
        lm_head): ``cands[c]()`` gives candidate c's tensors (name -> float32)."""
        if i >= self.n_layers:  # lm_head: the last layer's output through a candidate head
            got, bf16 = {}, self.out.lm_head
            for c, make in cands.items():
                (deq,) = make().values()
                self.out.lm_head = fw.np_linear(deq)
                got[c] = self.kl(self.hs[-1])
                self.out.lm_head = bf16
            return got
        return self.after(i, dict(self.outputs(i, cands)))

    def outputs(self, i: int, cands: dict[tuple, Callable]):
        """(candidate, layer ``i``'s output with it) for each of ``cands``, the layer read once;
        of the embeddings (-1), a candidate's table looked up."""
        import mlx.core as mx

        module = None if i == -1 else self.layer(i)
        for c, make in cands.items():
            if i == -1:
                yield c, [mx.array(make()[EMBED][s]) for s in self.seqs]
                continue
            undo = swap(module, c[1], make())
            h = fw.run_layer(module, self.hs[i])
            undo()
            yield c, h

    def after(self, i: int, hs: dict) -> dict:
        """KL of each of ``hs`` (outputs of layer ``i``, -1 the embeddings) run through the
        later layers, which are bf16 and read once for all."""
        for k in range(i + 1, self.n_layers):
            later = self.layer(k)
            hs = {c: fw.run_layer(later, h) for c, h in hs.items()}
        return {c: self.kl(h) for c, h in hs.items()}


def _by_layer(groups: dict[str, list[str]], layer_of: Callable[[str], int]) -> dict[int, list]:
    """layer -> the groups in it; a group spanning layers is an error."""
    by_layer: dict[int, list[str]] = {}
    for g, names in groups.items():
        if len({layer_of(n) for n in names}) != 1:
            raise StepError(f"sensitivity group {g} spans layers: {names}")
        by_layer.setdefault(layer_of(names[0]), []).append(g)
    return dict(sorted(by_layer.items()))


def _candidates(groups, bits, layer_groups, candidate: Candidate) -> dict[tuple, Callable]:
    """(group, its tensors, bits) -> how to make that candidate's tensors, for ``m.at``."""
    return {
        c: (lambda names=c[1], b=c[2]: {n: candidate(n, b) for n in names})
        for c in _keys(groups, bits, layer_groups)
    }


def measure(
    w: Weights,
    groups: dict[str, list[str]],
    bits: dict[str, list[int]],
    layer_of: Callable[[str], int],
    candidate: Candidate,
    tokens: list[int],
    seq_len: int,
    progress=None,
) -> dict[str, dict[int, float]]:
    """Mean KL on ``tokens`` for each group and each of its ``bits`` (quantized ones), that
    group's tensors alone replaced by ``candidate(name, bits)``. ``layer_of(name)``: the
    layer a tensor is in (-1 the embeddings, past the last lm_head)."""
    by_layer = _by_layer(groups, layer_of)
    m = Measure(w, tokens, seq_len)
    if progress:
        progress.start(sum(len(bits[g]) for g in groups), "candidates")
    m.progress = progress
    result: dict[str, dict[int, float]] = {g: {} for g in groups}
    for i, layer_groups in by_layer.items():
        for (g, _, b), kl in m.at(i, _candidates(groups, bits, layer_groups, candidate)).items():
            result[g][b] = kl
    return result


def squared_error(a: list, b: list) -> float:
    """Mean over positions of the squared norm of ``a - b`` (lists of [B, L, H] arrays)."""
    import mlx.core as mx

    total, n = 0.0, 0
    for x, y in zip(a, b, strict=True):
        d = x.astype(mx.float32) - y.astype(mx.float32)
        total += float(mx.sum(d * d))
        n += d.shape[0] * d.shape[1]
    return total / max(n, 1)


def kind(group: str) -> str:
    """What a group is within its layer, for the gains: ``mlp.switch_mlp``, ``attention``
    (``self_attn`` and ``linear_attn`` alike), ``mlp.shared_expert``, ``mlp.gate``, …; the
    group itself outside the decoder layers."""
    if ".layers." not in group:
        return group
    rel = group.split(".layers.", 1)[1].partition(".")[2]
    head, _, rest = rel.partition(".")
    if not head.endswith("_attn"):
        return rel
    return f"attention.{rest}" if rest else "attention"


# a sensitivity candidate's tensor in float32 blocks: (name, bits, rows, pick=None) -> blocks
# of ``rows``, only the rows in ``pick`` (sorted ids) made where it is given
Blocks = Callable[..., Iterator["np.ndarray"]]
# models beside the source in one head scan: each block's logits, 8 MB a model at 2048
# positions, wait three blocks deep (~220 MB); the source's half of every KL made once
KL_GROUP = 8
GROUP = 8  # hidden-state lists through one MoE call: ~100 MB a list at 2048 tokens and H 2048
# (was 4 while the MoE kept every choice's output, lists x tokens x 8 x H floats)


def local(
    w: Weights,
    groups: dict[str, list[str]],
    bits: dict[str, list[int]],
    layer_of: Callable[[str], int],
    blocks: Blocks,
    tokens: list[int],
    seq_len: int,
    probes: list[int],
    progress=None,
) -> tuple[dict[str, dict[int, float]], dict[str, float]]:
    """``measure``'s figures estimated at about the cost of one layer pass per candidate, in
    one pass over the layers, streamed (``forward.streamed_layer``; a candidate's tensors made
    a block of rows at a time, ``blocks``): memory is a layer's small modules, a block of
    experts and some hidden states, at any model size.

    Each candidate runs its own layer only: its error e is the mean squared change of that
    layer's output (the residual stream, what every later layer reads). Its KL is estimated as
    ``gain * e ** power``, fitted for each kind of group (``kind``: the routed experts,
    attention, the shared expert, …) at the decoder layers ``probes`` (and at the embeddings)
    by carrying that group's largest- and smallest-error candidates' outputs through every
    later layer beside the source's (``fit``), and interpolated between probed layers (log
    gain and power): how much the later layers amplify an error varies smoothly with depth,
    and differs by what made it (one gain for every kind planned worse plans: RESULTS). The
    power is not 1 where a small change flips some tokens' choice of experts downstream (64
    experts, top 4: KL went as e ** 0.5 at high bits; a gain alone put 8-bit candidates at
    1/13 to 1/57 of their KL: RESULTS). lm_head's candidates are measured (the output head
    streamed over the vocabulary). Returns the figures and the fits, keyed ``"<layer>
    <kind>"`` (layer -1 the embeddings) as ``{"gain", "power"}``."""
    by_layer = _by_layer(groups, layer_of)
    run = LocalPass(w, texts.windows(tokens, seq_len), blocks, progress)
    probes_at = {*probes, *([-1] if -1 in by_layer else [])}
    n_probes = sum(
        min(len(bits[g]), CARRIED) for i, gs in by_layer.items() if i in probes_at for g in gs
    )
    if progress:
        progress.start(sum(len(bits[g]) for g in groups) + n_probes, "candidates and probes")
    cands = {i: _keys(groups, bits, gs) for i, gs in by_layer.items()}
    hn = run.trunk(cands, probes_at)
    result: dict[str, dict[int, float]] = {g: {} for g in groups}
    heads = [c for i in by_layer if i >= run.n for c in cands[i]]  # lm_head's: measured
    for c, kl in zip(heads, run.kls(hn, (hn for _ in heads), map(run.swapped, heads))):
        result[c[0]][c[2]] = float(f"{kl:.6g}")
    fits = run.fits(hn)
    if progress:  # a probed group no candidate moved (all-zero weights) has nothing to carry
        progress.advance(n_probes - sum(len(run.ends(key)) for key in run.carried))
    for (i, (g, _, b)), e in run.err.items():
        gain, power = fit_at(fits, i, kind(g))
        result[g][b] = float(f"{gain * e**power:.6g}")
    return result, {
        f"{i} {k}": {"gain": float(f"{g:.6g}"), "power": round(q, 4)}
        for (i, k), (g, q) in sorted(fits.items())
    }


# candidates a probed group carries through the later layers: its largest and smallest errors
# ("top", "bottom"; one if it has one), the two points of its fit
CARRIED = 2

# the fitted power's bounds: KL is at most second order in a change (e is its square: 1) plus
# slack for noise; a flat fit (0) would make every bits of a group cost the same
POWER = (0.1, 1.5)


def fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(gain, power) with KL = gain * error ** power through a probed group's (error, KL) at
    its largest- and smallest-error candidates (power 1 with one, or where the two do not
    fix one: equal errors, a KL of 0); bounded by ``POWER``."""
    (e1, k1), *rest = sorted(points, reverse=True)
    power = 1.0
    if rest and k1 > 0 and rest[0][1] > 0 and e1 > 1.01 * rest[0][0] > 0:
        power = math.log(k1 / rest[0][1]) / math.log(e1 / rest[0][0])
        power = min(max(power, POWER[0]), POWER[1])
    return (k1 / e1**power if e1 > 0 else 0.0), power


def _keys(groups: dict[str, list[str]], bits, layer_groups: list[str]) -> list[tuple]:
    """The candidates (group, its tensors, bits) of one layer's groups."""
    return [(g, tuple(groups[g]), b) for g in layer_groups for b in bits[g]]


class LocalPass:
    """``local``'s pass: the source's layers one at a time, each layer's candidates from the
    source's input to it, and the probed candidates' outputs carried along."""

    def __init__(self, w: Weights, seqs: list[np.ndarray], blocks: Blocks, progress=None):
        self.w, self.seqs, self.blocks, self.progress = w, seqs, blocks, progress
        self.args = fw.text_args(w)
        self.n = self.args.num_hidden_layers
        self.err: dict[tuple, float] = {}  # (layer, candidate) -> its error in the layer's output
        # (probed layer, group) -> {"top"|"bottom": [candidate, output, error]}: the candidates of
        # largest and smallest error, their outputs carried through the later layers
        self.carried: dict[tuple, dict[str, list]] = {}
        # positions with a next token, in ``forward.rows``' order: what the KL averages over
        self.valid = np.concatenate([np.arange(len(s)) < len(s) - 1 for *_, s in fw.rows(seqs)])

    def swapped(self, c: tuple) -> Weights:
        _, names, b = c
        made = {n: (lambda rows, pick, n=n: self.blocks(n, b, rows, pick)) for n in names}
        return Swapped(self.w, made)

    def trunk(self, cands: dict[int, list], probes_at: set[int]) -> np.ndarray:
        """The source's pass, every layer's candidates run beside it; its final normed
        hidden states [N, H]."""
        import mlx.core as mx

        h = [mx.array(fw.embeddings(self.w, s)) for s in self.seqs]
        for c in cands.get(-1, []):
            out = [mx.array(fw.embeddings(self.swapped(c), s)) for s in self.seqs]
            self.note(-1, c, out, h, -1 in probes_at)
        for i in range(self.n):
            prefix = f"language_model.model.layers.{i}."
            source = fw.streamed_layer(self.w, prefix, self.args, i)
            parts: dict = {}
            h_out = fw.run_streamed(source, h, parts)
            self.through(source, [t for key in self.carried for t in self.ends(key)])
            for c in cands.get(i, []):
                self.note(i, c, self.output(i, c, source, h, parts), h_out, i in probes_at)
            h = h_out
        return fw.final_norm(self.w, h)

    def output(self, i: int, c: tuple, source, h: list, parts: dict) -> list:
        """Layer ``i``'s output with candidate ``c``'s tensors. What the candidate does not
        change is the source's (``parts``): the routed experts' candidates run only the
        experts, on the source's routing; the shared expert's only the shared expert."""
        prefix = f"language_model.model.layers.{i}."
        what = kind(c[0])
        if what.startswith("mlp.switch_mlp"):
            switch = fw.streamed_switch(self.swapped(c), prefix + "mlp.switch_mlp")
            routed = fw.routed_sum(switch, parts["x"], parts["inds"], parts["scores"])
            return fw.residual(parts["mid"], fw.shared_added(source.mlp, parts["x"], routed))
        layer = fw.streamed_layer(self.swapped(c), prefix, self.args, i)
        if what.startswith("mlp.shared_expert"):  # the shared expert or its gate
            return fw.residual(
                parts["mid"], fw.shared_added(layer.mlp, parts["x"], parts["routed"])
            )
        return fw.run_streamed(layer, h)

    def note(self, i: int, c: tuple, out: list, ref: list, probed: bool) -> None:
        """A candidate's output of layer ``i`` against the source's: its error, and, at a
        probed layer, kept to be carried on if it is its group's largest or smallest yet (a
        candidate that moved nothing is not: it has nothing to carry)."""
        e = self.err[i, c] = squared_error(out, ref)
        if probed and e > 0:
            ends = self.carried.setdefault((i, c[0]), {})
            kept = [c, out, e]  # one list where it is both ends: carried once
            if e > ends.get("top", (None, None, 0.0))[2]:
                ends["top"] = kept
            if e < ends.get("bottom", (None, None, math.inf))[2]:
                ends["bottom"] = kept
        if self.progress:
            self.progress.advance(1)

    def ends(self, key: tuple) -> list[list]:
        """A probed group's carried candidates, [candidate, output, error] each, once each."""
        return list({id(t): t for t in self.carried[key].values()}.values())

    @staticmethod
    def through(layer, ends: list[list]) -> None:
        """Each carried [candidate, output, error]'s output (a list of batches) through
        ``layer``, in place, ``GROUP`` to a call (their experts read once per call). A group's
        inputs go as its outputs come: the carried lists are held once, not twice (~0.5 GB
        at 35B's 34 lists of 2048 positions)."""
        for a in range(0, len(ends), GROUP):
            part = ends[a : a + GROUP]
            flat = fw.run_streamed(layer, [h for t in part for h in t[1]])
            for t in part:
                t[1], flat = flat[: len(t[1])], flat[len(t[1]) :]

    def fits(self, hn: np.ndarray) -> dict[tuple[int, str], tuple[float, float]]:
        """(probed layer, kind) -> (gain, power) through its carried candidates' (error, KL)."""
        ends = [(key, t) for key in sorted(self.carried) for t in self.ends(key)]

        def normed():  # each carried output normed as its scan takes it, then let go
            for _, t in ends:
                got, t[1] = fw.final_norm(self.w, t[1]), None
                yield got

        points: dict[tuple, list] = {}
        for (key, (_c, _, e)), kl in zip(ends, self.kls(hn, normed())):
            points.setdefault(key, []).append((e, kl))
        return {(p, kind(g)): fit(got) for (p, g), got in points.items()}

    def kls(self, hn: np.ndarray, hns: Iterator, heads: Iterator | None = None) -> list[float]:
        """Mean KL(source || model) over the positions with a next token, of each model's
        final normed hidden states (``hns``) through its output head (``heads``; the source's
        if None) against ``hn`` through the source's: ``KL_GROUP`` models to a head scan,
        which makes the source's logits once for all of them (each KL the bytes of a scan of
        the source and it alone)."""
        heads = heads if heads is not None else itertools.repeat(self.w)
        pairs, out = zip(hns, heads), []
        while part := list(itertools.islice(pairs, KL_GROUP)):
            scan = fw.HeadScan([self.w, *(w for _, w in part)], [hn, *(h for h, _ in part)])
            for j in range(1, len(part) + 1):
                out.append(float(scan.kl(j)[self.valid].astype(np.float64).mean()))
            if self.progress:
                self.progress.advance(len(part))
        return out


def fit_at(fits: dict[tuple[int, str], tuple], i: int, what: str) -> tuple[float, float]:
    """The (gain, power) of a group of kind ``what`` in layer ``i``: probed, or interpolated
    between the decoder layers where that kind was probed (log gain and power linearly; the
    nearest one's beyond them; any kind's where it never was); gain 0 where no probe had an
    error to measure."""
    if (i, what) in fits:
        return fits[i, what]
    for match in (lambda k: k == what, lambda k: True):
        known = sorted((j, f) for (j, k), f in fits.items() if j >= 0 and f[0] > 0 and match(k))
        if known:
            break
    else:
        return 0.0, 1.0
    xs = np.array([j for j, _ in known], float)
    ys = np.array([(math.log(g), q) for _, (g, q) in known])
    if len(set(xs)) < len(xs):  # several kinds at one layer (the fallback): their mean
        u = np.unique(xs)
        ys, xs = np.array([ys[xs == x].mean(axis=0) for x in u]), u
    log_gain, power = (float(np.interp(i, xs, ys[:, k])) for k in (0, 1))
    return math.exp(log_gain), power
