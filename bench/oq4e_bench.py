"""oq4e speed (issue 28; not in CI): calibrate + data-aware search against xl and mx.quantize.

Two measurements, each printed as a table (the machine is shared: read ratios within a run):

1. ``--builds``: cold builds of ``xl`` and ``oq4e-mtp-xl`` from the same generated fixture,
   each in an empty store, one after the other, with their eval steps and without them (what
   the build costs, not its grading); step times from the ``[done]`` lines, and the oq4e/xl
   ratios of wall and CPU time (target: at most 3), with each build's peak RSS. ``--gptq``
   adds oq4e-gptq-mtp-xl (GPTQ experts), without eval steps; should its verify fail, the
   figures are up to the failure and the error is printed.
2. per-tensor microbenchmark (always): one routed-expert tensor [E, out, in] bf16, time per
   weight of ``mx.quantize`` against ``dataaware.search`` on the same tensor (target: search
   at most 2x), and the search's weighted error against data-agnostic.

Usage::

    python bench/oq4e_bench.py                          # microbenchmark only
    python bench/oq4e_bench.py --builds                 # + cold builds on a 4-layer fixture
    python bench/oq4e_bench.py --builds --spec layers=31 # the 2 GB bench fixture's layer count
    python bench/oq4e_bench.py --builds --skip-eval     # only the builds without eval steps
    python bench/oq4e_bench.py --builds --gptq          # + oq4e with GPTQ experts (no eval)
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import buildkit

BUILDKIT_ROOT = Path(buildkit.__file__).resolve().parents[1]
BASE_SPEC = {
    "hidden": 1024,
    "layers": 4,
    "experts": 16,
    "moe_intermediate": 512,
    "vocab": 16384,
    "seed": 0,
}


TIME = "/usr/bin/time"  # GNU time: the build's own CPU seconds and peak RSS, not the bench's


def build(
    variant: str, source: Path, work: Path, may_fail: bool = False
) -> tuple[float, float, int, dict[str, float]]:
    """(wall s, CPU s, peak RSS KiB, {step: wall s}) of one cold build in an empty store; a
    ``-noeval`` variant builds only what publish needs. With ``may_fail``, a failed build's
    figures up to its failure, its error under step ``"failed"``."""
    store = work / f"store-{variant}"
    shutil.rmtree(store, ignore_errors=True)
    argv = [
        TIME,
        "-f",
        "BENCH-TIME %U %S %M",
        sys.executable,
        "-m",
        "buildkit.cli",
        "--store",
        str(store),
        "--manifests",
        str(work / "manifests"),
        "build",
        variant,
        "--source",
        str(source),
        "--out",
        str(work / f"out-{variant}"),
        *(["--target", "publish"] if variant.endswith("-noeval") else []),
    ]
    t = time.perf_counter()
    p = subprocess.run(argv, capture_output=True, text=True, cwd=BUILDKIT_ROOT)
    wall = time.perf_counter() - t
    if p.returncode and not may_fail:
        raise SystemExit(f"{variant} failed:\n{p.stderr}")
    steps = {
        m[1]: float(m[2]) for m in re.finditer(r"^\[done\]\s+(\S+) .* in ([\d.]+)s", p.stderr, re.M)
    }
    if p.returncode:
        steps["failed"] = next(
            (ln for ln in p.stderr.splitlines() if ln.startswith("buildkit: error")), "?"
        )
    user, sys_, rss = re.search(r"^BENCH-TIME (\S+) (\S+) (\d+)", p.stderr, re.M).groups()
    return wall, float(user) + float(sys_), int(rss), steps


def builds(spec: dict, work: Path, with_eval: bool = True, gptq: bool = False) -> None:
    src = work / "fixture"
    argv = [sys.executable, "-m", "buildkit.cli", "fixture", str(src)]
    for k, v in spec.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    if not src.exists():
        subprocess.run(argv, check=True, capture_output=True, cwd=BUILDKIT_ROOT)
    size = sum(f.stat().st_size for f in src.glob("*.safetensors")) / 1e6
    # the donor head must fit the trunk: oq4e-mtp-xl with its donor read from the same fixture
    shutil.copytree(BUILDKIT_ROOT / "manifests", work / "manifests", dirs_exist_ok=True)
    (work / "manifests" / "bench-oq4e.toml").write_text(
        f'extends = "oq4e-mtp-xl"\n[steps.donor_fetch.params]\nsource = "{src}"\n'
    )
    # the same two variants without their grading steps (eval, and the data-agnostic quantize
    # only eval_baseline reads): what it costs to build
    for name, parent in (("bench-xl-noeval", "xl"), ("bench-oq4e-noeval", "bench-oq4e")):
        (work / "manifests" / f"{name}.toml").write_text(
            f'extends = "{parent}"\n[steps.publish]\ninputs = {{ eval = [] }}\n'
        )
    # oq4e-gptq-mtp-xl (GPTQ experts instead of the search), donor and grading as above
    (work / "manifests" / "bench-gptq-noeval.toml").write_text(
        f'extends = "oq4e-gptq-mtp-xl"\n[steps.donor_fetch.params]\nsource = "{src}"\n'
        "[steps.publish]\ninputs = { eval = [] }\n"
    )
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    pairs = {"without eval steps": ("bench-xl-noeval", "bench-oq4e-noeval")}
    if with_eval:
        pairs = {"with eval steps": ("xl", "bench-oq4e"), **pairs}
    runs = {v: build(v, src, work) for pair in pairs.values() for v in pair}
    if gptq:
        runs["bench-gptq-noeval"] = build("bench-gptq-noeval", src, work, may_fail=True)
    print(f"\nfixture {spec} ({size:.0f} MB); load average before: {' '.join(load)}")
    for label, (a, b) in pairs.items():
        print(f"\n{label}, wall s by step\n\n| step | xl | oq4e-mtp-xl |\n|---|---|---|")
        for step in dict.fromkeys([*runs[a][3], *runs[b][3]]):
            print(f"| {step} | {runs[a][3].get(step, '')} | {runs[b][3].get(step, '')} |")
    print("\n| cold build | xl | oq4e-mtp-xl | ratio (target <= 3) |\n|---|---|---|---|")
    for label, (a, b) in pairs.items():
        a, b = runs[a], runs[b]
        print(f"| {label}, wall s | {a[0]:.1f} | {b[0]:.1f} | {b[0] / a[0]:.2f} |")
        print(f"| {label}, CPU s | {a[1]:.1f} | {b[1]:.1f} | {b[1] / a[1]:.2f} |")
        print(f"| {label}, peak RSS MB | {a[2] / 1024:.0f} | {b[2] / 1024:.0f} | |")
    if gptq:
        x, g = runs["bench-xl-noeval"], runs["bench-gptq-noeval"]
        print("\noq4e-gptq-mtp-xl (GPTQ experts), without eval steps, wall s by step\n")
        print("| step | xl | GPTQ |\n|---|---|---|")
        for step in dict.fromkeys([*x[3], *g[3]]):
            if step != "failed":
                print(f"| {step} | {x[3].get(step, '')} | {g[3].get(step, '')} |")
        print(
            f"\n| GPTQ cold build | wall {g[0]:.1f} s ({g[0] / x[0]:.2f} x xl, "
            f"{g[0] / runs['bench-oq4e-noeval'][0]:.2f} x oq4e) | CPU {g[1]:.1f} s "
            f"({g[1] / x[1]:.2f} x xl) | peak RSS {g[2] / 1024:.0f} MB |"
        )
        if "failed" in g[3]:
            print(f"\nGPTQ build failed: {g[3]['failed']}")


def micro(experts: int, out: int, inp: int, bits: int, repeat: int) -> None:
    import mlx.core as mx
    import numpy as np

    from buildkit.formats.tensors import from_mlx, to_float32
    from buildkit.quant import dataaware

    g = 64
    rng = np.random.default_rng(0)
    w = mx.array(rng.standard_normal((experts, out, inp)).astype(np.float32) * inp**-0.5).astype(
        mx.bfloat16
    )
    d = np.exp(rng.standard_normal((experts, inp))).astype(
        np.float32
    )  # heavy-tailed channel importance
    mx.eval(w)
    n = w.size
    q = mx.quantize(w, group_size=g, bits=bits)
    codes = dataaware.unpack(np.array(q[0]), bits).reshape(experts, out, inp // g, g)
    s32, b32 = (to_float32(*from_mlx(a)) for a in q[1:])

    def quantize():
        mx.eval(mx.quantize(w, group_size=g, bits=bits))

    w32 = np.array(w.astype(mx.float32)).reshape(experts, out, inp // g, g)

    def search():
        return [
            dataaware.search(
                w32[e], d[e].reshape(1, inp // g, g), bits, "BF16", (codes[e], s32[e], b32[e])
            )
            for e in range(experts)
        ]

    search()  # numba loads (or first compiles) the search on its first call: not in the figure
    # CPU time, not wall: the machine is shared; both run on one thread (mx.quantize on the CPU
    # is single-threaded, the search too); alternated, so a change in load hits both alike
    best_q = best_s = float("inf")
    for _ in range(repeat):
        t = time.process_time()
        quantize()
        best_q = min(best_q, time.process_time() - t)
        t = time.process_time()
        res = search()
        best_s = min(best_s, time.process_time() - t)
    err = err0 = 0.0
    for e, (qq, ss, bb, _) in enumerate(res):
        de = d[e].reshape(1, inp // g, g)
        err += float((de * np.square(ss[..., None] * qq + bb[..., None] - w32[e])).sum())
        err0 += float(
            (de * np.square(s32[e][..., None] * codes[e] + b32[e][..., None] - w32[e])).sum()
        )
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    print(
        f"\nper tensor [{experts}, {out}, {inp}] {bits}-bit g{g}, CPU time, best of {repeat} "
        f"alternated, load average {load}; search {dataaware.METHOD}, "
        f"{len(dataaware.GRID)} grids, the {dataaware.TOP} best fit again, "
        f"the best {dataaware.REFINE} more time(s)\n"
    )
    print("| | s per million weights | ns per weight | vs mx.quantize |\n|---|---|---|---|")
    print(f"| mx.quantize | {best_q / n * 1e6:.4f} | {best_q / n * 1e9:.2f} | 1.00 |")
    print(
        f"| dataaware.search | {best_s / n * 1e6:.4f} | {best_s / n * 1e9:.2f} | "
        f"{best_s / best_q:.2f} (target <= 2) |"
    )
    print(f"\nweighted error, data-aware / data-agnostic: {err / err0:.4f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--builds", action="store_true", help="also time cold xl and oq4e-mtp-xl builds")
    p.add_argument(
        "--skip-eval", action="store_true", help="with --builds: only the builds without eval steps"
    )
    p.add_argument(
        "--gptq", action="store_true", help="with --builds: also oq4e with GPTQ experts (slow)"
    )
    p.add_argument(
        "--spec", action="append", default=[], help="fixture dimension, e.g. layers=31 (repeatable)"
    )
    p.add_argument(
        "--work", type=Path, help="working directory (default: a temporary one, removed)"
    )
    p.add_argument("--tensor", default="8,512,1024", help="E,out,in of the microbenchmark's tensor")
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument(
        "--grids",
        type=int,
        help="try the search with this many grids over -1..3 (not the shipped setting)",
    )
    p.add_argument(
        "--top",
        type=int,
        help="try the search with this many grids fit again (not the shipped setting)",
    )
    p.add_argument(
        "--refine",
        type=int,
        help="try the search with this many further fits of the best (not the shipped setting)",
    )
    args = p.parse_args(argv)
    from buildkit.quant import dataaware

    if args.grids:
        dataaware.GRID = (
            [-1.0 + 4.0 * i / max(args.grids - 1, 1) for i in range(args.grids)]
            if args.grids > 1
            else [0.0]
        )
    if args.top is not None:
        dataaware.TOP = args.top
    if args.refine is not None:
        dataaware.REFINE = args.refine
    micro(*map(int, args.tensor.split(",")), args.bits, args.repeat)
    if args.builds:
        spec = BASE_SPEC | {k: int(v) for k, v in (s.split("=", 1) for s in args.spec)}
        if args.work:
            args.work.mkdir(parents=True, exist_ok=True)
            builds(spec, args.work, not args.skip_eval, args.gptq)
        else:
            with tempfile.TemporaryDirectory(prefix="oq4e-bench-") as tmp:
                builds(spec, Path(tmp), not args.skip_eval, args.gptq)
    return 0


if __name__ == "__main__":
    sys.exit(main())
