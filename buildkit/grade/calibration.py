"""Calibration: what the routed experts of a bf16 trunk see on a small text set.

The text is split deterministically into calibration and held-out lines
(``split_lines``) and tokenized with the source's own ``tokenizer.json``. The
sanitized trunk is run with mlx_lm's ``qwen3_5_moe`` classes one decoder layer
at a time (one layer's weights in memory, cast to float32: mlx on CPU has no
bf16 ``gather_mm``). The layer's linears and routed experts run as numpy
matmuls (``linears_to_numpy``; ``_experts`` reads the experts from the store
straight to float32), the rest (norms, attention, the gated delta net) in
mlx. The experts module records its input, the experts the router chose and
the intermediate activations ``silu(gate x) * up x``. From those, per layer and
expert: the number of routed tokens and the per-channel mean square of the
inputs of gate/up and of down, summed as the rows pass (``Routed``), the importance weights of the
data-aware quantization (``dataaware``). Held-out tokens' routed inputs are
kept as they are, to measure expert output error (``expert_errors``).

Statistics are stored under the name of the weight they weigh:
``<module>.input_sq_mean`` [E, in_features] (gate and up share theirs, so the
store keeps one object) and ``<layer>.mlp.switch_mlp.tokens`` [E].
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from buildkit.core import workers
from buildkit.core.errors import SourceError, UsageError
from buildkit.core.lazy import lazy
from buildkit.formats.tensors import to_float32, to_mlx

np = lazy("numpy", __name__)

BUILTIN = "builtin:"
SWITCH = ".mlp.switch_mlp"
PROJS = ("gate_proj", "up_proj", "down_proj")


# ---- the text ----------------------------------------------------------------------


def text_path(spec: str, project_root: Path) -> Path:
    """``builtin:NAME`` is a file shipped in ``buildkit/data``; anything else a project path."""
    if spec.startswith(BUILTIN):
        path = Path(__file__).parents[1] / "data" / spec[len(BUILTIN) :]
    else:
        path = Path(spec).expanduser()
        if not path.is_absolute():
            path = project_root / path
    if not path.is_file():
        raise UsageError(
            f"calibration text {spec!r}: no such file ({path}); point params.text of the "
            "calibrate step at a UTF-8 text file, or use builtin:calibration.txt"
        )
    return path


def split_lines(text: str, heldout_every: int) -> tuple[list[str], list[str]]:
    """(calibration, held-out) lines: the leading ``#`` header and blank lines are dropped,
    then every ``heldout_every``-th remaining line is held out."""
    lines = text.splitlines()
    while lines and (lines[0].startswith("#") or not lines[0].strip()):
        lines.pop(0)
    lines = [ln.rstrip() for ln in lines if ln.strip()]
    calib = [ln for i, ln in enumerate(lines) if i % heldout_every != heldout_every - 1]
    held = [ln for i, ln in enumerate(lines) if i % heldout_every == heldout_every - 1]
    return calib, held


def tokenize(tokenizer_json: bytes, lines: list[str], limit: int) -> list[int]:
    """Token ids of the lines joined by newlines, at most ``limit`` of them."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer_json.decode())
    return tok.encode("\n".join(lines), add_special_tokens=False).ids[:limit]


def batches(ids: list[int], seq_len: int) -> list[np.ndarray]:
    """Sequences of ``seq_len`` tokens as one [B, seq_len] batch, plus the remainder."""
    n = len(ids) // seq_len * seq_len
    out = [np.array(ids[:n], dtype=np.int32).reshape(-1, seq_len)] if n else []
    if len(ids) > n:
        out.append(np.array([ids[n:]], dtype=np.int32))
    return out


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

    def cutoff(self, idx: np.ndarray, batch: int, n_experts: int) -> int:
        """Of a batch of ``batch`` sequences routed to ``idx`` [tokens, k] (in sequence order),
        how many to run: all, or the fewest whole sequences after which every expert has
        ``enough`` rows (then ``kept`` records it)."""
        if not self.enough or self.kept is not None:
            return batch
        seqs = idx.reshape(batch, -1)
        per_seq = np.stack([np.bincount(q, minlength=n_experts) for q in seqs])
        prior = self.tokens if self.tokens is not None else 0
        reached = ((np.cumsum(per_seq, axis=0) + prior) >= self.enough).all(axis=1)
        if not reached.any():
            return batch
        self.kept = int(np.argmax(reached)) + 1
        return self.kept

    def cat(self) -> tuple[np.ndarray, np.ndarray]:
        return np.concatenate(self.x), np.concatenate(self.experts)

    def start(self, n_experts: int, hidden: int, inter: int) -> None:
        if self.tokens is None:
            self.tokens = np.zeros(n_experts, np.int64)
            self.in_sq = np.zeros((n_experts, hidden), np.float64)
            self.mid_sq = np.zeros((n_experts, inter), np.float64)

    def add(self, e: int, rows: np.ndarray, mid: np.ndarray) -> None:
        self.tokens[e] += len(rows)
        self.in_sq[e] += np.square(rows).sum(0, dtype=np.float64)
        self.mid_sq[e] += np.square(mid).sum(0, dtype=np.float64)


