"""What the drafting figures (issue 36) cost: on the trained fixture, and on the real model's
head and output-head shapes.

Fixture part: builds xl-mtp from ``fixture:trained`` (untimed) and writes the trained source,
then times, in this process, the trunk pass eval already makes (both models), depth-1
acceptance by ``evaluate.head_hits`` (both heads), the heads' figures (``drafting.figures``:
acceptance and depths, both heads, depth 1..3) and mlx_vlm's speculative run
(``speculative.run`` with its defaults, float32 and bf16).

``--real-shapes``: one MTP head layer with the real model's dimensions (2048 hidden, 256
experts top-8, moe_intermediate 512; experts 6-bit, attention 8-bit, as xl-mtp quantizes it;
random weights: the cost does not depend on the values) over one sequence of 127 positions,
and the output head (vocab 248320 x 2048, float32 as eval runs it) over the same positions: a
depth costs one of each per model per sequence of 128 tokens.

Usage::

    python bench/spec_bench.py [--real-shapes]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def clock(fn, *a, **kw):
    w, c = time.perf_counter(), time.process_time()
    out = fn(*a, **kw)
    return out, time.perf_counter() - w, time.process_time() - c


def fixture(work: Path) -> list[tuple[str, float, float]]:
    from buildkit.clients import speculative
    from buildkit.fixtures.trained import write_trained
    from buildkit.grade import drafting
    from buildkit.grade import evaluate as ev
    from buildkit.grade.texts import heldout_tokens
    from buildkit.grade.weights import DirWeights

    out = work / "xl-mtp"
    subprocess.run(
        [sys.executable, "-m", "buildkit.cli", "--store", str(work / "cache"), "build", "xl-mtp",
         "--source", "fixture:trained", "--out", str(out), "-q"],
        cwd=REPO, check=True, capture_output=True,
    )  # fmt: skip
    src_dir = write_trained(work / "trained")
    src, mod = DirWeights(src_dir), DirWeights(out)
    text = (REPO / "buildkit" / "data" / "calibration.txt").read_text()
    tokens = heldout_tokens(text, 5, src.tokenizer_json(), 1024)
    rows = []
    (fig, (ts, tm)), w, c = clock(ev.evaluate, src, mod, tokens, 128, head=False)
    rows.append(("trunk figures, both models (eval's existing pass)", w, c))
    _, w, c = clock(lambda: (ev.head_hits(src, ts), ev.head_hits(mod, tm)))
    rows.append(("depth-1 acceptance by `evaluate.head_hits`, both heads", w, c))
    for depth in (1, 3):
        _, w, c = clock(drafting.figures, src, mod, ts, tm, tokens, depth, 1.66)
        rows.append((f"drafting.figures depth {depth}, both heads", w, c))
    p = speculative.SpeculativeParams()
    prompts = speculative.decode_prompts(
        src.tokenizer_json(), speculative.prompt_ids(tokens, p.prompts, p.prompt_tokens)
    )
    s, w, c = clock(speculative.run, out, prompts, 3, p)
    rows.append(("mlx_vlm speculative run, defaults (float32 1..3 drafts + bf16)", w, c))
    print(json.dumps({k: s[k] for k in ("tokens_per_round", "wall_ratio_cpu", "lossless")}))
    return rows


def real_shapes() -> list[tuple[str, float, float]]:
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.models.qwen3_5 import DecoderLayer, TextModelArgs

    args = TextModelArgs(
        model_type="qwen3_5_moe_text", hidden_size=2048, num_hidden_layers=1,
        intermediate_size=512, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
        rms_norm_eps=1e-6, vocab_size=248320, linear_num_value_heads=32,
        linear_num_key_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, full_attention_interval=1, num_experts=256,
        num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        rope_theta=1e7, partial_rotary_factor=0.25, max_position_embeddings=262144,
    )  # fmt: skip
    layer = DecoderLayer(args, 0)
    nn.quantize(
        layer,
        class_predicate=lambda p, m: (
            hasattr(m, "to_quantized")
            and ("switch_mlp" in p or "self_attn" in p)
            and {"bits": 6 if "switch_mlp" in p else 8, "group_size": 64}
        ),
    )
    layer.set_dtype(mx.float32)
    mx.eval(layer.parameters())
    x = mx.random.normal((1, 127, 2048))
    rows = []

    def run_layer():
        mx.eval(layer(x, mask="causal", cache=None))

    for _ in range(2):  # the first run pays for the kernels' set-up
        _, w, c = clock(run_layer)
    rows.append(("real shapes: one head layer pass, 127 positions", w, c))
    layer = None
    head = mx.random.normal((248320, 2048)) * 0.02
    mx.eval(head)

    def run_head():
        mx.eval(mx.argmax(x @ head.T, axis=-1))

    for _ in range(2):
        _, w, c = clock(run_head)
    rows.append(("real shapes: output head + argmax, 127 positions, float32", w, c))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=str(REPO / "build" / "spec-bench"))
    ap.add_argument("--real-shapes", action="store_true")
    args = ap.parse_args()
    work = Path(args.dir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        rows = real_shapes() if args.real_shapes else fixture(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("| what | wall s | CPU s |\n|---|---|---|")
    for what, w, c in rows:
        print(f"| {what} | {w:.2f} | {c:.2f} |")


if __name__ == "__main__":
    main()
