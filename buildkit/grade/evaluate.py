"""Evaluation: how far a quantized model's outputs are from its bf16 source, on a held-out text.

The model runs the reference's windows (``reference``: the source's pass, computed once per
source and text) through ``forward``, quantized per path exactly as ``mlx_lm.load`` quantizes
the published directory, one decoder layer in memory at a time; the source's output head runs
on the reference's hidden states beside the model's. The real source is 70 GB; memory is one
layer, the embeddings or the output head, plus the hidden states of the text.

Figures, per position and summarized with intervals (``stats``): KL(p_source || p_model) of
next-token distributions, top-1 agreement, Δp (the change in the probability of the source's
top token), the perplexity of each, and, for a model with an MTP head, teacher-forced draft
acceptance at depth 1: the head's argmax for token t+2 (from the trunk's hidden state at t,
before the final norm, and the embedding of token t+1) against its own trunk's argmax at t+1.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from buildkit.core.errors import SourceError
from buildkit.core.lazy import lazy
from buildkit.formats import checkpoint as ckpt
from buildkit.grade import forward as fw
from buildkit.grade import reference as rf
from buildkit.grade import stats
from buildkit.grade.forward import Trunk
from buildkit.grade.weights import HEAD, Weights, same_tensors

np = lazy("numpy", __name__)


def position_figures(
    src: Weights, mod: Weights, ref: rf.Reference, tm: Trunk
) -> dict[str, np.ndarray]:
    """Per position with a next token (``forward.rows``' order): KL(p_source || p_model), top-1
    agreement, delta p (the change in the probability of the source's top token), each model's
    negative log-likelihood of the next token, and the window (sequence) it is in. The model's
    output head is streamed over the vocabulary (``forward.HeadScan``): alone against the
    reference's summary where its head is the source's, byte for byte (``head_from_reference``),
    else beside the source's on the reference's hidden states; fills ``tm.argmax`` (every
    position)."""
    targets = ref.targets()
    hs = [fw.final_norm(src, ref.trunk.h), fw.final_norm(mod, tm.h)]
    if head_from_reference(src, mod, ref):
        scan = ref.head.scan(mod, hs[1], hs[0], targets)
        kl, delta_p, nll_source = ref.head.kl(scan), ref.head.delta_p(scan), ref.head.nll()
        args = ref.head.arg, scan.arg[0]
    else:
        scan = fw.HeadScan([src, mod], hs, targets)
        kl, delta_p, nll_source = scan.kl(), scan.delta_p(), scan.nll(0)
        args = scan.arg[0], scan.arg[1]
    lengths = [len(s) for _, _, s in fw.rows(ref.windows)]
    tm.argmax = np.split(args[1], np.cumsum(lengths)[:-1])
    valid = targets >= 0
    window = np.concatenate(
        [np.full(len(s), i) for i, (_, _, s) in enumerate(fw.rows(ref.windows))]
    )
    return {
        "kl": kl[valid],
        "agree": (args[0] == args[1])[valid],
        "delta_p": delta_p[valid],
        "nll_source": nll_source[valid],
        "nll_model": scan.nll(len(scan.ws) - 1)[valid],
        "window": window[valid],
    }


def head_from_reference(src: Weights, mod: Weights, ref: rf.Reference) -> bool:
    """Whether the model's figures take the source's output head from the reference's summary
    (its head is the source's, byte for byte) rather than the source's logits made again."""
    return ref.head is not None and same_head(src, mod)


def same_head(src: Weights, mod: Weights) -> bool:
    """Whether the model's output head is the source's, byte for byte."""
    return same_tensors(src, mod, fw.head_module(src) + ".")


def summarize(f: dict[str, np.ndarray], where: np.ndarray | None = None) -> dict:
    """The figures of ``position_figures`` over all positions, or those ``where`` is true,
    each with its interval (``stats.trunk_figures``)."""
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
                x = layer(x, mask=fw.layer_mask(layer, x), cache=None)
            return self.norm(x)

    return Head


def head_acceptance(w: Weights, t: Trunk) -> dict:
    """Teacher-forced depth-1 draft acceptance of ``w``'s head on its own trunk ``t``."""
    hits, totals = head_hits(w, t)
    total = sum(totals)
    return {"positions": total, "acceptance": sum(hits) / total if total else float("nan")}


def head_hits(w: Weights, t: Trunk) -> tuple[list[int], list[int]]:
    """Per window (sequence) of ``t``: the head's hits and the positions graded. The head's
    own decoder layer streams its experts, the trunk's lm_head its vocabulary (``forward``)."""
    import mlx.core as mx

    head = streamed_head(w)

    def text(js: list[int]) -> list:  # one text's batches: what is held grows with one text
        xs = [
            head.fc(
                mx.concatenate(
                    [
                        head.pre_fc_norm_embedding(t.x0[j][:, 1:]),
                        head.pre_fc_norm_hidden(t.h[j][:, :-1]),
                    ],
                    axis=-1,
                )
            )
            for j in js
        ]
        return [head.norm(y) for y in fw.run_streamed(head.layers[0], xs)]

    groups = t.groups or [""] * len(t.h)
    runs = itertools.groupby(range(len(t.h)), key=groups.__getitem__)
    ys = [y for _, js in runs for y in text(list(js))]
    # token t+2 for t = 0..L-2, through the trunk's final norm and lm_head, as Output does
    pred = fw.HeadScan([w], [fw.final_norm(w, ys)]).arg[0]
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
    decoder layer as ``layers[0]``, its experts streamed (``forward.streamed_layer``): the
    head's bf16 experts are 3.2 GB once widened at the real model's size."""
    if not w.has_head():
        raise SourceError("the model has no MTP head (no language_model.mtp.* tensors)")
    args = fw.text_args(w)
    head = _head_class()(args)
    head.layers = []  # its decoder layer is loaded streamed, below
    fw.quantize_as_loaded(head, w, HEAD)
    fw.load_module(head, w, HEAD, skip=HEAD + "layers.")
    fw.linears_to_numpy(head)
    head.layers = [fw.streamed_layer(w, HEAD + "layers.0.", args, args.full_attention_interval - 1)]
    return head


def load_head(w: Weights):
    """``w``'s MTP head, quantized and loaded whole as mlx_lm would (the reference the
    streamed one, ``streamed_head``, is tested against)."""
    args = fw.text_args(w)
    head = _head_class()(args)
    fw.quantize_as_loaded(head, w, HEAD)
    fw.load_module(head, w, HEAD)
    return head


# ---- one measurement -------------------------------------------------------------------


def evaluate(
    src: Weights,
    mod: Weights,
    tokens: list[int],
    seq_len: int,
    head: bool = True,
    progress=None,
    domains: dict[str, list[int]] | None = None,
):
    """(figures, trunks): the reference computed here (``buildkit eval``; the eval step takes
    it from its ``reference`` input), then the model against it: the trunk figures and, if
    ``head`` and both models have one, the acceptance of each head on its own trunk, each with
    its interval. ``domains`` (name -> token ids) run through the same pass."""
    windows, groups = rf.layout({"": tokens, **(domains or {})}, seq_len)
    if progress:
        progress.start(2 * ckpt.text_config(src.config)["num_hidden_layers"], "layers")
    ref = rf.compute(src, windows, groups, progress, head=same_head(src, mod))
    m = measure(src, mod, ref, head, progress)
    counts = {"": len(tokens), **{g: len(t) for g, t in (domains or {}).items()}}
    return report(m, counts), (m.ts, m.tm)


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


def measure(src: Weights, mod: Weights, ref: rf.Reference, head=True, progress=None) -> Measured:
    """The model over the reference's windows, against it (``src``: the source's weights, for
    its output head and its MTP head)."""
    tm = fw.run_trunk(mod, ref.windows, progress)
    tm.groups = list(ref.groups)
    pf = position_figures(src, mod, ref, tm)
    window_groups = [ref.groups[j] for j, _, _ in fw.rows(ref.windows)]
    hits = None
    if head and mod.has_head() and src.has_head():
        hits = {"model": head_hits(mod, tm), "source": head_hits(src, ref.trunk)}
    return Measured(pf, window_groups, ref.trunk, tm, hits)


def report(m: Measured, tokens: dict[str, int]) -> dict:
    """The figures of a measurement: the main text's, and each domain's under ``domains``."""
    in_group = np.array(m.groups)[m.pf["window"]]
    fig = {"tokens": tokens[""], **summarize(m.pf, in_group == "")}
    doms = [g for g in tokens if g]
    if doms:
        fig["domains"] = {g: {"tokens": tokens[g], **summarize(m.pf, in_group == g)} for g in doms}
    if m.hits:
        stats.merge(fig, heads(m.hits, m.groups))
    return fig


def heads(hits: dict, groups: list[str]) -> dict:
    """Each head's acceptance on its own trunk (``hits``: "model"/"source" -> per-window hits
    and totals; ``groups``: each window's text), over the main text and per domain, with
    intervals."""
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
