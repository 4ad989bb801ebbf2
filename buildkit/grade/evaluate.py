"""Evaluation: how far a quantized model's outputs are from its bf16 source, on a held-out text.

Both models run the same tokens through mlx_lm's own ``qwen3_5_moe`` classes, quantized
per path exactly as ``mlx_lm.load`` quantizes the published directory, one decoder layer
in memory at a time (its weights read, the layer run for every position, then freed), in
float32 (mlx on CPU has no bf16 ``gather_mm``). The real source is 70 GB; memory is one
layer, the embeddings or the output head, plus the hidden states of the text.

Figures: KL(p_source || p_model) of next-token distributions
(mean, median, 99th percentile), top-1 agreement, the perplexity of each, and, for a model
with an MTP head, teacher-forced draft acceptance at depth 1: the head's argmax for token
t+2 (from the trunk's hidden state at t, before the final norm, and the embedding of token
t+1) against its own trunk's argmax at t+1.

Weights come from a ``Weights``: the store (the eval step's artifacts) or a directory
(``buildkit eval``: an MLX directory, or a bf16 source in Hugging Face layout converted
tensor by tensor as sanitize does). Both name tensors as MLX does.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

from buildkit.core.errors import SourceError, UsageError
from buildkit.core.lazy import lazy
from buildkit.formats import checkpoint as ckpt
from buildkit.formats.convert import (
    mlx_layout,  # the conversion sanitize does, as verify recomputes it
)
from buildkit.formats.tensors import read_header, read_slice, read_tensor, to_mlx
from buildkit.grade.calibration import batches, build_model
from buildkit.grade.evalstream import layer_mask, quantize_as_loaded

np = lazy("numpy", __name__)

HEAD = "language_model.mtp."
FLOATS = ("BF16", "F16", "F32")


# ---- where weights come from ---------------------------------------------------------


class Weights:
    """A model's config, its quantization (as mlx_lm reads it from config.json) and its
    tensors by MLX name, read one at a time as numpy storage arrays."""

    config: dict
    quantization: dict | None
    names: dict[str, str]  # MLX name -> safetensors dtype

    def read(self, name: str) -> np.ndarray:
        raise NotImplementedError

    def iter_rows(self, name: str, rows: int) -> Iterator[np.ndarray]:
        """A tensor in blocks of ``rows`` along its first axis, read one block at a time."""
        whole = self.read(name)
        for a in range(0, max(whole.shape[0], 1), rows):
            yield whole[a : a + rows]

    def has_head(self) -> bool:
        return any(n.startswith(HEAD) for n in self.names)

    def tokenizer_json(self) -> bytes:
        raise SourceError("no tokenizer.json")

    def bytes(self, part: Callable[[str], bool] = lambda n: True) -> int:
        return sum(_nbytes(self, n) for n in self.names if part(n))


def _nbytes(w: Weights, name: str) -> int:
    return int(np.prod(w.shapes[name])) * {"BF16": 2, "F16": 2, "F32": 4, "U32": 4, "I32": 4}.get(
        w.names[name], 4
    )


class StoreWeights(Weights):
    """Artifacts in the store (sanitize:model, graft, quantize, requantize)."""

    def __init__(
        self, store, arts, config: dict, quantization: dict | None, tokenizer: str | None = None
    ):
        self.store, self.config, self.quantization, self.tok = (
            store,
            config,
            quantization,
            tokenizer,
        )
        self.entries = {k: v for a in arts for k, v in a.tensors.items()}
        self.names = {k: v["dtype"] for k, v in self.entries.items()}
        self.shapes = {k: v["shape"] for k, v in self.entries.items()}

    def read(self, name):
        return self.store.read_tensor(self.entries[name])

    def iter_rows(self, name, rows):
        e = self.entries[name]
        row = _nbytes(self, name) // max(e["shape"][0], 1) if e["shape"] else 1
        yield from self.store.iter_rows(e, max_bytes=rows * max(row, 1))

    def tokenizer_json(self):
        if self.tok is None:
            raise SourceError(
                "the source artifact has no tokenizer.json; "
                "evaluation tokenizes with the source's own"
            )
        return self.store.get_blob(self.tok)


class DirWeights(Weights):
    """A directory of safetensors shards: an MLX model, or (``hf=True``) a Hugging Face bf16
    checkpoint whose tensors are converted to the MLX layout as they are read."""

    def __init__(self, path: Path, hf: bool | None = None):
        self.path = Path(path)
        try:
            self.config = json.loads((self.path / "config.json").read_text())
        except (OSError, ValueError) as e:
            raise UsageError(
                f"{self.path}: no readable config.json ({e}); point at a model directory"
            ) from None
        self.quantization = self.config.get("quantization")
        self.where: dict[str, tuple] = {}  # MLX name -> (hf name, path, info, slice, shape)
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise UsageError(f"{self.path}: no *.safetensors files")
        for f in files:
            for name, info in read_header(f).tensors.items():
                if hf is None:
                    hf = (
                        name.startswith(("model.language_model.", "mtp."))
                        or name == "lm_head.weight"
                    )
                if not hf:
                    self.where[name] = (None, f, info, None, tuple(info.shape))
                elif not name.startswith("model.visual."):
                    for mlx, shape, slc in ckpt.split_experts(name, info.shape):
                        self.where[mlx] = (name, f, info, slc, shape)
        self.hf = bool(hf)
        self.names = {k: v[2].dtype for k, v in self.where.items()}
        self.shapes = {k: v[4] for k, v in self.where.items()}

    def read(self, name):
        hf, path, info, slc, shape = self.where[name]
        raw = read_tensor(info, path)
        return raw if hf is None else mlx_layout(hf, raw, info.dtype, slc, shape)

    def iter_rows(self, name, rows):
        hf, path, info, slc, shape = self.where[name]
        moved = hf is not None and (
            ckpt.is_offset_norm(hf) or ckpt.is_conv1d(hf) or ckpt.is_patch_embed(hf)
        )
        if moved or not shape or (slc is not None and slc[0] == 0):
            yield from super().iter_rows(name, rows)  # small tensors, converted whole
            return
        stride = info.nbytes // info.shape[0]
        for a in range(0, shape[0], rows):
            b = min(shape[0], a + rows)
            part = replace(
                info,
                shape=(b - a, *info.shape[1:]),
                start=info.start + a * stride,
                end=info.start + b * stride,
            )
            arr = read_slice(part, path, *slc) if slc is not None else read_tensor(part, path)
            yield arr.reshape(b - a, *shape[1:])

    def tokenizer_json(self):
        p = self.path / "tokenizer.json"
        if not p.is_file():
            raise UsageError(
                f"{self.path}: no tokenizer.json; evaluation tokenizes with the source's own"
            )
        return p.read_bytes()


# ---- mlx_lm's model, quantized as mlx_lm.load does, loaded a module at a time ----------


def _load(module, w: Weights, prefix: str) -> None:
    """Read the module's tensors (floating ones widened to float32; packed weights as stored)."""
    import mlx.core as mx

    arrays = []
    for name in sorted(n for n in w.names if n.startswith(prefix)):
        a = to_mlx(w.read(name), w.names[name])
        arrays.append((name[len(prefix) :], a.astype(mx.float32) if w.names[name] in FLOATS else a))
    module.load_weights(arrays, strict=True)
    mx.eval(module.parameters())


