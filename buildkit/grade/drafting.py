"""MTP draft acceptance by depth, teacher-forced, and the yield of drafting.

The chain is formed as mlx_vlm 0.7.10's ``Qwen3_5MTPDraftModel.draft_block`` forms it. Depth 1
is ``evaluate.head_acceptance``'s draft: the head's argmax for token t+2 from the trunk's hidden
state at t (before the final norm) and the embedding of token t+1. Depth k+1 feeds the head the
**embedding of the depth-k draft** and the **head's own output at depth k** (after the head's
``norm``, mlx_vlm's ``seed_hidden``/``h_prev``), one position further on (RoPE position t+k),
attending to the head's entries for positions 0..t (true tokens and trunk states, as the
drafter's cache holds them after each verify) and to the chain's earlier entries, never to
another position's chain. Every draft is read out as depth 1 is (``evaluate.Output``).

A depth-k draft is accepted when it equals the trunk's own argmax at t+k (teacher-forced: the
trunk ran on the text). Depth k counts only positions whose k-1 earlier drafts were accepted
(the published format d1=a/b, d2=c/d), and of those only where the text itself went on with
the accepted drafts and the target lies inside the text: elsewhere the trunk's state at t+k
follows other tokens than the drafts, and comparing a draft with it understates acceptance
(bench/RESULTS.md, "Speculative decoding figures"). So tried at depth k <= accepted at depth
k-1. Tokens per verify cycle with k drafts = 1 + sum over i <= k of the product of the
conditional rates r1..ri, reported only up to the last depth with enough tries
(``stats.depth_figures``: rates, intervals, the best draft length).

The trunk runs once (the eval step's kept states); each depth is one pass of the head over
every position, its attention over (depth x positions) keys, and one pass of the output head
over the positions whose chain is still graded (accepted so far, the text going on with it):
the output head is most of the cost, and at depth 3 few chains are left.
"""

from __future__ import annotations

from buildkit.core.lazy import lazy
from buildkit.grade import evaluate as ev
from buildkit.grade import forward as fw
from buildkit.grade import stats
from buildkit.grade.forward import Trunk
from buildkit.grade.weights import Weights

np = lazy("numpy", __name__)


class _Keys:
    """A stand-in KV cache for mlx_lm's attention: RoPE ``offset``, earlier keys (already
    rotated) in front of the new ones; keeps the new ones for the next depth."""

    def __init__(self, offset: int, keys=None, values=None):
        self.offset, self.keys, self.values, self.new = offset, keys, values, None

    def update_and_fetch(self, k, v):
        import mlx.core as mx

        self.new = (k, v)
        if self.keys is None:
            return k, v
        return mx.concatenate([self.keys, k], axis=2), mx.concatenate([self.values, v], axis=2)


def _chain_mask(n: int, depth: int):
    """[n, depth*n] bool: a depth's query at t sees the true entries 0..t and, of each
    earlier chain depth (and its own), only position t."""
    import mlx.core as mx

    t = mx.arange(n)
    blocks = [t[None, :] <= t[:, None]] + [t[None, :] == t[:, None]] * (depth - 1)
    return mx.concatenate(blocks, axis=1)


def head_pass(head, emb, hidden, cache, mask):
    """The head over (embeddings, hidden states) with mlx_lm's attention ``cache`` and ``mask``."""
    import mlx.core as mx

    x = head.fc(
        mx.concatenate([head.pre_fc_norm_embedding(emb), head.pre_fc_norm_hidden(hidden)], axis=-1)
    )
    for layer in head.layers:
        x = layer(x, mask=mask, cache=cache)
    return head.norm(x)


def drafts_by_depth(w: Weights, t: Trunk, tokens: list[int], depth: int) -> list[list[int]]:
    """Per window, [[accepted, tried], ...] for depths 1..``depth`` of ``w``'s head on its own
    trunk ``t`` (``t.argmax`` filled) over ``tokens``, the text the trunk ran."""
    return count(chains(w, t, depth, tokens), t, tokens, depth)


def targets(t: Trunk, tokens: list[int]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per batch of ``t``, the trunk's argmax and the text's tokens, each [B, L]."""
    out, ams, start = [], iter(t.argmax), 0
    for h in t.h:
        B, L = h.shape[0], h.shape[1]
        a = np.stack([np.asarray(next(ams)) for _ in range(B)])
        out.append((a, np.asarray(tokens[start : start + B * L]).reshape(B, L)))
        start += B * L
    return out


def graded(alive: np.ndarray, draft: np.ndarray, a: np.ndarray, x: np.ndarray, d: int) -> tuple:
    """Of a batch's depth-``d`` drafts [B, L-1] where ``alive``: (tried, accepted, alive at
    depth d+1). Tried: its target, the trunk's argmax at t+d, lies in the text; accepted: it
    equals that argmax; alive on: accepted and the text itself went on with it (x_{t+1+d} = d),
    so the trunk's next state is the one a verify would compare the next draft with."""
    L = a.shape[1]
    pos = np.arange(L - 1)
    tried = alive & (pos + d <= L - 2)
    ok = tried & (draft == a[:, np.minimum(pos + d, L - 1)])
    return tried, ok, ok & (draft == x[:, np.minimum(pos + d + 1, L - 1)])


