"""Quality against mlx_lm's calibrated quantizers (issue 28; not in CI).

On a trained fixture (``buildkit fixture --trained [NAME]``; ``--fixture NAME``), each method
quantizes the routed experts to 4 bits, group size 64 (``oq`` and ``dynamic_quant``: their own
allocation at the same size); every output directory is then graded the same way, by
``buildkit eval DIR --source SRC --text TEXT`` (KL divergence against bf16 on the text's held-out
lines, every 5th). Calibration for every method is the same text's other lines (calibration's
split, ``calibration.split_lines``), tokenized with the source's tokenizer, in sequences of 128
tokens (calibrate's ``seq_len``). The text defaults to the trained fixture's own held-out verses
(``heldout.txt`` beside its weights; never trained on), so calibration and grading are in the
fixture's domain and disjoint from each other. ``--calib-text`` calibrates on another text's
lines instead (out of domain: ``buildkit/data/calibration.txt``); ``--calib-tokens N`` calibrates
the experts (and trains dwq) on its first N tokens only, e.g. the fixture's tokens for the real
model's routed rows per input (``buildkit.fixtures.trained.calibration_tokens``); the KL
sensitivities of dynamic_quant and oq keep every token (they measure the model, not the
experts' inputs).

Methods (each a child process under ``/usr/bin/time -v``: wall, CPU, peak RSS):

- ``xl-4bit``: buildkit, xl with 4-bit routed experts, data-agnostic (mx.quantize) - the
  baseline; a full cold build (calibrate-free), verify, eval and publish included.
- ``oq4e``: buildkit, the same with ``calibrated = true`` (oq4e's data-aware search), cold build.
- ``buildkit-gptq``: buildkit, the same with ``method = "gptq"`` (buildkit/quant/gptq.py: a
  Hessian per expert) and calibrate's ``keep_inputs``; verify's 4-bit rel-L1 line raised to 0.2
  (GPTQ moves weights to lower the output error).
- ``oq``: buildkit's ``oq`` manifest (one budget over every quantizable role, bf16 a candidate,
  data-aware experts) at ``target_bpw`` = xl-4bit's quantize step's bits per weight: equal size.
- ``oq@dq``: the same at dynamic_quant's size (run after it), where dynamic_quant's threshold
  search, whose candidates are whole layers at 4 or 8 bits, lands away from the target.
- ``mlx_lm.<tool>`` as a user runs it: ``mlx_lm.<tool> --model SRC --mlx-path OUT``; each
  refuses here (the exact error is recorded): gptq, dynamic_quant and dwq download their
  calibration data (no network, and no option for a local file), awq has no qwen3_5_moe config.
- ``gptq``: mlx_lm's ``gptq_quantize`` called with our calibration tokens, on the bf16 model cast
  to float32 (mlx on CPU has no bf16 gather_mm). Two outputs: the tool's own layout (every
  Linear and SwitchLinear 4-bit GPTQ, embeddings 6-bit), and ``gptq-experts``: its routed-expert
  tensors put in place of xl-4bit's, so everything else is byte-identical (equal size).
- ``dynamic_quant``: mlx_lm's sensitivity estimate (low 4 / high 8 bits, g64) on our tokens and
  its threshold search at xl-4bit's bits per weight as mlx_lm counts them, then quantize_model:
  equal size, the tool's own allocation over all layers.
- ``dwq``: mlx_lm's ``dwq_quantize`` distilling xl-4bit (the student; equal size by
  construction) from the bf16 teacher on our tokens, ``--dwq-epochs`` passes at ``--dwq-lr``.

Usage (from the repository root, with buildkit importable)::

    python bench/peers.py                       # all methods; work files in /tmp/buildkit-peers
    python bench/peers.py --only xl-4bit,gptq   # some of them
    python bench/peers.py --text buildkit/data/calibration.txt   # another text
    python bench/peers.py --fixture austen --calib-tokens 96 --work /tmp/peers-austen
    python bench/peers.py --fixture austen --calib-text buildkit/data/calibration.txt

It prints a Markdown table (bench/RESULTS.md, "Against mlx_lm's quantizers") and writes
``peers.json`` in the work directory; results of methods not rerun are kept from earlier runs in
the same directory. After the runs, every graded output is compared with xl-4bit position by
position (KLD ratio, 90% block-bootstrap interval; also against dynamic_quant when it ran) and
by held-out expert output error.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
TEXT = REPO / "buildkit" / "data" / "trained" / "heldout.txt"
SEQ_LEN, HELDOUT_EVERY, BITS, GROUP = 128, 5, 4, 64
SWITCH = ".mlp.switch_mlp."
TOOLS = ("gptq", "awq", "dynamic_quant", "dwq")
METHODS = (
    "xl-4bit",
    "oq4e",
    "buildkit-gptq",
    "oq",
    *(f"mlx_lm.{t}" for t in TOOLS),
    "gptq",
    "dynamic_quant",
    "oq@dq",
    "dwq",
)

BUILDS = {
    "xl-4bit": "xl-4bit",
    "oq4e": "oq4e-xl",
    "buildkit-gptq": "gptq-xl",
    "oq": "oq-eq",
    "oq@dq": "oq-dq",
}
MANIFESTS = {
    "xl-4bit": 'extends = "xl"\ndescription = "xl, 4-bit routed experts"\n'
    "[recipe.roles]\nrouted_expert = { bits = 4, group_size = 64 }\n",
    "oq4e-xl": 'extends = "xl"\ndescription = "xl, data-aware 4-bit routed experts"\n'
    "[recipe.roles]\nrouted_expert = { bits = 4, group_size = 64, calibrated = true }\n"
    '[steps.calibrate]\nkind = "calibrate"\ninputs = { model = "sanitize:model" }\n'
    'params.text = "{text}"\n{calib}[steps.quantize]\ninputs = { calibration = "calibrate" }\n',
    "gptq-xl": 'extends = "xl"\ndescription = "xl, 4-bit routed experts by per-expert GPTQ"\n'
    "[recipe.roles]\nrouted_expert = "
    '{ bits = 4, group_size = 64, calibrated = true, method = "gptq" }\n'
    '[steps.calibrate]\nkind = "calibrate"\ninputs = { model = "sanitize:model" }\n'
    'params.text = "{text}"\nparams.keep_inputs = true\n{calib}'
    '[steps.quantize]\ninputs = { calibration = "calibrate" }\n'
    # GPTQ moves weights to lower the output error: per-weight rel-L1 rises (0.135 mean, 0.173
    # max at 4 bits on the trained fixture against verify's 0.16 line)
    "[steps.verify]\nparams.max_rel_l1 = "
    '{ "2" = 0.6, "3" = 0.3, "4" = 0.2, "5" = 0.08, "6" = 0.045, "8" = 0.012 }\n',
}


# ---- running and measuring ---------------------------------------------------------------


def timed(argv: list[str], log: Path, timeout: float | None = None) -> dict:
    """Run argv under /usr/bin/time -v; its exit code, wall, CPU (user + sys), peak RSS and the
    last line of its stderr (a refusal's error)."""
    env = os.environ | {"PYTHONPATH": str(REPO), "TQDM_DISABLE": "1"}
    try:
        p = subprocess.run(
            ["/usr/bin/time", "-v", *argv],
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return {"rc": "timeout", "error": f"no result in {timeout:.0f} s"}
    log.write_text(p.stdout + p.stderr)
    err = p.stderr.split("\tCommand being timed")[0]
    h, m, s = (
        float(x or 0)
        for x in re.search(
            r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (?:(\d+):)?(\d+):([\d.]+)", p.stderr
        ).groups()
    )
    lines = [
        ln
        for ln in err.splitlines()
        if ln.strip() and "it/s]" not in ln and not ln.startswith("Command exited")
    ]
    return {
        "rc": p.returncode,
        "wall_s": round(h * 3600 + m * 60 + s, 2),
        "cpu_s": round(
            sum(
                float(re.search(rf"{k} time \(seconds\): ([\d.]+)", p.stderr)[1])
                for k in ("User", "System")
            ),
            2,
        ),
        "peak_rss_mb": round(
            int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", p.stderr)[1]) / 1024
        ),
        "error": lines[-1] if p.returncode and lines else None,
        "stdout": p.stdout,
    }


def trunk_size(model_dir: Path, source: Path) -> dict:
    """Bytes of the language model's tensors (no vision tower, no MTP head: what mlx_lm loads)
    and bits per weight over the bf16 source's trunk weights, from safetensors headers."""
    from buildkit.formats.tensors import read_header

    def tensors(d: Path):
        for f in sorted(d.glob("*.safetensors")):
            yield from read_header(f).tensors.items()

    def trunk(name: str) -> bool:
        return "visual" not in name and "vision_tower" not in name and "mtp." not in name

    stored = sum(i.nbytes for n, i in tensors(model_dir) if trunk(n))
    weights = sum(i.nbytes // 2 for n, i in tensors(source) if trunk(n))  # bf16: 2 bytes each
    return {"bytes": stored, "bpw": round(8 * stored / weights, 4)}


def fresh(*dirs: Path) -> None:
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)


def grade(model_dir: Path, source: Path, text: Path, log: Path) -> dict:
    argv = [sys.executable, "-m", "buildkit.cli", "eval", str(model_dir), "--source", str(source)]
    r = timed([*argv, "--text", str(text), "--json"], log)
    if r["rc"]:
        raise SystemExit(f"eval of {model_dir} failed: {r['error']} (see {log})")
    return json.loads(r["stdout"])


def per_position_kl(source: Path, dirs: dict[str, Path], text: Path) -> dict:
    """KL(p_source || p_model) at every graded position, per model directory: eval's own
    numerics (buildkit.grade.evaluate), kept per position so methods can be compared paired."""
    from buildkit.grade import evaluate as ev
    from buildkit.grade import forward as fw
    from buildkit.grade import reference as rf
    from buildkit.grade import texts
    from buildkit.grade.weights import DirWeights
    from buildkit.steps.reference import ReferenceParams

    p = ReferenceParams()
    src = DirWeights(source)
    tokens = texts.heldout_tokens(
        texts.read(text), p.heldout_every, src.tokenizer_json(), p.max_tokens
    )
    ref = rf.compute(src, *rf.layout({"": tokens}, p.seq_len))
    out = {}
    for label, d in dirs.items():
        w = DirWeights(d)
        f = ev.position_figures(src, w, ref, fw.run_trunk(w, ref.windows))
        out[label] = f["kl"].astype(np.float64)
    return out


def expert_output_error(source: Path, dirs: dict[str, Path], text: Path) -> dict[str, float]:
    """Mean over experts of ||y_q - y|| / ||y|| on the held-out tokens routed to each (y: the
    bf16 expert's SwiGLU output), for directories whose routed experts are 4-bit g64: what each
    quantizer minimises, before the rest of the model sees it."""
    import mlx.core as mx
    import mlx.nn as nn

    from buildkit.formats.checkpoint import PROJS
    from buildkit.grade import calibration as cal
    from buildkit.grade import texts
    from buildkit.steps.reference import ReferenceParams

    model = load_f32(source)[0]
    _, held = texts.split_lines(texts.read(text), HELDOUT_EVERY)
    ids = texts.tokenize(
        (source / "tokenizer.json").read_bytes(), held, ReferenceParams().max_tokens
    )
    seen, ref = {}, {}

    class Tap(nn.Module):  # records what the router sent where, then runs the experts
        def __init__(self, inner, i):
            super().__init__()
            self.inner, self.i = inner, i

        def __call__(self, x, indices):
            seen[self.i] = (np.array(x.reshape(-1, x.shape[-1])), np.array(indices))
            return self.inner(x, indices)

    for i, layer in enumerate(model.language_model.model.layers):
        sw = layer.mlp.switch_mlp
        ref[i] = {p: np.array(getattr(sw, p).weight) for p in PROJS}
        layer.mlp.switch_mlp = Tap(sw, i)
    mx.eval(model(mx.array([ids])))
    out = {}
    for label, d in dirs.items():
        t = {k: v for f in sorted(d.glob("*.safetensors")) for k, v in mx.load(str(f)).items()}
        errs = []
        for i, (x, idx) in seen.items():
            idx = idx.reshape(len(x), -1)
            sw = f"language_model.model.layers.{i}.mlp.switch_mlp."
            k = [sw + p for p in PROJS]
            if any(
                n + ".scales" not in t
                or t[n + ".weight"].shape[-1] * 32 != BITS * GROUP * t[n + ".scales"].shape[-1]
                for n in k
            ):
                break  # not 4-bit g64 experts (dynamic_quant's are 8-bit)
            w = [
                np.array(
                    mx.dequantize(t[n + ".weight"], t[n + ".scales"], t[n + ".biases"]).astype(
                        mx.float32
                    )
                )
                for n in k
            ]
            if any(v.shape != ref[i][p].shape for v, p in zip(w, PROJS, strict=True)):
                break
            for e in range(len(w[0])):
                rows = x[(idx == e).any(-1)]
                if len(rows):
                    y = cal.expert_outputs(rows, *(ref[i][p][e] for p in PROJS))
                    yq = cal.expert_outputs(rows, *(v[e] for v in w))
                    errs.append(np.linalg.norm(yq - y) / np.linalg.norm(y))
        else:
            out[label] = float(np.mean(errs))
    return out


def ratio_interval(kl: np.ndarray, base: np.ndarray, block: int = 16, n: int = 4000) -> tuple:
    """KLD mean ratio to a baseline on the same positions, with a 90% block-bootstrap interval
    (blocks of ``block`` consecutive positions: neighbouring positions are not independent)."""
    rng = np.random.default_rng(0)
    m = len(kl) // block * block
    a, b = kl[:m].reshape(-1, block).sum(1), base[:m].reshape(-1, block).sum(1)
    pick = rng.integers(0, len(a), (n, len(a)))
    r = a[pick].sum(1) / b[pick].sum(1)
    return kl.mean() / base.mean(), *np.percentile(r, [5, 95])


# ---- the mlx_lm drivers (run as child processes: `peers.py _gptq ...`) ------------------------


CALIB_TOKENS = 0  # --calib-tokens, passed to the drivers: the first N calibration tokens only


def calibration_tokens(source: Path, text: Path, seq_len: int) -> list[list[int]]:
    """The calibration split of the text (its first ``CALIB_TOKENS`` tokens, if set) in whole
    sequences of ``seq_len`` tokens, or of all of them if they are fewer."""
    from buildkit.grade import texts

    calib, _ = texts.split_lines(texts.read(text), HELDOUT_EVERY)
    ids = texts.tokenize((source / "tokenizer.json").read_bytes(), calib, CALIB_TOKENS or 1 << 20)
    seq_len = min(seq_len, len(ids))
    n = len(ids) // seq_len
    return [ids[i * seq_len : (i + 1) * seq_len] for i in range(n)]


def load_f32(source: Path):
    """The bf16 model through mlx_lm.load, cast to float32: mlx's CPU gather_mm is float32 only
    (``[GatherMM::eval] Currently only supports float32.`` in bf16)."""
    import mlx.core as mx
    from mlx_lm.utils import load

    model, tok, config = load(str(source), lazy=True, return_config=True)
    model.set_dtype(mx.float32)
    return model, tok, config


def splice_experts(base: Path, out: Path, experts: dict) -> None:
    """A copy of ``base`` with its routed-expert tensors replaced (same names, shapes, dtypes)."""
    import mlx.core as mx

    shutil.copytree(base, out)
    for f in sorted(out.glob("*.safetensors")):
        tensors = mx.load(str(f))
        hits = {k: experts[k] for k in tensors if k in experts}
        for k, v in hits.items():
            if v.shape != tensors[k].shape or v.dtype != tensors[k].dtype:
                raise SystemExit(f"{k}: {v.shape} {v.dtype} against {tensors[k].shape}")
        if hits:
            mx.save_safetensors(str(f), tensors | hits, metadata={"format": "mlx"})
    missing = set(experts) - {k for f in out.glob("*.safetensors") for k in mx.load(str(f))}
    if missing:
        raise SystemExit(f"not in {base}: {sorted(missing)[:3]}")


def drive_gptq(source: Path, text: Path, base: Path, out: Path) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.quant.gptq import gptq_quantize
    from mlx_lm.utils import compute_bits_per_weight, save

    mx.random.seed(123)
    model, tok, config = load_f32(source)
    data = mx.array(calibration_tokens(source, text, SEQ_LEN))
    model, config["quantization"] = gptq_quantize(model, data, BITS, GROUP, 6, GROUP)
    model.set_dtype(mx.bfloat16)  # as the tool leaves a bf16 model: scales and biases bf16
    experts = {k: v for k, v in tree_flatten(model.parameters()) if SWITCH in k}
    mx.eval(experts)
    print(f"mlx_lm bits per weight {compute_bits_per_weight(model):.4f}")
    splice_experts(base, out.with_name(out.name + "-experts"), experts)
    save(out, source, model, tok, config)


def drive_dynamic(source: Path, text: Path, base: Path, out: Path) -> None:
    import mlx.core as mx
    from mlx_lm.quant.dynamic_quant import estimate_sensitivities, estimate_threshold
    from mlx_lm.utils import compute_bits_per_weight, load, quantize_model, save

    low, high = (BITS, GROUP), (8, GROUP)
    target = compute_bits_per_weight(load(str(base), lazy=True)[0])  # xl-4bit's, as mlx_lm counts
    mx.random.seed(123)
    model, tok, config = load_f32(source)
    data = mx.array(calibration_tokens(source, text, SEQ_LEN))
    sens = dict(estimate_sensitivities(model, data, *low, *high))
    model.set_dtype(mx.bfloat16)  # back to the source's bf16 (lossless) before quantizing
    threshold = estimate_threshold(model, sens, target, *low, *high)

    def predicate(p, m):
        if not hasattr(m, "to_quantized"):
            return False
        return {"bits": high[0], "group_size": high[1]} if sens[p] > threshold else True

    model, config = quantize_model(
        model, config, group_size=GROUP, bits=BITS, quant_predicate=predicate
    )
    high_layers = sorted(p for p, s in sens.items() if s > threshold)
    print(f"target {target:.4f}, got {compute_bits_per_weight(model):.4f} bits per weight")
    print(f"{len(high_layers)} of {len(sens)} layers at {high[0]} bits: {high_layers}")
    save(out, source, model, tok, config)


def drive_dwq(source: Path, text: Path, base: Path, out: Path, epochs: int, lr: float) -> None:
    import mlx.core as mx
    import mlx.optimizers as optimizers
    from mlx_lm.quant.dwq import dwq_quantize
    from mlx_lm.utils import load, save

    mx.random.seed(123)
    teacher = load_f32(source)[0]
    student, tok, config = load(str(base), lazy=True, return_config=True)
    # dwq drops one token a sequence; with few tokens (--calib-tokens), shorter sequences so
    # that there are at least 6: 5 to train on, 1 to validate
    length = SEQ_LEN + 1
    if CALIB_TOKENS and CALIB_TOKENS < 6 * length:
        length = max(9, CALIB_TOKENS // 6)
    seqs = [(s, 0) for s in calibration_tokens(source, text, length)]
    k = 4 if len(seqs) >= 12 else 1
    train, valid = seqs[:-k] * epochs, seqs[-k:]  # dwq's validation: calibration lines too
    opt = optimizers.Adam(learning_rate=lr, bias_correction=True)
    # float32 while it trains (mlx's CPU GatherMM, in the backward pass, is float32 only), then
    # bf16 again: the scales and biases stored as xl-4bit stores them, at its size
    student.set_dtype(mx.float32)
    dwq_quantize(student, lambda b, i, split: teacher(b), opt, train, valid, k, length, seed=123)
    student.set_dtype(mx.bfloat16)
    save(out, source, student, tok, config)


# ---- the whole comparison ---------------------------------------------------------------


def oq_manifest(xl4_store: Path, calib_text: Path, calib_tokens: int, smaller: int = 0) -> str:
    """``oq`` at xl-4bit's bits per weight (its quantize step's, vision tower included: the
    same count as oq's budget), or ``smaller`` bytes under it; calibrated on the same text and
    tokens as the others; its sensitivity measured on that text's calibration lines as shipped
    (2048 tokens at most)."""
    from buildkit.store.store import Store

    store = Store(xl4_store)
    quant = store.get_artifact(store.get_ref("xl-4bit")["nodes"]["quantize"]["outputs"]["out"])
    weights = sum(r["params"] for r in quant.meta["role_table"].values())
    target = quant.meta["bits_per_weight"] - 8 * smaller / weights
    limit = f"params.max_tokens = {calib_tokens}\n" if calib_tokens else ""
    return (
        'extends = "oq"\ndescription = "oq at a given size"\n'
        f"[recipe]\ntarget_bpw = {target:.6f}\n"
        f'[steps.calibrate]\nparams.text = "{calib_text}"\n{limit}'
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="/tmp/buildkit-peers")
    ap.add_argument("--fixture", help="a trained fixture by name (buildkit.trained.FIXTURES)")
    ap.add_argument("--text", help="eval text (its held-out lines); default the fixture's own")
    ap.add_argument("--calib-text", help="calibration text (its other lines); default --text")
    ap.add_argument(
        "--calib-tokens", type=int, default=0, help="calibrate on the first N tokens only"
    )
    ap.add_argument("--only", help=f"comma-separated: {','.join(METHODS)}")
    ap.add_argument("--dwq-epochs", type=int, default=8)
    ap.add_argument("--dwq-lr", type=float, default=1e-5)
    ap.add_argument("--cli-timeout", type=float, default=600, help="for the mlx_lm.* commands")
    args = ap.parse_args()
    from buildkit.fixtures.trained import get, write_trained

    fixture = get(args.fixture)
    work = Path(args.work).resolve()
    text = Path(args.text or fixture.data / "heldout.txt").resolve()
    calib_text = Path(args.calib_text).resolve() if args.calib_text else text
    only = args.only.split(",") if args.only else list(METHODS)
    work.mkdir(parents=True, exist_ok=True)
    src, out, logs = work / "src", work / "out", work / "logs"
    out.mkdir(exist_ok=True)
    logs.mkdir(exist_ok=True)
    if not src.exists():
        write_trained(src, fixture.data, spec=fixture.spec)
    proj = work / "project"
    shutil.rmtree(proj / "manifests", ignore_errors=True)
    shutil.copytree(REPO / "manifests", proj / "manifests", ignore=shutil.ignore_patterns("*.lock"))
    calib = f"params.max_tokens = {args.calib_tokens}\n" if args.calib_tokens else ""
    for name, body in MANIFESTS.items():
        body = body.replace("{text}", str(calib_text)).replace("{calib}", calib)
        (proj / "manifests" / f"{name}.toml").write_text(body)
    results_path = work / "peers.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    py = sys.executable
    me = str(Path(__file__).resolve())
    base = out / "xl-4bit"

    def buildkit(variant: str, dest: Path) -> list[str]:
        m = ["--store", str(proj / f"store-{variant}"), "--manifests", str(proj / "manifests")]
        return [py, "-m", "buildkit.cli", *m, "build", variant, "--source", str(src)] + [
            "--out",
            str(dest),
        ]

    plan = {
        "xl-4bit": ([buildkit("xl-4bit", base)], [("xl-4bit", base)]),
        "oq4e": ([buildkit("oq4e-xl", out / "oq4e")], [("oq4e", out / "oq4e")]),
        "buildkit-gptq": (
            [buildkit("gptq-xl", out / "buildkit-gptq")],
            [("buildkit-gptq", out / "buildkit-gptq")],
        ),
        "oq": ([buildkit("oq-eq", out / "oq")], [("oq", out / "oq")]),
        "oq@dq": (
            [buildkit("oq-dq", out / "oq-dq")],
            [("oq at dynamic_quant's size", out / "oq-dq")],
        ),
        "gptq": (
            [[py, me, "_gptq", str(src), str(calib_text), str(base), str(out / "gptq")]],
            [("gptq (tool's layout)", out / "gptq"), ("gptq-experts", out / "gptq-experts")],
        ),
        "dynamic_quant": (
            [[py, me, "_dynamic", str(src), str(calib_text), str(base), str(out / "dynamic")]],
            [("dynamic_quant", out / "dynamic")],
        ),
        "dwq": (
            [
                [py, me, "_dwq", str(src), str(calib_text), str(base), str(out / "dwq")]
                + [str(args.dwq_epochs), str(args.dwq_lr)]
            ],
            [("dwq", out / "dwq")],
        ),
    }
    for tool in TOOLS:
        # the console script a user runs (awq.py and dwq.py have no __main__ guard: -m is a no-op)
        cli = [str(Path(py).parent / f"mlx_lm.{tool}"), "--model", str(src)]
        plan[f"mlx_lm.{tool}"] = ([cli + ["--mlx-path", str(out / f"cli-{tool}")]], [])
    # --calib-tokens limits what the experts are calibrated (or dwq trained) on; the KL
    # sensitivities of dynamic_quant and oq measure the model, so they keep every token
    for m in ("gptq", "dynamic_quant", "dwq"):
        limit = 0 if m == "dynamic_quant" else args.calib_tokens
        plan[m][0][0][7:7] = [str(limit)]  # after the four paths
    for method in only:
        argvs, outputs = plan[method]
        if method in ("gptq", "dynamic_quant", "dwq", "oq") and not base.exists():
            raise SystemExit("run xl-4bit first: the mlx_lm drivers and oq start from its output")
        if method == "oq":  # the whole-model budget at xl-4bit's bits per weight
            (proj / "manifests" / "oq-eq.toml").write_text(
                oq_manifest(proj / "store-xl-4bit", calib_text, args.calib_tokens)
            )
        if method == "oq@dq":  # ... and at dynamic_quant's, where its threshold fell short
            dq, xl4 = (results[m]["outputs"][m]["bytes"] for m in ("dynamic_quant", "xl-4bit"))
            (proj / "manifests" / "oq-dq.toml").write_text(
                oq_manifest(proj / "store-xl-4bit", calib_text, args.calib_tokens, xl4 - dq)
            )
        # cold: no store, no earlier output
        fresh(*(d for _, d in outputs), out / f"cli-{method.removeprefix('mlx_lm.')}")
        if method in BUILDS:
            fresh(proj / f"store-{BUILDS[method]}")
        print(f"[{method}] running", file=sys.stderr, flush=True)
        limit = args.cli_timeout if method.startswith("mlx_lm.") else None
        r = timed(argvs[0], logs / f"{method}.log", limit)
        r.pop("stdout", None)
        r["load_avg"] = round(os.getloadavg()[0], 2)
        results[method] = {"run": r, "outputs": {}}
        if r["rc"]:
            print(f"[{method}] exited {r['rc']}: {r['error']}", file=sys.stderr)
            continue
        for label, d in outputs:
            fig = grade(d, src, text, logs / f"{method}-eval.log") | trunk_size(d, src)
            results[method]["outputs"][label] = fig
            print(f"[{method}] {label}: {json.dumps(fig)}", file=sys.stderr)
        results_path.write_text(json.dumps(results, indent=2, sort_keys=True))
    # paired: every graded output against xl-4bit, position by position
    dirs = {
        label: d
        for method, (_, outputs) in plan.items()
        if method in results and not results[method]["run"]["rc"]
        for label, d in outputs
        if d.exists()
    }
    if "xl-4bit" in dirs:
        kl = per_position_kl(src, dirs, text)
        experr = expert_output_error(src, dirs, text)
        for method in results:
            for label, fig in results[method]["outputs"].items():
                if label in kl:
                    r, lo, hi = ratio_interval(kl[label], kl["xl-4bit"])
                    fig["kld_ratio_to_xl_4bit"] = [round(float(x), 3) for x in (r, lo, hi)]
                    if "dynamic_quant" in kl:  # the target for oq: <= 0.9 of it, in domain
                        r, lo, hi = ratio_interval(kl[label], kl["dynamic_quant"])
                        fig["kld_ratio_to_dynamic_quant"] = [
                            round(float(x), 3) for x in (r, lo, hi)
                        ]
                if label in experr:
                    fig["expert_output_error"] = round(experr[label], 4)
    results_path.write_text(json.dumps(results, indent=2, sort_keys=True))
    print(table(results))


def table(results: dict) -> str:
    rows = [
        "| method | ran? | bpw | bytes | KLD mean | ÷ xl-4bit (90% interval) "
        "| ÷ dynamic_quant (90% interval) | KLD p99 | top-1 | expert error | wall | CPU "
        "| peak RSS |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for method in METHODS:
        if method not in results:
            continue
        r = results[method]["run"]
        t = f"{r.get('wall_s', '-')} s | {r.get('cpu_s', '-')} s | {r.get('peak_rss_mb', '-')} MB"
        if r["rc"]:
            rows.append(f"| {method} | refused: `{r['error']}` | | | | | | | | | {t} |")
        for label, f in results[method]["outputs"].items():
            ratio, dq = (
                f"{r[0]:.2f} ({r[1]:.2f}-{r[2]:.2f})" if r else ""
                for r in (f.get("kld_ratio_to_xl_4bit"), f.get("kld_ratio_to_dynamic_quant"))
            )
            rows.append(
                f"| {label} | ran | {f['bpw']:.3f} | {f['bytes']:,} | {f['kld_mean']:.5f} | "
                f"{ratio} | {dq} | {f['kld_p99']:.4f} | {100 * f['top1_agreement']:.1f}% | "
                f"{f.get('expert_output_error', '')} | {t} |"
            )
    return "\n".join(rows)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1].startswith("_"):
        verb, *rest = sys.argv[1:]
        paths = [Path(a) for a in rest[:4]]
        CALIB_TOKENS = int(rest[4])
        if verb == "_gptq":
            drive_gptq(*paths)
        elif verb == "_dynamic":
            drive_dynamic(*paths)
        elif verb == "_dwq":
            drive_dwq(*paths, int(rest[5]), float(rest[6]))
        else:
            raise SystemExit(f"unknown verb {verb}")
    else:
        main()