# names this module's callers used before they moved to evalstream
_quantize, _mask = quantize_as_loaded, layer_mask


@dataclass
class Trunk:
    """One model's pass over the text: per batch of sequences, the embeddings x0 and the last
    decoder layer's output h (before the final norm), float32 [B, L, H]; per sequence its
    argmax per position; and per batch the text it is from ("" the main one, else a domain)."""

    x0: list = field(default_factory=list)
    h: list = field(default_factory=list)
    argmax: list = field(default_factory=list)
    groups: list = field(default_factory=list)


def only(t: Trunk, group: str = "") -> Trunk:
    """The batches of ``t`` from one text ("" the main one) and their sequences' argmax."""
    groups = t.groups or [""] * len(t.h)
    rows, at = [], 0
    for h, g in zip(t.h, groups, strict=True):
        if g == group:
            rows += t.argmax[at : at + h.shape[0]]
        at += h.shape[0]
    keep = [j for j, g in enumerate(groups) if g == group]
    return Trunk([t.x0[j] for j in keep], [t.h[j] for j in keep], rows, [group] * len(keep))


def embed(w: Weights, seqs: list[np.ndarray]) -> list:
    """The embeddings [B, L, H] of each batch of token ids, float32."""
    import mlx.core as mx

    model = build_model(w.config)
    quantize_as_loaded(model, w, "")
    module = model.language_model.model.embed_tokens
    _load(module, w, "language_model.model.embed_tokens.")
    x0 = [module(mx.array(s)) for s in seqs]
    mx.eval(x0)
    return x0


