"""Wall time and peak RSS of the eval step, and of ``buildkit eval``, on a larger fixture.

Generates a fixture checkpoint, builds ``xl-bench`` (xl, with eval's ``max_tokens`` from
``--max-tokens``) up to ``quantize`` (untimed), then under
``/usr/bin/time -v``: the eval step alone (``build xl --target eval``, a cold store entry), and
``buildkit eval`` of the published directory against the source directory. Prints a Markdown
table with the model's size and its largest decoder layer, the figure peak RSS should track
(one layer in memory at a time, widened to float32), and the figures measured.

Usage::

    python bench/eval_bench.py                       # hidden 512, 8 layers, 32 experts
    python bench/eval_bench.py --hidden 1024 --experts 64 --max-tokens 512
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def timed(argv: list[str], cwd: Path) -> tuple[float, float, float, str]:
    """(wall seconds, CPU seconds (user + sys), peak RSS MB, stdout) of one command under
    /usr/bin/time -v. The machine is shared: CPU time says what the work cost when wall
    time says how busy the machine was."""
    p = subprocess.run(["/usr/bin/time", "-v", *argv], cwd=cwd, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed:\n{p.stderr[-3000:]}")
    wall = re.search(
        r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (?:(\d+):)?(\d+):([\d.]+)", p.stderr
    )
    h, m, s = (float(x or 0) for x in wall.groups())
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", p.stderr)[1])
    cpu = sum(
        float(re.search(rf"{k} time \(seconds\): ([\d.]+)", p.stderr)[1])
        for k in ("User", "System")
    )
    return h * 3600 + m * 60 + s, cpu, rss / 1024, p.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=str(REPO / "build" / "eval-bench"))
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--moe-intermediate", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--max-tokens", type=int, default=1024)
    args = ap.parse_args()

    from buildkit.fixtures.generated import FixtureSpec, generate
    from buildkit.formats.checkpoint import text_config
    from buildkit.formats.tensors import read_header

    root = Path(args.dir).absolute()
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    spec = FixtureSpec(
        hidden=args.hidden,
        layers=args.layers,
        experts=args.experts,
        moe_intermediate=args.moe_intermediate,
        shared_intermediate=args.moe_intermediate,
        vocab=args.vocab,
        heads=args.hidden // 128,
        kv_heads=2,
        head_dim=128,
        linear_key_heads=args.hidden // 256,
        linear_value_heads=args.hidden // 128,
        linear_key_dim=128,
        linear_value_dim=128,
    )
    src = Path(generate(root / "src", spec))
    shutil.copytree(REPO / "manifests", root / "manifests", ignore=shutil.ignore_patterns("*.lock"))
    (root / "manifests" / "xl-bench.toml").write_text(
        f'extends = "xl"\n[steps.reference]\nparams.max_tokens = {args.max_tokens}\n'
    )
    bk = [
        sys.executable,
        "-m",
        "buildkit.cli",
        "--store",
        str(root / "cache"),
        "--manifests",
        str(root / "manifests"),
    ]
    subprocess.run(
        [*bk, "build", "xl-bench", "--source", str(src), "--target", "quantize", "-q"],
        cwd=root,
        check=True,
    )

    sizes: dict[str, int] = {}
    total = 0
    for f in src.glob("*.safetensors"):
        for name, info in read_header(f).tensors.items():
            total += info.nbytes
            if m := re.match(r"model\.language_model\.layers\.(\d+)\.", name):
                sizes[m[1]] = sizes.get(m[1], 0) + info.nbytes
    layer = max(sizes.values())
    step_wall, step_cpu, step_rss, _ = timed(
        [*bk, "build", "xl-bench", "--source", str(src), "--target", "eval", "-q"], root
    )
    subprocess.run(
        [*bk, "build", "xl-bench", "--source", str(src), "--out", str(root / "out" / "xl"), "-q"],
        cwd=root,
        check=True,
    )
    cli_wall, cli_cpu, cli_rss, out = timed(
        [
            *bk,
            "eval",
            str(root / "out" / "xl"),
            "--source",
            str(src),
            "--json",
            "--max-tokens",
            str(args.max_tokens),
        ],
        root,
    )
    fig = json.loads(out)
    cfg = text_config(json.loads((src / "config.json").read_text()))
    print(
        f"fixture: hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers, "
        f"{cfg['num_experts']} experts, vocab {cfg['vocab_size']}; "
        f"source {total / 1e6:.0f} MB bf16, largest decoder layer {layer / 1e6:.0f} MB "
        f"bf16 ({2 * layer / 1e6:.0f} MB as float32); {fig['tokens']} tokens"
    )
    print("| run | wall | CPU (user + sys) | peak RSS |\n|---|---|---|---|")
    print(
        "| eval step (`build xl-bench --target eval`, quantized beforehand) | "
        f"{step_wall:.1f} s | {step_cpu:.1f} s | {step_rss:.0f} MB |"
    )
    print(
        f"| `buildkit eval out/xl --source DIR` | {cli_wall:.1f} s | {cli_cpu:.1f} s | "
        f"{cli_rss:.0f} MB |"
    )
    print(
        f"figures: kld_mean {fig['kld_mean']:.5f}, kld_p99 {fig['kld_p99']:.5f}, "
        f"top-1 {fig['top1_agreement']:.4f}, "
        f"ppl {fig['ppl_model']:.2f} (bf16 {fig['ppl_source']:.2f})"
    )


if __name__ == "__main__":
    main()
