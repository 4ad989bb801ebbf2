"""Train the small qwen3_5_moe checkpoints shipped in buildkit/data/trained*/ (``fixture:trained``,
``fixture:trained=NAME``): one script, a corpus and a ``fixtures.trained.FIXTURES`` spec each.

``--fixture kjv`` (the default; buildkit/data/trained): the King James Version of the Bible
(1611), as shipped by Debian's ``bible-kjv-text`` package and printed by its ``bible`` program.
The translation's copyright has long expired; the package's copyright file says so ("The
copyright for the King James Version text of the Bible is expired"). Public domain (outside the
UK's Crown letters patent, which do not restrict this use). One line per verse. The committed
run took 1445 s for 550 steps on 2 CPU cores that other processes shared.

``--fixture austen`` (buildkit/data/trained-austen, shaped like the real model: 48 experts,
top-4, routed experts 88% of the text weights): Jane Austen's six novels (1811-1818, public
domain) as Debian's ``r-cran-janeaustenr`` ships them (MIT-licensed R package; the provenance is
in the data directory's LICENSE), printed through ``Rscript``. One line per paragraph, chapter
headings dropped. The committed run's steps and time are in its meta.json.

``--fixture austen64`` (buildkit/data/trained-austen64): the same novels, 64 experts, top-4,
hidden 64 (at austen's 128 the weights would be 17 MB), routed experts 91% of the text weights:
the many-expert regime where a sensitivity estimate must hold (issue 41).

Rerun (CI never runs it):

    apt-get install bible-kjv libopenblas0-pthread   # the corpus; a fast BLAS for mlx's matmuls
    apt-get install --no-install-recommends r-cran-janeaustenr   # austen's corpus
    OPENBLAS_NUM_THREADS=2 LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \
        PYTHONPATH=. .venv/bin/python training/train_fixture.py \
        [--fixture kjv|austen|austen64] [--steps N] [--out DIR]

The preload is only for speed: the ``mlx[cpu]`` wheel's bundled reference BLAS makes a step
~2.5x slower here (measured on one step: 6.0 s against 2.5 s). Seeds fix the initialisation and
the batches; the floating-point sums depend on the BLAS and its thread count, so a rerun with
another BLAS gives close but not bit-identical weights. ``fixtures.trained.write_trained`` is
deterministic from the committed files, which is what tests and builds use.

What it does, seeded (mlx and numpy seeds; batch order and initialisation are fixed):
1. One line per verse (paragraph); every 20th is held out, the rest trains. A byte-level BPE
   of the spec's vocabulary is trained on the training lines
   (``buildkit.fixtures.generated.train_tokenizer``).
2. mlx_lm's own ``qwen3_5_moe`` classes in float32 for the trunk, in the shape of the
   fixture's ``FixtureSpec``; an MTP head built from mlx_lm's ``DecoderLayer`` (full attention,
   MoE) run as the runtime runs it: ``fc(cat([norm_e(embed(t+1)), norm_h(h_t)]))`` with h_t the
   trunk's hidden state before the final norm, the decoder layer, ``norm``, the trunk's ``lm_head``.
3. AdamW, warm-up then cosine decay. Loss: next-token cross-entropy of the trunk, plus the head's
   next-next-token cross-entropy (the head sees the trunk's h_t and embeddings through
   stop_gradient, so the trunk is a plain next-token model), plus a small Switch-style
   load-balancing loss on every router so that experts specialise without collapsing.
4. Writes ``weights.safetensors`` (text and ``mtp.*`` tensors, Hugging Face names and layout,
   bf16: fused gate-first experts, conv1d [C,1,K], offset norms stored as w - 1),
   ``tokenizer.json``, ``heldout.txt`` (the first held-out lines, for tests) and ``meta.json``.
5. Round trip: writes the full checkpoint with ``fixtures.trained.write_trained`` to a temporary
   directory, loads it through mlx_lm's sanitize, and measures on the held-out verses, from those
   bf16 weights: trunk loss and perplexity, routed-token counts per expert per layer, and the
   head's teacher-forced depth-1 draft acceptance (share of positions t where the head's argmax
   for t+2 equals the trunk's argmax at t+1). It prints them and records them in meta.json.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models import qwen3_5_moe
from mlx_lm.models.base import create_attention_mask, create_ssm_mask
from mlx_lm.models.qwen3_5 import DecoderLayer, TextModelArgs

from buildkit.fixtures import generated as fixture
from buildkit.fixtures import trained
from buildkit.formats.tensors import f32_to_bf16, header_bytes

HELDOUT_EVERY = 20
HELDOUT_SHIPPED = 120  # verses written to heldout.txt for the tests
EVAL_TOKENS = 16384
SEQ, BATCH = 64, 32
AUX_COEF = 0.02
OFFSET_NORMS = (
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
    "model.language_model.norm.weight",
    "mtp.norm.weight",
    "mtp.pre_fc_norm_embedding.weight",
    "mtp.pre_fc_norm_hidden.weight",
)


def kjv_verses() -> list[str]:
    """Every verse of the KJV, one per line, verse numbers and chapter headings removed."""
    if not shutil.which("bible"):
        sys.exit("the corpus comes from Debian's bible-kjv package: apt-get install bible-kjv")
    text = subprocess.run(
        ["bible", "-l200", "gen1:1-rev22:21"], capture_output=True, text=True, check=True
    ).stdout
    verses: list[str] = []
    for line in text.splitlines():
        m = re.match(r"^\s+\d+ (.*)$", line)
        if m:
            verses.append(m[1].strip())
        elif line.strip() and not re.match(r"^\S.* \d+$", line) and verses:
            verses[-1] += " " + line.strip()  # a wrapped verse
    return [" ".join(v.split()) for v in verses]


def austen_paragraphs() -> list[str]:
    """Every paragraph of Jane Austen's six novels, one per line, chapter headings removed."""
    if not shutil.which("Rscript"):
        sys.exit(
            "the corpus comes from Debian's r-cran-janeaustenr package: "
            "apt-get install --no-install-recommends r-cran-janeaustenr"
        )
    text = subprocess.run(
        ["Rscript", "-e", "writeLines(janeaustenr::austen_books()$text)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text)]
    heading = re.compile(r"^(chapter|volume) [0-9ivxlc]+\.?$|^(the )?end\.?$", re.IGNORECASE)
    return [p for p in paragraphs if p and not heading.match(p)]


class Corpus(NamedTuple):
    lines: Callable[[], list[str]]
    unit: str  # what one line is, for heldout.txt's header
    name: str
    licence: str


CORPORA = {
    "kjv": Corpus(
        kjv_verses,
        "verses of the King James Version (1611; public domain): every 20th verse from\n"
        "# Genesis on",
        "King James Version of the Bible (1611), Debian package bible-kjv-text 4.38",
        "public domain (copyright expired)",
    ),
    "austen": Corpus(
        austen_paragraphs,
        "paragraphs of Jane Austen's six novels (1811-1818; public domain): every 20th\n"
        "# paragraph from Sense and Sensibility on",
        "Jane Austen's six novels (Sense and Sensibility, Pride and Prejudice, Mansfield Park, "
        "Emma, Northanger Abbey, Persuasion) as Project Gutenberg transcribed them, from Debian "
        "package r-cran-janeaustenr 1.0.0-1 (R package janeaustenr 1.0.0 by Julia Silge, MIT)",
        "public domain (the novels, published 1811-1818; copyright long expired); the "
        "packaging MIT",
    ),
}
CORPORA["austen64"] = CORPORA["austen"]  # the same novels, a model of 64 experts


# ---- the model ---------------------------------------------------------------------------


class RouterTap(nn.Linear):
    """The router, recording its logits for the load-balancing loss (same parameter names)."""

    log: list = []

    def __call__(self, x):
        y = super().__call__(x)
        RouterTap.log.append(y)
        return y


def tap_routers(layers) -> None:
    for layer in layers:
        old = layer.mlp.gate
        new = RouterTap(old.weight.shape[1], old.weight.shape[0], bias=False)
        new.weight = old.weight
        layer.mlp.gate = new


class MTPHead(nn.Module):
    def __init__(self, args: TextModelArgs):
        super().__init__()
        H, eps = args.hidden_size, args.rms_norm_eps
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.pre_fc_norm_embedding = nn.RMSNorm(H, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(H, eps=eps)
        self.layers = [DecoderLayer(args, layer_idx=args.full_attention_interval - 1)]
        self.norm = nn.RMSNorm(H, eps=eps)

    def __call__(self, h, next_embed):
        x = self.fc(
            mx.concatenate([self.pre_fc_norm_embedding(next_embed), self.pre_fc_norm_hidden(h)], -1)
        )
        x = self.layers[0](x, mask=create_attention_mask(x, None), cache=None)
        return self.norm(x)


def trunk(model, ids):
    """(hidden states before the final norm, logits) of the trunk over ids [B, T]."""
    text = model.language_model.model
    h = text.embed_tokens(ids)
    fa, ssm = create_attention_mask(h, None), create_ssm_mask(h, None)
    for layer in text.layers:
        h = layer(h, mask=ssm if layer.is_linear else fa, cache=None)
    return h, model.language_model.lm_head(text.norm(h))


def forward(model, head, ids):
    """Trunk logits at positions 0..T-2 (targets ids[1:]) and head logits at 0..T-3
    (targets ids[2:])."""
    h, logits = trunk(model, ids[:, :-1])
    emb = model.language_model.model.embed_tokens(ids[:, 1:-1])
    g = head(mx.stop_gradient(h[:, :-1]), mx.stop_gradient(emb))
    return logits, model.language_model.lm_head(g)


def balance_loss(logs, k: int) -> mx.array:
    total = mx.array(0.0)
    for logit in logs:
        p = mx.softmax(logit.reshape(-1, logit.shape[-1]), axis=-1)
        top = mx.argpartition(-p, kth=k - 1, axis=-1)[:, :k]
        f = mx.stop_gradient(
            mx.zeros_like(p).at[mx.arange(p.shape[0])[:, None], top].add(1.0).mean(0) / k
        )
        total = total + p.shape[-1] * (f * p.mean(0)).sum()
    return total / max(len(logs), 1)


# ---- HF layout ---------------------------------------------------------------------------


def to_hf(model, head) -> dict[str, np.ndarray]:
    """float32 HF-named tensors (the reverse of mlx_lm's qwen3_5_moe sanitize)."""
    flat = dict(tree_flatten(model.parameters()))
    flat.update({"mtp." + k: v for k, v in tree_flatten(head.parameters())})
    out: dict[str, np.ndarray] = {}
    for k, v in flat.items():
        a = np.array(v.astype(mx.float32))
        if ".switch_mlp." in k:  # experts fused gate first: gate_up [E, 2I, H], down [E, H, I]
            prefix, proj = k.split(".switch_mlp.")
            if proj == "up_proj.weight":
                continue
            if proj == "gate_proj.weight":
                up = np.array(flat[prefix + ".switch_mlp.up_proj.weight"].astype(mx.float32))
                a, k = np.concatenate([a, up], axis=1), prefix + ".experts.gate_up_proj"
            else:
                k = prefix + ".experts.down_proj"
        if k.startswith("language_model.model."):
            k = "model.language_model." + k[len("language_model.model.") :]
        elif k == "language_model.lm_head.weight":
            k = "lm_head.weight"
        if k.endswith("conv1d.weight"):
            a = np.moveaxis(a, 2, 1)  # mlx [C, K, 1] -> HF [C, 1, K]
        if k.endswith(OFFSET_NORMS):
            a = a - 1.0  # HF stores offset norms; the runtime weight is 1 + w
        out[k] = np.ascontiguousarray(a, dtype=np.float32)
    return out


def write_weights(path: Path, tensors: dict[str, np.ndarray]) -> None:
    names = sorted(tensors)
    bits = {n: f32_to_bf16(tensors[n]) for n in names}
    with open(path, "wb") as f:
        f.write(header_bytes([(n, "BF16", bits[n].shape) for n in names], {"format": "pt"}))
        for n in names:
            f.write(bits[n].tobytes())


def load_hf(ckpt: Path):
    """The trunk (mlx_lm Model through its own sanitize) and an MTPHead, float32, from an HF dir."""
    config = json.loads((ckpt / "config.json").read_text())
    model = qwen3_5_moe.Model(qwen3_5_moe.ModelArgs.from_dict(config))
    weights = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        weights.update(mx.load(str(f)))
    mtp = {k[len("mtp.") :]: v for k, v in weights.items() if k.startswith("mtp.")}
    model.load_weights(list(model.sanitize(weights).items()), strict=True)
    head = MTPHead(model.language_model.args)
    for n in range(len(head.layers)):  # the same sanitize as the trunk's layers
        p = f"layers.{n}.mlp.experts."
        gu = mtp.pop(p + "gate_up_proj")
        I = gu.shape[1] // 2
        mtp[f"layers.{n}.mlp.switch_mlp.gate_proj.weight"] = gu[:, :I]
        mtp[f"layers.{n}.mlp.switch_mlp.up_proj.weight"] = gu[:, I:]
        mtp[f"layers.{n}.mlp.switch_mlp.down_proj.weight"] = mtp.pop(p + "down_proj")
    for k in mtp:  # every head norm is an offset norm
        if "norm" in k:
            mtp[k] = mtp[k] + 1.0
    head.load_weights(list(mtp.items()), strict=True)
    for m in (model, head):
        m.update(tree_map(lambda a: a.astype(mx.float32), m.parameters()))
        m.eval()
    return model, head


# ---- measuring ---------------------------------------------------------------------------


def measure(model, head, ids: np.ndarray, n_experts: int, k: int) -> dict:
    """Held-out loss, perplexity, acceptance and routed-token counts over sequences of SEQ + 2."""
    n = len(ids) // (SEQ + 2) * (SEQ + 2)
    batch = mx.array(ids[:n].reshape(-1, SEQ + 2))
    counts: dict[str, np.ndarray] = {}
    nll = hits = positions = tokens = 0.0
    names = [f"layers.{i}" for i in range(len(model.language_model.model.layers))] + [
        "mtp.layers.0"
    ]
    for i in range(0, batch.shape[0], 8):
        x = batch[i : i + 8]
        RouterTap.log.clear()
        logits, hlogits = forward(model, head, x)
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        nll += float(-mx.take_along_axis(logp, x[:, 1:, None], axis=-1).sum())
        tokens += x[:, 1:].size
        trunk_next = mx.argmax(logits[:, 1:], axis=-1)  # the trunk's argmax at t+1
        hits += float((mx.argmax(hlogits, axis=-1) == trunk_next).sum())
        positions += trunk_next.size
        for name, logit in zip(names, RouterTap.log):
            top = np.array(mx.argpartition(-logit, kth=k - 1, axis=-1)[..., :k]).reshape(-1)
            counts[name] = counts.get(name, 0) + np.bincount(top, minlength=n_experts)
    loss = nll / tokens
    return {
        "heldout_tokens": int(tokens),
        "loss": loss,
        "perplexity": math.exp(loss),
        "acceptance": hits / positions,
        "expert_tokens": {k: [int(c) for c in v] for k, v in counts.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fixture", choices=sorted(trained.FIXTURES), default=trained.DEFAULT)
    ap.add_argument("--steps", type=int, default=550)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--out", type=Path, help="default: the fixture's data directory")
    args = ap.parse_args()
    mx.random.seed(0)
    rng = np.random.default_rng(0)
    fix, corpus = trained.FIXTURES[args.fixture], CORPORA[args.fixture]
    spec = fix.spec

    verses = corpus.lines()
    train_v = [v for i, v in enumerate(verses) if i % HELDOUT_EVERY != HELDOUT_EVERY - 1]
    held_v = [v for i, v in enumerate(verses) if i % HELDOUT_EVERY == HELDOUT_EVERY - 1]
    tok = fixture.train_tokenizer(train_v, spec.vocab)
    ids = np.array(tok.encode("\n".join(train_v), add_special_tokens=False).ids, np.int32)
    held = np.array(tok.encode("\n".join(held_v), add_special_tokens=False).ids, np.int32)[
        :EVAL_TOKENS
    ]
    print(
        f"corpus: {len(verses)} lines, {len(ids)} training tokens, {len(held)} held-out tokens",
        flush=True,
    )

    ids_map = {t: tok.token_to_id(t) for t in fixture.SPECIAL_TOKENS}
    config, _ = fixture._configs(spec, ids_map)
    model = qwen3_5_moe.Model(qwen3_5_moe.ModelArgs.from_dict(config))
    head = MTPHead(model.language_model.args)
    tap_routers(list(model.language_model.model.layers) + list(head.layers))
    k = spec.experts_per_tok

    class Both(nn.Module):
        def __init__(self):
            super().__init__()
            self.model, self.head = model, head

    both = Both()
    both.update(tree_map(lambda a: a.astype(mx.float32), both.parameters()))
    mx.eval(both.parameters())
    print(f"parameters: {sum(v.size for _, v in tree_flatten(both.parameters()))}", flush=True)

    warm = max(args.steps // 20, 10)
    sched = optim.join_schedules(
        [
            optim.linear_schedule(args.lr / 20, args.lr, warm),
            optim.cosine_decay(args.lr, args.steps - warm, args.lr / 20),
        ],
        [warm],
    )
    opt = optim.AdamW(learning_rate=sched, weight_decay=0.01)

    def loss_fn(b, x):
        RouterTap.log.clear()
        logits, hlogits = forward(b.model, b.head, x)
        lt = nn.losses.cross_entropy(logits, x[:, 1:], reduction="mean")
        lh = nn.losses.cross_entropy(hlogits, x[:, 2:], reduction="mean")
        aux = balance_loss(RouterTap.log, k)
        return lt + lh + AUX_COEF * aux, (lt, lh, aux)

    grad_fn = nn.value_and_grad(both, lambda x: loss_fn(both, x))

    def step(x):
        (loss, parts), grads = grad_fn(x)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(both, grads)
        return loss, parts

    both.train()
    t0 = time.time()
    for s in range(args.steps):
        starts = rng.integers(0, len(ids) - SEQ - 2, BATCH)
        x = mx.array(np.stack([ids[i : i + SEQ + 2] for i in starts]))
        loss, (lt, lh, aux) = step(x)
        mx.eval(loss, both.parameters(), opt.state)
        if s % 25 == 0 or s == args.steps - 1:
            print(
                f"step {s:4d}  trunk {float(lt):.3f}  head {float(lh):.3f}  "
                f"balance {float(aux):.3f}  "
                f"{time.time() - t0:.0f}s",
                flush=True,
            )
    train_s = time.time() - t0

    out: Path = args.out or fix.data
    out.mkdir(parents=True, exist_ok=True)
    write_weights(out / "weights.safetensors", to_hf(model, head))
    (out / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n")
    (out / "heldout.txt").write_text(
        f"# Held-out {corpus.unit}, never trained on. Written by training/train_fixture.py.\n"
        + "\n".join(held_v[:HELDOUT_SHIPPED])
        + "\n"
    )

    tmp = Path(tempfile.mkdtemp())
    try:
        ckpt = trained.write_trained(tmp / "ckpt", data=out, spec=spec)
        m2, h2 = load_hf(ckpt)
        tap_routers(list(m2.language_model.model.layers) + list(h2.layers))
        # round trip: the written checkpoint against the trained float32 model
        x = mx.array(held[: 2 * (SEQ + 2)].reshape(2, -1))
        both.eval()
        a, ah = forward(model, head, x)
        b, bh = forward(m2, h2, x)
        trip = {
            "max_abs_logit_diff": float(mx.abs(a - b).max()),
            "argmax_agreement": float((mx.argmax(a, -1) == mx.argmax(b, -1)).mean()),
            "head_argmax_agreement": float((mx.argmax(ah, -1) == mx.argmax(bh, -1)).mean()),
        }
        print(f"round trip (float32 trained vs bf16 written): {trip}", flush=True)
        figures = measure(m2, h2, held, spec.experts, k)
    finally:
        shutil.rmtree(tmp)
    figures.update(train_seconds=round(train_s, 1), steps=args.steps, round_trip=trip)
    meta = {
        "corpus": corpus.name,
        "licence": corpus.licence,
        "heldout_every": HELDOUT_EVERY,
        # calibrate's max_tokens for the real model's routed rows per expert input (0.0625)
        "calibration_tokens_real_regime": trained.calibration_tokens(spec),
        "seq_len": SEQ,
        "batch": BATCH,
        "lr": args.lr,
        "figures": figures,
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    print(
        f"held-out: loss {figures['loss']:.3f}  perplexity {figures['perplexity']:.1f} "
        f"(vocab {spec.vocab})  acceptance {figures['acceptance']:.3f}  "
        f"on {figures['heldout_tokens']} tokens"
    )
    for name, c in figures["expert_tokens"].items():
        print(f"  {name:14s} routed tokens per expert: {c}")
    print(f"training: {args.steps} steps in {train_s:.0f} s")


if __name__ == "__main__":
    main()