def decoder_layer(w: Weights, i: int, args):
    """Decoder layer ``i`` alone (mlx_lm's class, ``args`` the text model's), quantized and
    loaded from ``w``."""
    from mlx_lm.models.qwen3_5 import DecoderLayer

    layer = DecoderLayer(args, i)
    prefix = f"language_model.model.layers.{i}."
    quantize_as_loaded(layer, w, prefix)
    _load(layer, w, prefix)
    return layer


def run_layer(layer, hs: list) -> list:
    """One decoder layer over each batch of hidden states (no cache: whole sequences)."""
    import mlx.core as mx

    out = [layer(h, mask=layer_mask(layer, h), cache=None) for h in hs]
    mx.eval(out)
    return out


def run_trunk(w: Weights, seqs: list[np.ndarray], progress=None) -> Trunk:
    """Every layer over every batch of ``seqs`` ([B, L] token ids), one layer's small modules
    in memory, its experts and the embedding streamed (``evalstream``)."""
    import mlx.core as mx

    from buildkit.grade import evalstream as es

    args = build_model(w.config).language_model.args
    x0 = [mx.array(es.embeddings(w, s)) for s in seqs]
    h = list(x0)
    for i in range(args.num_hidden_layers):
        layer = es.streamed_layer(w, f"language_model.model.layers.{i}.", args, i)
        h = es.run_streamed(layer, h)
        del layer  # free this layer's weights before loading the next
        if progress:
            progress.advance(1)
    return Trunk(x0, h)


class Output:
    """The final norm and lm_head of a model (mlx_lm's modules, quantized as published)."""

    def __init__(self, w: Weights):
        model = build_model(w.config)
        quantize_as_loaded(model, w, "")
        self.norm, self.lm_head = model.language_model.model.norm, model.language_model.lm_head
        _load(self.norm, w, "language_model.model.norm.")
        _load(self.lm_head, w, "language_model.lm_head.")

    def __call__(self, h):
        return self.lm_head(self.norm(h))


def _logprobs(logits):
    import mlx.core as mx

    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def np_logprobs(logits: np.ndarray) -> np.ndarray:
    """Log-probabilities of logits [..., V] in numpy (float32; mlx's CPU exp is slower)."""
    m = logits.max(axis=-1, keepdims=True)
    return logits - (m + np.log(np.exp(logits - m).sum(axis=-1, keepdims=True)))


def reference_logprobs(out: Output, h: list, seqs: list[np.ndarray]) -> list[np.ndarray]:
    """Log-probabilities of each sequence (``rows``' order) from final hidden states ``h``."""
    return [np_logprobs(np.array(out(h[j][r]))) for j, r, _ in rows(seqs)]


def mean_kl(out: Output, ref: list[np.ndarray], h: list, seqs: list[np.ndarray]) -> float:
    """Mean KL(ref || model) over the positions that have a next token (as
    ``compare_outputs`` counts them), of final hidden states ``h`` against ``ref``
    (``reference_logprobs``)."""
    total, n = 0.0, 0
    for lp_ref, (j, r, s) in zip(ref, rows(seqs), strict=True):
        m = len(s) - 1
        lp = np_logprobs(np.array(out(h[j][r])[:m]))
        k = (np.exp(lp_ref[:m]) * (lp_ref[:m] - lp)).sum(axis=-1)
        total, n = total + float(np.maximum(k, 0.0).astype(np.float64).sum()), n + m
    return total / max(n, 1)


