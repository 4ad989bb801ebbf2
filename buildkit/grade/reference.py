"""The bf16 reference: the source's pass over a text's windows, computed once and graded
against by every model built from that source.

Per window: the source trunk's embeddings, its last hidden states (before the final norm) and
its argmax at every position (which the MTP heads draft from), and a summary of its output head
(``forward.HeadSummary``) with which a model whose lm_head is the source's, byte for byte, is
graded by its own head's scan alone. The hidden states are the source's next-token
distributions one matmul away: for any other model eval streams the source's lm_head beside
the model's (``forward.HeadScan``). Either way every figure is over the whole vocabulary:
KL divergence per position (its mean and percentiles), top-1 agreement, Δp of the
reference's top token, both perplexities and, for the heads, acceptance. What eval no longer
runs is the source's trunk, all of its forward but the output head.

Not kept: the top 256 tokens' log-probabilities and the tail's mass, the vocabulary's size
whatever the model, put KL 5.9 % under the full computation on the trained fixture (kjv, xl:
a flat distribution near bf16, its divergence spread over the tail); float16 distributions
cost the vocabulary per position (0.5 MB at 248,320).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from buildkit.core.errors import StepError
from buildkit.core.lazy import lazy
from buildkit.grade import forward as fw
from buildkit.grade import texts
from buildkit.grade.weights import Weights
from buildkit.store.artifact import Artifact

np = lazy("numpy", __name__)


@dataclass
class Reference:
    """The source's pass over the windows (``groups[j]``: the text of batch ``j``, "" the main
    one): its trunk (``trunk.argmax`` filled)."""

    windows: list  # [B, L] token ids per batch
    groups: list[str]
    trunk: fw.Trunk
    meta: dict = field(default_factory=dict)
    # the source's output head per position (rows' order): eval's figures of a model with the
    # same head bytes take its own logits alone (``forward.HeadSummary``)
    head: fw.HeadSummary | None = None

    def tokens(self, group: str) -> int:
        """The tokens graded of one text ("" the main one)."""
        return sum(
            int(w.size) for w, g in zip(self.windows, self.groups, strict=True) if g == group
        )

    def main_tokens(self) -> list[int]:
        """The main text's token ids, as its windows hold them."""
        rows = [w.reshape(-1) for w, g in zip(self.windows, self.groups, strict=True) if g == ""]
        return np.concatenate(rows).tolist() if rows else []

    def part(self, a: int, b: int, domains: bool) -> Reference:
        """The main text's windows that start at tokens [a, b) and (``domains``) every domain's,
        in order: a round of eval's grading."""
        windows, groups, x0, h, am, pos, row, seen, first = [], [], [], [], [], [], 0, 0, 0
        for w, g, x, y in zip(self.windows, self.groups, self.trunk.x0, self.trunk.h, strict=True):
            starts = seen + w.shape[1] * np.arange(w.shape[0])
            keep = (a <= starts) & (starts < b) if g == "" else np.full(w.shape[0], domains)
            seen += w.size if g == "" else 0
            if keep.any():
                r0, r1 = int(np.argmax(keep)), int(len(keep) - np.argmax(keep[::-1]))
                windows.append(w[r0:r1])
                x0.append(x[r0:r1])
                h.append(y[r0:r1])
                groups.append(g)
                am += self.trunk.argmax[row + r0 : row + r1]
                pos.append(np.arange(first + r0 * w.shape[1], first + r1 * w.shape[1]))
            row, first = row + w.shape[0], first + w.size  # first: the batch's first position
        head = self.head.take(np.concatenate(pos)) if self.head is not None and pos else None
        return Reference(windows, groups, fw.Trunk(x0, h, am, groups), self.meta, head)

    def targets(self) -> np.ndarray:
        """The next token at every position [N] (-1 at a window's last)."""
        return next_tokens(self.windows)


def layout(tokens: dict[str, list[int]], seq_len: int) -> tuple[list, list[str]]:
    """(windows, the text of each batch) of each text's tokens (name -> ids, "" the main)."""
    windows, groups = [], []
    for g, toks in tokens.items():
        for b in texts.windows(toks, seq_len):
            windows.append(b)
            groups.append(g)
    return windows, groups


