"""Calibration: what the routed experts of a bf16 trunk see on a small text set.

The text is split deterministically into calibration and held-out lines and
tokenized with the source's own ``tokenizer.json`` (``texts``). The sanitized
trunk runs through ``forward`` one decoder layer at a time, its routed experts
streamed a block at a time (``forward.streamed_layer``; both streams' rows in one
pass over them). The experts' observer records their input, the experts the
router chose and the intermediate activations ``silu(gate x) * up x``.
From those, per layer and expert: the number of routed tokens and the
per-channel mean square of the inputs of gate/up and of down, summed as the rows
pass (``Routed``), the importance weights of the data-aware quantization
(``dataaware``). Held-out tokens' routed inputs are kept as they are, to
measure expert output error (``expert_errors``).

Statistics are stored under the name of the weight they weigh:
``<module>.input_sq_mean`` [E, in_features] (gate and up share theirs, so the
store keeps one object) and ``<layer>.mlp.switch_mlp.tokens`` [E].
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from buildkit.core.errors import SourceError
from buildkit.core.lazy import lazy
from buildkit.formats.checkpoint import PROJS, SWITCH
from buildkit.grade import forward as fw
from buildkit.grade.texts import batches

np = lazy("numpy", __name__)


# ---- running the trunk -------------------------------------------------------------


@dataclass
class Routed:
    """One stream's view of one MoE layer: inputs x [N, H] and the chosen experts [N, k], and,
    summed as they pass (float64), per expert: routed rows, Σ x² of its inputs [E, H] and Σ a²
    of its intermediate activations [E, I]."""

    x: list[np.ndarray] = field(default_factory=list)
    experts: list[np.ndarray] = field(default_factory=list)
    tokens: np.ndarray | None = None
    in_sq: np.ndarray | None = None
    mid_sq: np.ndarray | None = None
    enough: int = 0  # stop once every expert has this many rows (0: never)
    kept: int | None = None  # sequences of the batch in which it stopped
    routed: np.ndarray | None = None  # rows the router has sent each expert so far

    def cutoff(self, idx: np.ndarray, batch: int, n_experts: int) -> int:
        """Of a batch of ``batch`` sequences routed to ``idx`` [tokens, k] (in sequence order),
        how many to run: all, or the fewest whole sequences after which every expert has
        ``enough`` rows (then ``kept`` records it)."""
        if not self.enough or self.kept is not None:
            return batch
        seqs = idx.reshape(batch, -1)
        per_seq = np.stack([np.bincount(q, minlength=n_experts) for q in seqs])
        done = np.cumsum(per_seq, axis=0) + (0 if self.routed is None else self.routed)
        reached = (done >= self.enough).all(axis=1)
        if not reached.any():
            self.routed = done[-1]
            return batch
        self.kept = int(np.argmax(reached)) + 1
        return self.kept

    def cat(self) -> tuple[np.ndarray, np.ndarray]:
        return np.concatenate(self.x), np.concatenate(self.experts)

    def start(self, n_experts: int, hidden: int, inter: int) -> None:
        self.tokens = np.zeros(n_experts, np.int64)
        self.in_sq = np.zeros((n_experts, hidden), np.float64)
        self.mid_sq = np.zeros((n_experts, inter), np.float64)

    def add(self, e: int, rows: np.ndarray, mid: np.ndarray) -> None:
        self.tokens[e] += len(rows)
        self.in_sq[e] += np.square(rows).sum(0, dtype=np.float64)
        self.mid_sq[e] += np.square(mid).sum(0, dtype=np.float64)


@dataclass
class Routing:
    """A stream's batches through one layer's attention and router, cut where its ``Routed``
    has enough rows: the attention outputs [B, L, H] and the MoE's inputs, experts and scores
    of their rows, in order."""

    mid: list = field(default_factory=list)
    x: list = field(default_factory=list)
    inds: list = field(default_factory=list)
    scores: list = field(default_factory=list)


def route(layer, hs: list, r: Routed, n_experts: int) -> Routing:
    """Each batch of ``hs`` through ``layer``'s attention and router, until ``r.cutoff``
    says the rows suffice (that batch cut to its kept sequences, later ones dropped)."""
    out = Routing()
    for h in hs:
        (mid,) = fw.attend(layer, [h])
        x = layer.post_attention_layernorm(mid.reshape(-1, mid.shape[-1]))
        inds, scores = fw.route(layer.mlp, x)
        keep = r.cutoff(np.asarray(inds), mid.shape[0], n_experts)
        n = keep * mid.shape[1]
        out.mid.append(mid[:keep])
        out.x.append(np.asarray(x[:n], dtype=np.float32))
        out.inds.append(np.asarray(inds[:n]))
        out.scores.append(scores[:n])
        if r.kept is not None:  # the statistics have their rows: the rest stops here
            break
    return out


def run_layer(layer, hidden: dict[str, list], seen: dict[str, Routed], shape: tuple) -> None:
    """One decoder layer over every stream's batches (``hidden``, replaced by the outputs),
    the routed experts read once for all of them; each stream's rows observed by its own
    ``Routed``. ``shape``: the experts' (count, hidden size, intermediate size)."""
    import mlx.core as mx

    routings = {s: route(layer, hs, seen[s], shape[0]) for s, hs in hidden.items()}
    bounds, at = {}, 0  # each stream's rows of the one MoE pass
    k = layer.mlp.top_k
    for s, g in routings.items():  # a stream with no tokens: no rows
        seen[s].x.append(np.concatenate([np.zeros((0, shape[1]), np.float32), *g.x]))
        seen[s].experts.append(np.concatenate([np.zeros((0, k), np.uint32), *g.inds]))
        seen[s].start(*shape)
        bounds[s] = (at, at + len(seen[s].x[-1]))
        at = bounds[s][1]

    if not at:  # no stream has a token
        return

    def observe(e, tok, xe, mid):  # tok ascending: each stream's rows are one slice
        for s, (a, b) in bounds.items():
            lo, hi = np.searchsorted(tok, (a, b))
            if hi > lo:
                seen[s].add(e, xe[lo:hi], mid[lo:hi])

    x = mx.array(np.concatenate([r.x[-1] for r in seen.values()]))
    inds = mx.array(np.concatenate([r.experts[-1] for r in seen.values()]))
    scores = mx.concatenate([a for g in routings.values() for a in g.scores])
    y = fw.mix(layer.mlp, x, inds, scores, observe)
    for s, g in routings.items():
        hidden[s] = fw.residual(g.mid, y[bounds[s][0] : bounds[s][1]])