def rows(seqs: list[np.ndarray]):
    """(batch index, row, token ids [L]) of every sequence: logits are made one sequence at a
    time (the real vocabulary makes a batch's logits gigabytes)."""
    return [(j, r, b[r]) for j, b in enumerate(seqs) for r in range(b.shape[0])]


def compare_outputs(
    src: Weights, mod: Weights, ts: Trunk, tm: Trunk, seqs: list[np.ndarray]
) -> dict:
    """KL, top-1 agreement and perplexities over every position that has a next token; fills
    each Trunk's ``argmax``."""
    return summarize(position_figures(src, mod, ts, tm, seqs))


def position_figures(
    src: Weights, mod: Weights, ts: Trunk, tm: Trunk, seqs: list[np.ndarray]
) -> dict[str, np.ndarray]:
    """Per position with a next token (``rows``' order): KL(p_source || p_model), top-1
    agreement, delta p (the change in the probability of the source's top token), each model's
    negative log-likelihood of the next token, and the window (sequence) it is in. Both heads
    are streamed over the vocabulary (``evalstream.HeadScan``); fills each Trunk's ``argmax``
    (every position)."""
    from buildkit.grade import evalstream as es

    targets = np.concatenate([np.append(s[1:], -1) for _, _, s in rows(seqs)])
    scan = es.HeadScan([src, mod], [es.final_norm(src, ts.h), es.final_norm(mod, tm.h)], targets)
    lengths = [len(s) for _, _, s in rows(seqs)]
    for t, arg in zip((ts, tm), scan.arg, strict=True):
        t.argmax = np.split(arg, np.cumsum(lengths)[:-1])
    valid = targets >= 0
    window = np.concatenate([np.full(len(s), i) for i, (_, _, s) in enumerate(rows(seqs))])
    return {
        "kl": scan.kl()[valid],
        "agree": (scan.arg[0] == scan.arg[1])[valid],
        "delta_p": scan.delta_p()[valid],
        "nll_source": scan.nll(0)[valid],
        "nll_model": scan.nll(1)[valid],
        "window": window[valid],
    }


def summarize(f: dict[str, np.ndarray], where: np.ndarray | None = None) -> dict:
    """The figures of ``position_figures`` over all positions, or those ``where`` is true,
    each with its interval (``stats.trunk_figures``)."""
    from buildkit.grade import stats

    if where is not None:
        f = {k: v[where] for k, v in f.items()}
    return stats.trunk_figures(f)


# ---- the MTP head ----------------------------------------------------------------------


def _head_class():
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.models.qwen3_5 import DecoderLayer

    class Head(nn.Module):
        """``language_model.mtp.*``: fc(cat([norm_e(embed(t+1)), norm_h(h_t)])) -> a
        full-attention decoder layer (mlx_lm's) -> norm; the trunk's lm_head predicts t+2.
        The norms are stored shifted (runtime weights), as mlx_lm's RMSNorm takes them."""

        def __init__(self, args):
            super().__init__()
            H, eps = args.hidden_size, args.rms_norm_eps
            self.fc = nn.Linear(2 * H, H, bias=False)
            self.pre_fc_norm_embedding = nn.RMSNorm(H, eps=eps)
            self.pre_fc_norm_hidden = nn.RMSNorm(H, eps=eps)
            self.layers = [DecoderLayer(args, args.full_attention_interval - 1)]
            self.norm = nn.RMSNorm(H, eps=eps)

        def __call__(self, emb, hidden):
            x = self.fc(
                mx.concatenate(
                    [self.pre_fc_norm_embedding(emb), self.pre_fc_norm_hidden(hidden)], axis=-1
                )
            )
            for layer in self.layers:
                x = layer(x, mask=layer_mask(layer, x), cache=None)
            return self.norm(x)

    return Head


def head_acceptance(w: Weights, t: Trunk) -> dict:
    """Teacher-forced depth-1 draft acceptance of ``w``'s head on its own trunk ``t``."""
    hits, totals = head_hits(w, t)
    total = sum(totals)
    return {"positions": total, "acceptance": sum(hits) / total if total else float("nan")}