def next_tokens(windows: list) -> np.ndarray:
    return np.concatenate([np.append(s[1:], -1) for _, _, s in fw.rows(windows)])


def compute(
    src: Weights, windows: list, groups: list[str], progress=None, head: bool = True
) -> Reference:
    """The source's reference on ``windows`` (batches [B, L] of token ids), with (``head``) its
    output head's summary: one more matmul the size of the head's logits, which every eval of
    a model with the same head saves."""
    trunk = fw.run_trunk(src, windows, progress)
    trunk.groups = list(groups)
    targets = next_tokens(windows) if head else None
    top = fw.SUMMARY_TOP if head else 0
    scan = fw.HeadScan([src], [fw.final_norm(src, trunk.h)], targets, top=top, mean=head)
    lengths = [len(s) for _, _, s in fw.rows(windows)]
    trunk.argmax = np.split(scan.arg[0], np.cumsum(lengths)[:-1])
    return Reference(windows, list(groups), trunk, head=scan.summary() if head else None)


# ---- in the store ----------------------------------------------------------------------

# the head summary's tensors and their dtypes (``forward.HeadScan.summary`` makes them so)
SUMMARY = {"lse": "F64", "tgt": "F64", "ids": "I32", "logits": "F32", "mean": "F32"}


def put(store, ref: Reference) -> Artifact:
    """The reference as an artifact: tensors by name, ``meta`` with the groups."""
    art = Artifact(meta={**ref.meta, "groups": ref.groups})
    t = art.tensors
    for j, (w, x0, h) in enumerate(zip(ref.windows, ref.trunk.x0, ref.trunk.h, strict=True)):
        t[f"windows.{j}"] = store.put_tensor("I32", np.asarray(w, np.int32))
        t[f"source.x0.{j}"] = store.put_tensor("F32", np.array(x0))
        t[f"source.h.{j}"] = store.put_tensor("F32", np.array(h))
    t["source.argmax"] = store.put_tensor("I32", np.concatenate(ref.trunk.argmax).astype(np.int32))
    if ref.head is not None:
        for k, dtype in SUMMARY.items():
            t[f"source.{k}"] = store.put_tensor(dtype, getattr(ref.head, k))
    return art


def get(store, arts: list[Artifact]) -> Reference:
    """One Reference from one or more reference artifacts (their batches in turn); each text
    ("" the main one, else a domain's name) from one of them."""
    import mlx.core as mx

    windows, groups, x0, h, am, meta, seq_len, heads = [], [], [], [], [], {}, None, []
    for a in arts:
        texts_here = a.meta.get("texts", {})
        if twice := sorted(set(texts_here) & set(meta)):
            raise StepError(
                f"two reference inputs grade the text {twice[0] or 'params.text'!r}: "
                "give each text to one reference step"
            )
        meta |= texts_here
        seq_len = a.meta["seq_len"] if "" in texts_here else seq_len
        n = len(a.meta["groups"])
        windows += [store.read_tensor(a.tensors[f"windows.{j}"]) for j in range(n)]
        x0 += [mx.array(store.read_tensor(a.tensors[f"source.x0.{j}"])) for j in range(n)]
        h += [mx.array(store.read_tensor(a.tensors[f"source.h.{j}"])) for j in range(n)]
        groups += a.meta["groups"]
        am.append(store.read_tensor(a.tensors["source.argmax"]))
        if all(f"source.{k}" in a.tensors for k in SUMMARY):
            got = {k: store.read_tensor(a.tensors[f"source.{k}"]) for k in SUMMARY}
            heads.append(fw.HeadSummary(**got))
    lengths = [len(s) for _, _, s in fw.rows(windows)]
    trunk = fw.Trunk(x0, h, np.split(np.concatenate(am), np.cumsum(lengths)[:-1]), groups)
    head = fw.HeadSummary.join(heads) if heads and len(heads) == len(arts) else None
    return Reference(windows, groups, trunk, {"texts": meta, "seq_len": seq_len}, head)