def moe_activations(
    store,
    art,
    streams: dict[str, list[int]],
    seq_len: int,
    progress=None,
    enough: dict[str, int] | None = None,
) -> Iterator[tuple[str, dict[str, Routed]]]:
    """Run the trunk over each stream of token ids, layer by layer; yield, per decoder layer,
    its name (``language_model.model.layers.N``) and what its routed experts saw per stream.

    ``enough[stream]``: a layer's experts run the fewest whole sequences of that stream after
    which every one of them has been routed at least that many rows (decided from the router's
    choices, before any expert runs); the rest of the stream goes through neither this layer's
    experts nor any later layer, so each layer sees a prefix of what the one before it saw."""
    import mlx.core as mx

    from buildkit.grade.weights import StoreWeights

    w = StoreWeights(store, [art], art.meta["config"], None)
    args = fw.text_args(w)
    hidden = {
        s: [mx.array(fw.embeddings(w, b)) for b in batches(ids, seq_len)]
        for s, ids in streams.items()
    }
    if progress:
        progress.start(args.num_hidden_layers)
    for i in range(args.num_hidden_layers):
        prefix = f"language_model.model.layers.{i}"
        E, H, inter = w.shapes[f"{prefix}{SWITCH}.down_proj.weight"]
        layer = fw.streamed_layer(w, prefix + ".", args, i)
        seen = {s: Routed(enough=(enough or {}).get(s, 0)) for s in hidden}
        run_layer(layer, hidden, seen, (E, H, inter))
        del layer  # free this layer's weights before loading the next
        yield prefix, seen
        if progress:
            progress.advance(1)


# ---- statistics ----------------------------------------------------------------------


def expert_stats(routed: Routed, n_experts: int) -> dict[str, np.ndarray]:
    """Routed-token counts [E] and the per-channel mean squares of the inputs of gate/up [E, H]
    and of down [E, I] of one MoE layer's experts (float32; zero where no token went)."""
    if routed.tokens is None or not routed.tokens.any():
        raise SourceError(
            "calibration: no token reached this MoE layer (an empty calibration text?)"
        )
    den = np.maximum(routed.tokens, 1)[:, None]
    return {
        "tokens": routed.tokens.copy(),
        "in_sq": (routed.in_sq / den).astype(np.float32),
        "mid_sq": (routed.mid_sq / den).astype(np.float32),
    }


# ---- held-out output error -------------------------------------------------------------


def expert_outputs(x: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> np.ndarray:
    """One expert's SwiGLU output for rows x: down(silu(gate x) * up x), as mlx_lm computes it."""
    g, u = fw.mm(gate, x), fw.mm(up, x)
    return fw.mm(down, (g / (1.0 + np.exp(-g))) * u)


HELDOUT_ROWS = 64  # per expert: the real model's 1024 held-out tokens give each of its 256 ~32


def expert_errors(
    x: np.ndarray, experts: np.ndarray, blocks, variants: list[str], skip=frozenset()
) -> dict[str, np.ndarray]:
    """Relative output error ||y_v - y_ref|| / ||y_ref|| of every expert per variant over (the
    first ``HELDOUT_ROWS`` of) its held-out rows (NaN where none reaches it, or it is in
    ``skip``). ``blocks`` yields, for expert 0, 1, ... in turn, a function ``weights(variant)``
    giving that expert's float32 gate/up/down [out, in] for a variant or for ``"ref"``, so
    memory holds one expert and nothing is made for an expert no row reaches."""
    x = x.astype(np.float32)
    out: dict[str, list[float]] = {v: [] for v in variants}
    for e, weights in enumerate(blocks):
        rows = x[(experts == e).any(axis=-1)][:HELDOUT_ROWS]
        if not len(rows) or e in skip:
            for v in variants:
                out[v].append(np.nan)
            continue
        ref = weights("ref")
        y = expert_outputs(rows, *(ref[p] for p in PROJS)).astype(np.float64)
        den = max(float(np.sqrt(np.square(y).sum())), 1e-30)
        for v in variants:
            w = weights(v)
            diff = expert_outputs(rows, *(w[p] for p in PROJS)) - y
            out[v].append(float(np.sqrt(np.square(diff).sum())) / den)
    return {v: np.array(errs) for v, errs in out.items()}