def chains(w: Weights, t: Trunk, depth: int, tokens: list[int] | None = None) -> list[list]:
    """Per batch, per depth, the head's drafts [B, L-1] (position t drafts token t+1+depth).
    Given the text's ``tokens``, read out only where ``count`` grades them (``graded``'s
    alive; -1 elsewhere): the output head, 2 TFLOP per depth over 2k positions at the real
    vocabulary, is most of the cost, and a chain is graded only while its drafts are
    accepted. Without, every position's."""
    import mlx.core as mx

    head = ev.streamed_head(w)  # its experts read a block at a time, never whole
    n_batches = len(t.h)
    hidden = [h[:, :-1] for h in t.h]  # h_t for t = 0..L-2
    emb = [x0[:, 1:] for x0 in t.x0]  # embed(x_{t+1})
    keys: list[_Keys | None] = [None] * n_batches
    drafts: list[list] = [[] for _ in range(n_batches)]  # per batch, per depth: [B, L-1]
    truth = None if tokens is None else targets(t, tokens)
    alive = [np.ones((h.shape[0], h.shape[1] - 1), bool) for h in t.h]
    for d in range(1, depth + 1):
        if d > 1:
            emb = [mx.array(fw.embeddings(w, np.maximum(dr[-1], 0))) for dr in drafts]
        outs = []
        for j in range(n_batches):
            n = hidden[j].shape[1]
            if d == 1:
                cache = _Keys(0)
                mask = "causal" if n > 1 else None  # what head_acceptance's pass gets
            else:
                cache = _Keys(d - 1, keys[j].keys, keys[j].values)
                mask = _chain_mask(n, d)
            o = head_pass(head, emb[j], hidden[j], cache, mask)
            mx.eval(o)
            k, v = cache.new
            if keys[j] is None:
                keys[j] = _Keys(0, k, v)
            else:
                keys[j].keys = mx.concatenate([keys[j].keys, k], axis=2)
                keys[j].values = mx.concatenate([keys[j].values, v], axis=2)
            hidden[j] = o
            outs.append(o)
        # the trunk's final norm and lm_head over the graded positions of every batch at once,
        # the vocabulary streamed (forward.HeadScan)
        sel = np.concatenate([a.reshape(-1) for a in alive])
        arg = np.full(len(sel), -1, np.int64)
        if sel.any():
            arg[sel] = fw.HeadScan([w], [fw.final_norm(w, outs)[sel]]).arg[0]
        at = 0
        for j in range(n_batches):
            pred = arg[at : at + alive[j].size].reshape(alive[j].shape)
            at += alive[j].size
            drafts[j].append(pred)
            if truth is not None:
                alive[j] = graded(alive[j], pred, *truth[j], d)[2]
    return drafts


def count(drafts: list[list], t: Trunk, tokens: list[int], depth: int) -> list:
    """Per window, accepted and tried drafts per depth ([window][depth] = [accepted, tried]:
    the bootstrap resamples windows), as ``graded`` decides them."""
    out = []
    for j, (a, x) in enumerate(targets(t, tokens)):
        counts = np.zeros((a.shape[0], depth, 2), np.int64)
        alive = np.ones((a.shape[0], a.shape[1] - 1), bool)
        for d in range(1, depth + 1):
            tried, ok, alive = graded(alive, np.asarray(drafts[j][d - 1]), a, x, d)
            counts[:, d - 1] = np.stack([ok.sum(1), tried.sum(1)], axis=1)
        out += counts.tolist()
    return out


def verify_costs(verify_cost: float | list[float], depth: int) -> list[float]:
    """The cost of a verify cycle with 1..depth drafts, in plain decode steps."""
    if isinstance(verify_cost, (int, float)):
        return [float(verify_cost)] * depth
    if len(verify_cost) < depth:
        from buildkit.core.errors import UsageError

        raise UsageError(
            f"verify_cost lists {len(verify_cost)} costs but depth is {depth}: "
            "give one per draft length, or one number for all"
        )
    return [float(c) for c in verify_cost[:depth]]


def figures(
    src: Weights,
    mod: Weights,
    ts: Trunk,
    tm: Trunk,
    tokens: list[int],
    depth: int,
    verify_cost: float | list[float],
) -> dict:
    """Both heads' figures on one text, with intervals, from one drafting chain each: the
    acceptance (depth 1's rate, ``evaluate.heads``) and the depth figures (``report``) of this
    head on this trunk and of the bf16 head on the bf16 trunk (``*_source``)."""
    counts = both_counts(src, mod, ts, tm, tokens, depth)
    windows = [""] * len(counts["model"])
    fig = ev.heads({who: first_draft(c) for who, c in counts.items()}, windows)
    stats.merge(fig, report(counts["model"], counts["source"], len(tokens), depth, verify_cost))
    return fig


def both_counts(src: Weights, mod: Weights, ts: Trunk, tm: Trunk, tokens: list[int], depth: int):
    """Each head's ``drafts_by_depth`` counts on its own trunk: "model" (this head on this
    trunk) and "source" (the bf16 head on the bf16 trunk)."""
    return {
        "model": drafts_by_depth(mod, tm, tokens, depth),
        "source": drafts_by_depth(src, ts, tokens, depth),
    }


def first_draft(counts: list) -> tuple[list[int], list[int]]:
    """Per window, depth 1's accepted and tried drafts (``drafts_by_depth``'s counts): the
    acceptance's hits and positions, the draft ``evaluate.head_hits`` makes."""
    return [c[0][0] for c in counts], [c[0][1] for c in counts]


def report(
    model: list, source: list, n_tokens: int, depth: int, verify_cost: float | list[float]
) -> dict:
    """``figures`` from the two heads' counts (``drafts_by_depth``'s, [window][depth])."""
    costs = verify_costs(verify_cost, depth)
    fm = stats.depth_figures(model, costs, n_tokens)
    fs = stats.depth_figures(source, costs, n_tokens)
    ci = fm.pop("ci95")
    ci["tokens_per_cycle_source"] = fs["ci95"]["tokens_per_cycle"]
    return {
        **fm,
        "drafts_by_depth_source": fs["drafts_by_depth"],
        "tokens_per_cycle_source": fs["tokens_per_cycle"],
        "ci95": ci,
    }
