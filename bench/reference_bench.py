"""The bf16 reference shared: a second variant's eval against xl's (reference + eval).

Builds, in one store, xl up to its eval (fetch, sanitize, quantize, reference, eval), then
xl-mtp's eval_head (its eval is xl's node), xl-3bit's eval and, with ``--oq4e``, oq4e-mtp-xl's
eval (its calibrate and GPTQ first: hours on the 35B shapes), and reads each step's wall time
from the build's own ``[done]`` lines. xl's old eval ran the source's trunk and the model's; a
later variant's eval runs only its model's, against xl's reference: the target is a later
eval <= 0.55 x xl's reference + eval (issue 42). Prints a Markdown table.

Usage::

    python bench/reference_bench.py --source build/35b/src        # a 35B-shaped sparse source
    python bench/reference_bench.py --fixture                      # makes one (72 GB apparent)
    python bench/reference_bench.py --source fixture:trained       # a quick check that it runs
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DONE = re.compile(r"^\[done\]\s+(\S+) \((\w+)\) \w+ in ([\d.]+)s", re.M)


def build(bk: list[str], root: Path, variant: str, target: str, source: str) -> dict[str, float]:
    """Seconds of each step that ran in ``build VARIANT --target TARGET``."""
    argv = [*bk, "build", variant, "--source", source, "--target", target]
    p = subprocess.run(argv, cwd=root, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed:\n{p.stderr[-3000:]}")
    return {name: float(s) for name, _, s in DONE.findall(p.stderr)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=str(REPO / "build" / "reference-bench"))
    ap.add_argument("--source", help="a source directory or spec (default: --fixture's)")
    ap.add_argument(
        "--fixture", action="store_true", help="generate the 35B-shaped sparse source first"
    )
    ap.add_argument("--oq4e", action="store_true", help="also oq4e-mtp-xl's eval (GPTQ: slow)")
    args = ap.parse_args()

    root = Path(args.dir).absolute()
    shutil.rmtree(root / "cache", ignore_errors=True)
    shutil.rmtree(root / "manifests", ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    shutil.copytree(REPO / "manifests", root / "manifests", ignore=shutil.ignore_patterns("*.lock"))
    bk = [sys.executable, "-m", "buildkit.cli", "--store", str(root / "cache"), "--manifests"]
    bk.append(str(root / "manifests"))
    source = args.source
    if args.fixture or not source:
        source = str(root / "src")
        if not (root / "src" / "config.json").is_file():
            fixture = [*bk, "fixture", source, "--preset", "qwen3.6-35b-a3b", "--sparse"]
            subprocess.run(fixture, cwd=root, check=True)

    xl = build(bk, root, "xl", "eval", source)
    runs = [("xl-mtp", "eval_head"), ("xl-3bit", "eval")]
    if args.oq4e:
        runs.append(("oq4e-mtp-xl", "eval"))
    later = {v: build(bk, root, v, t, source) for v, t in runs}
    base = xl["reference"] + xl["eval"]
    print(f"source {source}\n")
    print("| build | step | wall | / xl's reference + eval |\n|---|---|---|---|")
    print(f"| xl | reference | {xl['reference']:.1f} s | {xl['reference'] / base:.2f} |")
    print(f"| xl | eval | {xl['eval']:.1f} s | {xl['eval'] / base:.2f} |")
    for v, steps in later.items():
        for name in ("reference", "reference_domains", "eval", "eval_head"):
            if name in steps:
                print(f"| {v} | {name} | {steps[name]:.1f} s | {steps[name] / base:.2f} |")
    worst = max(steps["eval"] / base for steps in later.values() if "eval" in steps)
    print(f"\nlater evals at most {worst:.2f} x xl's reference + eval (target <= 0.55)")


if __name__ == "__main__":
    main()