def _silu(g: np.ndarray) -> np.ndarray:
    return g / (1.0 + np.exp(-g))


def _mm(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """``x @ w.T`` for a weight w [out, in] and a few rows x [n, in], computed as ``(w @ x.T).T``:
    OpenBLAS's sgemm runs that shape faster at a few rows, with the same bytes here
    (bench/RESULTS.md)."""
    return (w @ x.T).T


def numpy_modules():
    """The layer's matmuls in numpy: mlx's CPU wheel on Linux bundles a reference BLAS, numpy's
    OpenBLAS is many times faster (bench/RESULTS.md); the rest of the layer stays mlx."""
    return _np_linear(), _np_switch_glu()


def _np_linear():
    import mlx.core as mx
    import mlx.nn as nn

    class NpLinear(nn.Module):
        """``x @ W.T`` with a float32 numpy W [out, in] (no bias in qwen3_5_moe's linears)."""

        def __init__(self, weight: np.ndarray):
            super().__init__()
            self.w = weight

        def __call__(self, x):
            a = np.asarray(x)
            return mx.array((a.reshape(-1, a.shape[-1]) @ self.w.T).reshape(*a.shape[:-1], -1))

    return NpLinear


def _np_switch_glu():
    import mlx.core as mx
    import mlx.nn as nn

    class NpSwitchGLU(nn.Module):
        """mlx_lm's SwitchGLU (``down(silu(gate x) * up x)`` for each chosen expert, output
        [..., k, H]) one expert at a time over the rows routed to it; ``routed`` keeps the
        MoE input and the chosen experts, and sums each expert's x² and activations² as they
        pass."""

        def __init__(self, gate_up: np.ndarray, down: np.ndarray):
            super().__init__()
            self.gate_up = gate_up  # [E, 2I, H]: one matmul for both
            self.down = down
            self.routed: Routed | None = None

        def __call__(self, x, indices, **kw):
            a = np.asarray(x)
            xs = a.reshape(-1, a.shape[-1])
            idx = np.asarray(indices).reshape(xs.shape[0], -1)
            k, n_experts = idx.shape[-1], self.down.shape[0]
            r = self.routed
            y = np.empty((*idx.shape, xs.shape[-1]), np.float32)
            if r is not None and a.ndim == 3:  # only whole sequences, once the rows suffice
                n = r.cutoff(idx, a.shape[0], n_experts) * a.shape[1]
                xs, idx = xs[:n], idx[:n]  # the rest of the batch is dropped after this layer
                y[n:] = 0
            order = np.argsort(idx.reshape(-1), kind="stable")
            flat = idx.reshape(-1)[order]
            counts = np.bincount(flat, minlength=n_experts)
            inter = self.down.shape[-1]
            starts = np.concatenate([[0], np.cumsum(counts)])
            out = y.reshape(-1, xs.shape[-1])
            if r is not None:
                r.start(len(counts), xs.shape[-1], inter)

            def run(experts):
                for e in experts:
                    rows = order[starts[e] : starts[e + 1]]
                    xe = xs[rows // k]
                    gu = _mm(self.gate_up[e], xe)
                    mid = _silu(gu[:, :inter]) * gu[:, inter:]
                    out[rows] = _mm(self.down[e], mid)
                    if r is not None:
                        r.add(e, xe, mid)

            # on two threads (numpy's matmuls release the GIL), experts alternating: each
            # expert's rows of y and of the sums are its own, so the bytes are one thread's
            active = np.flatnonzero(counts)
            for _ in workers.imap("calibrate", run, [active[0::2], active[1::2]]):
                pass
            if r is not None:
                r.x.append(xs.copy())
                r.experts.append(idx.copy())
            return mx.array(y.reshape(*a.shape[:-1], k, -1))

    return NpSwitchGLU


def build_model(config: dict):
    """mlx_lm's qwen3_5_moe Model for a checkpoint config (weights not loaded; mlx is lazy,
    so nothing is allocated until a layer's weights are loaded)."""
    from mlx_lm.models import qwen3_5_moe

    if config.get("model_type") != "qwen3_5_moe":
        raise SourceError(
            "calibration runs qwen3_5_moe checkpoints; config.json has model_type "
            f"{config.get('model_type')!r}"
        )
    return qwen3_5_moe.Model(qwen3_5_moe.ModelArgs.from_dict(config))


def _load(module, store, tensors: dict[str, dict], prefix: str, skip: str = "\0") -> None:
    import mlx.core as mx

    weights = [
        (name[len(prefix) :], to_mlx(store.read_tensor(e), e["dtype"]).astype(mx.float32))
        for name, e in sorted(tensors.items())
        if name.startswith(prefix) and not name.startswith(skip)
    ]
    module.load_weights(weights, strict=True)
    mx.eval(module.parameters())


def _experts(store, tensors: dict[str, dict], switch: str) -> tuple[np.ndarray, np.ndarray]:
    """A layer's routed experts in float32 straight from the store, gate and up in one
    [E, 2I, H] array: not through mlx and a concatenation, so one copy of them in memory."""
    e = {p: tensors[f"{switch}.{p}.weight"] for p in PROJS}
    E, inter, hidden = e["gate_proj"]["shape"]
    gate_up = np.empty((E, 2 * inter, hidden), np.float32)
    for half, p in enumerate(("gate_proj", "up_proj")):
        gate_up[:, half * inter : (half + 1) * inter] = to_float32(
            store.read_tensor(e[p]), e[p]["dtype"]
        )
    return gate_up, to_float32(store.read_tensor(e["down_proj"]), e["down_proj"]["dtype"])


def linears_to_numpy(layer, NpLinear) -> None:
    """Swap the layer's (bias-free) linears for their numpy versions, same weights."""
    import mlx.nn as nn

    for path, m in layer.named_modules():
        if type(m) is nn.Linear and "bias" not in m:
            parent, _, name = path.rpartition(".")
            owner = layer
            for part in filter(None, parent.split(".")):
                owner = getattr(owner, part)
            setattr(owner, name, NpLinear(np.array(m.weight)))


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
    from mlx_lm.models.base import create_attention_mask, create_ssm_mask

    NpLinear, NpSwitchGLU = numpy_modules()
    model = build_model(art.meta["config"])
    text = model.language_model.model
    _load(text.embed_tokens, store, art.tensors, "language_model.model.embed_tokens.")
    hidden = {
        s: [text.embed_tokens(mx.array(b)) for b in batches(ids, seq_len)]
        for s, ids in streams.items()
    }
    mx.eval([h for hs in hidden.values() for h in hs])
    del text.embed_tokens  # free it; only the decoder layers are used from here on
    layers = text.layers
    if progress:
        progress.start(len(layers))
    for i in range(len(layers)):
        layer, prefix = layers[i], f"language_model.model.layers.{i}"
        # the experts in numpy from the store, then the rest of the layer through mlx
        switch = NpSwitchGLU(*_experts(store, art.tensors, prefix + SWITCH))
        layer.mlp.switch_mlp = switch
        _load(layer, store, art.tensors, prefix + ".", skip=prefix + SWITCH + ".")
        linears_to_numpy(layer, NpLinear)
        seen: dict[str, Routed] = {}
        for stream, hs in hidden.items():
            r = switch.routed = seen.setdefault(
                stream, Routed(enough=(enough or {}).get(stream, 0))
            )
            for j, h in enumerate(hs):
                mask = (
                    create_ssm_mask(h, None) if layer.is_linear else create_attention_mask(h, None)
                )
                hs[j] = layer(h, mask=mask, cache=None)
                if r.kept is not None:  # the statistics have their rows: the rest stops here
                    hs[j] = hs[j][: r.kept]
                    del hs[j + 1 :]
                mx.eval(hs[j])
                if r.kept is not None:
                    break
        layers[i] = None  # free this layer's weights before loading the next
        yield prefix, seen
        if progress:
            progress.advance(1)


# ---- statistics ----------------------------------------------------------------------


def expert_stats(routed: Routed, n_experts: int) -> dict[str, np.ndarray]:
    """Routed-token counts [E] and the per-channel mean squares of the inputs of gate/up [E, H]
    and of down [E, I] of one MoE layer's experts (float32; zero where no token went)."""
    if routed.tokens is None:
        raise SourceError(
            "calibration: no token reached this MoE layer (an empty calibration text?)"
        )
    den = np.maximum(routed.tokens, 1)[:, None]
    return {
        "tokens": routed.tokens.copy(),
        "in_sq": (routed.in_sq / den).astype(np.float32),
        "mid_sq": (routed.mid_sq / den).astype(np.float32),
    }


def stat_name(module: str) -> str:
    """Name of the importance tensor [E, in_features] of a routed-expert weight's module."""
    return f"{module}.input_sq_mean"


def tokens_name(layer: str) -> str:
    return f"{layer}{SWITCH}.tokens"


def stats_for(store, art, module: str) -> tuple[np.ndarray, np.ndarray] | None:
    """(importance [E, in_features], routed tokens [E]) for ``<layer>.mlp.switch_mlp.<proj>``,
    or None if the calibration holds nothing for it."""
    layer, sep, _ = module.partition(SWITCH)
    entry, count = art.tensors.get(stat_name(module)), art.tensors.get(tokens_name(layer))
    if not sep or entry is None or count is None:
        return None
    return store.read_tensor(entry).astype(np.float32), store.read_tensor(count)


# ---- held-out output error -------------------------------------------------------------


def expert_outputs(x: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> np.ndarray:
    """One expert's SwiGLU output for rows x: down(silu(gate x) * up x), as mlx_lm computes it."""
    g, u = _mm(gate, x), _mm(up, x)
    return _mm(down, (g / (1.0 + np.exp(-g))) * u)


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
