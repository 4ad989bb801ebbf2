"""buildkit's affine kernel (buildkit/quant/affine.py) against mx.quantize on the same block.

Every data-agnostic weight of a build goes through ``affine.like_mx``: the kernel makes
mx.quantize's bytes and verify's error figure in one pass. This times it on an expert-shaped
bf16 block (the real model's routed experts: [experts, 512, 2048], group size 64) at each
bits a recipe uses, against ``mx.quantize`` alone and ``mx.quantize`` then ``qerror``'s sums
(what the kernel replaces), one thread each, best of ``--repeat``; the bytes are checked equal.

    python bench/kernel_bench.py [--experts 16] [--repeat 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from buildkit.formats.tensors import from_mlx, to_float32, to_mlx  # noqa: E402
from buildkit.quant import affine, qerror  # noqa: E402

GROUP = 64


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def mx_quantize(block: np.ndarray, bits: int) -> list:
    q = mx.quantize(to_mlx(block, "BF16"), group_size=GROUP, bits=bits)
    mx.eval(q)
    return [from_mlx(a) for a in q]


def mx_and_sums(block: np.ndarray, bits: int) -> tuple:
    (w, _), (s, sdt), (b, _) = mx_quantize(block, bits)
    return qerror.block_sums(w, to_float32(s, sdt), to_float32(b, sdt), block, bits, GROUP)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=16, help="experts in the block (512 x 2048)")
    ap.add_argument("--bits", default="4,6,8")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    mx.set_default_device(mx.cpu)
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((args.experts, 512, 2048)) * 0.02).astype(np.float32)
    block = (x.view(np.uint32) >> 16).astype(np.uint16)
    n = block.size
    rows = []
    for bits in map(int, args.bits.split(",")):
        parts, sums = affine.quantize(block, bits, GROUP)  # compiled here, not in the timing
        want = mx_quantize(block, bits)
        same = all(np.array_equal(a, b) for (a, _), (b, _) in zip(parts, want, strict=True))
        same = same and sums == mx_and_sums(block, bits)
        t_k = best(lambda b=bits: affine.quantize(block, b, GROUP), args.repeat)
        t_mx = best(lambda b=bits: mx_quantize(block, b), args.repeat)
        t_ms = best(lambda b=bits: mx_and_sums(block, b), args.repeat)
        rows.append(
            {
                "bits": bits,
                "weights": n,
                "kernel_ns": t_k / n * 1e9,
                "mx_quantize_ns": t_mx / n * 1e9,
                "mx_quantize_and_sums_ns": t_ms / n * 1e9,
                "same_bytes_and_sums": same,
            }
        )
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(
        f"{args.experts} x 512 x 2048 bf16 ({n / 1e6:.0f} M weights), group {GROUP}, best of "
        f"{args.repeat}, ns a weight:"
    )
    print("| bits | kernel | mx.quantize | mx.quantize + qerror | kernel / mx.quantize | same |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['bits']} | {r['kernel_ns']:.2f} | {r['mx_quantize_ns']:.2f} | "
            f"{r['mx_quantize_and_sums_ns']:.2f} | {r['kernel_ns'] / r['mx_quantize_ns']:.2f} | "
            f"{'yes' if r['same_bytes_and_sums'] else 'NO'} |"
        )


if __name__ == "__main__":
    main()