def head_hits(w: Weights, t: Trunk) -> tuple[list[int], list[int]]:
    """Per window (sequence) of ``t``: the head's hits and the positions graded. The head's
    own decoder layer streams its experts, the trunk's lm_head its vocabulary (``evalstream``)."""
    import mlx.core as mx

    from buildkit.grade import evalstream as es

    head = streamed_head(w)
    layer = head.layers[0]
    xs = [
        head.fc(
            mx.concatenate(
                [head.pre_fc_norm_embedding(x0[:, 1:]), head.pre_fc_norm_hidden(h[:, :-1])],
                axis=-1,
            )
        )
        for x0, h in zip(t.x0, t.h, strict=True)
    ]
    ys = [head.norm(y) for y in es.run_streamed(layer, xs)]
    del layer
    # token t+2 for t = 0..L-2, through the trunk's final norm and lm_head, as Output does
    pred = es.HeadScan([w], [es.final_norm(w, ys)]).arg[0]
    hits, totals, at = [], [], 0
    ams = iter(t.argmax)
    for h in t.h:
        B, L = h.shape[0], h.shape[1]
        p = pred[at : at + B * (L - 1)].reshape(B, L - 1)
        at += B * (L - 1)
        for r in range(B):  # per window: the bootstrap resamples whole windows
            want = next(ams)[1:]  # the trunk's own argmax at t+1
            hits.append(int((p[r, :-1] == want[:-1]).sum()))  # t+2 inside the text
            totals.append(max(L - 2, 0))
    return hits, totals


def streamed_head(w: Weights):
    """``w``'s MTP head with its small modules loaded (its linears numpy matmuls) and its
    decoder layer as ``layers[0]``, its experts streamed (``evalstream.streamed_layer``): the
    head's bf16 experts are 3.2 GB once widened at the real model's size."""
    from buildkit.grade import evalstream as es

    if not w.has_head():
        raise SourceError("the model has no MTP head (no language_model.mtp.* tensors)")
    args = build_model(w.config).language_model.args
    head = _head_class()(args)
    head.layers = []  # its decoder layer is loaded streamed, below
    quantize_as_loaded(head, w, HEAD)
    es.load_module(head, w, HEAD, skip=HEAD + "layers.")
    es.linears_to_numpy(head)
    head.layers = [es.streamed_layer(w, HEAD + "layers.0.", args, args.full_attention_interval - 1)]
    return head


def load_head(w: Weights):
    """``w``'s MTP head, quantized and loaded whole as mlx_lm would (the reference the
    streamed one, ``streamed_head``, is tested against)."""
    args = build_model(w.config).language_model.args
    head = _head_class()(args)
    _quantize(head, w, HEAD)
    _load(head, w, HEAD)
    return head


# ---- one measurement -------------------------------------------------------------------


def sequences(tokens: list[int], seq_len: int) -> list[np.ndarray]:
    """The token ids in batches [B, L]: sequences of ``seq_len``, then the remainder (if 2 or
    more tokens)."""
    out = [b for b in batches(tokens, seq_len) if b.shape[1] >= 2]
    if not out:
        raise UsageError(f"{len(tokens)} tokens: too few to evaluate (need at least 2)")
    return out


def evaluate(
    src: Weights,
    mod: Weights,
    tokens: list[int],
    seq_len: int,
    head: bool = True,
    progress=None,
    domains: dict[str, list[int]] | None = None,
):
    """(figures, trunks): the trunk figures and, if ``head`` and both models have one, the
    acceptance of each head on its own trunk, each with its interval. ``domains`` (name ->
    token ids) run through the same pass (the weights are read once for all texts); each gets
    its figures under ``figures["domains"][name]``."""
    m = measure(src, mod, {"": tokens, **(domains or {})}, seq_len, head, progress)
    return report(m, {"": len(tokens), **{g: len(t) for g, t in (domains or {}).items()}}), (
        m.ts,
        m.tm,
    )


@dataclass
class Measured:
    """One or more passes of both models over windows: per-position figures (``window`` numbers
    every window of every pass in order), each window's text ("" the main one, else a
    domain), both trunks and, with heads, each head's hits and graded positions per window."""

    pf: dict
    groups: list[str]
    ts: Trunk
    tm: Trunk
    hits: dict | None = None  # "model"/"source" -> (hits, totals) per window

    def extend(self, more: Measured) -> None:
        """Append another pass (its windows numbered after these)."""
        off = len(self.groups)
        for k, v in more.pf.items():
            self.pf[k] = np.concatenate([self.pf[k], v + off if k == "window" else v])
        self.groups += more.groups
        for a, b in ((self.ts, more.ts), (self.tm, more.tm)):
            a.x0, a.h, a.argmax, a.groups = (
                a.x0 + b.x0,
                a.h + b.h,
                list(a.argmax) + list(b.argmax),
                a.groups + b.groups,
            )
        if self.hits and more.hits:
            for k in self.hits:
                self.hits[k] = tuple(x + y for x, y in zip(self.hits[k], more.hits[k], strict=True))


def measure(
    src: Weights, mod: Weights, texts: dict[str, list[int]], seq_len: int, head=True, progress=None
) -> Measured:
    """Both models over every text's windows (name -> token ids, "" the main text)."""
    import mlx.core  # noqa: F401  (so that its buffer cache can be turned off before the first layer)

    from buildkit.core.allocator import tune_imported

    tune_imported()  # freed layers go back to malloc, not to a second reserve in mlx
    seqs, groups = [], []
    for g, toks in texts.items():
        for b in sequences(toks, seq_len):
            seqs.append(b)
            groups.append(g)
    n_layers = ckpt.text_config(src.config)["num_hidden_layers"]
    if progress:
        progress.start(2 * n_layers, "layers")
    ts = run_trunk(src, seqs, progress)
    tm = run_trunk(mod, seqs, progress)
    ts.groups = tm.groups = groups
    pf = position_figures(src, mod, ts, tm, seqs)
    window_groups = [groups[j] for j, _, _ in rows(seqs)]
    hits = None
    if head and mod.has_head() and src.has_head():
        hits = {"model": head_hits(mod, tm), "source": head_hits(src, ts)}
    return Measured(pf, window_groups, ts, tm, hits)


def report(m: Measured, tokens: dict[str, int]) -> dict:
    """The figures of a measurement: the main text's, and each domain's under ``domains``."""
    in_group = np.array(m.groups)[m.pf["window"]]
    fig = {"tokens": tokens[""], **summarize(m.pf, in_group == "")}
    doms = [g for g in tokens if g]
    if doms:
        fig["domains"] = {g: {"tokens": tokens[g], **summarize(m.pf, in_group == g)} for g in doms}
    if m.hits:
        merge(fig, heads(m.hits, m.groups))
    return fig


def merge(fig: dict, more: dict) -> None:
    """Add ``more``'s figures to ``fig``'s, domains and intervals merged, not replaced."""
    for k, v in more.items():
        if k == "domains":
            for g, d in v.items():
                merge(fig.setdefault("domains", {}).setdefault(g, {}), d)
        elif k == "ci95":
            fig.setdefault("ci95", {}).update(v)
        else:
            fig[k] = v


def window_groups(t: Trunk) -> list[str]:
    """Each window's (sequence's) text, from a trunk's per-batch ``groups``."""
    groups = t.groups or [""] * len(t.h)
    return [g for h, g in zip(t.h, groups, strict=True) for _ in range(h.shape[0])]


def heads(hits: dict, groups: list[str]) -> dict:
    """Each head's acceptance on its own trunk (``hits``: "model"/"source" -> per-window hits
    and totals; ``groups``: each window's text), over the main text and per domain, with
    intervals."""
    from buildkit.grade import stats

    out = {}
    for g in dict.fromkeys(groups):
        sel = [i for i, y in enumerate(groups) if y == g]
        fig, ci = {}, {}
        for who, key in (("model", "acceptance"), ("source", "acceptance_source")):
            h, n = (np.asarray(x)[sel] for x in hits[who])
            fig[key], ci[key] = stats.acceptance(h, n)
            if who == "model":
                fig["acceptance_positions"] = int(n.sum())
                fig["per_window_acceptance"] = {"hits": h.tolist(), "totals": n.tolist()}
        fig["ci95"] = ci
        if g:
            out.setdefault("domains", {})[g] = fig
        else:
            out |= fig
    return out
