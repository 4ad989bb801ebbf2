"""A bits-per-weight budget against uniform 4-bit experts at the same size, on the trained fixture.

In one fresh project: ``uniform`` (oq4e-mtp-xl: data-aware 4-bit routed experts) up to its
eval; then, at ``target_bpw`` = uniform's bits per weight, ``oq-budget`` with its sensitivity
measured per layer (the default) and per tensor. The sensitivity steps run alone under
``/usr/bin/time -v`` (``--target sensitivity``, cold); the rest is untimed. Prints a Markdown
table: eval's figures (KL on the held-out lines, top-1 agreement), stored bytes against the
budget, each plan's bits, and what measuring cost.

Usage::

    python bench/budget_bench.py [--dir build/budget-bench]
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from eval_bench import timed  # noqa: E402  (one /usr/bin/time -v parser for the benches)

REPO = Path(__file__).resolve().parents[1]
TRAINED = 'source = "fixture:trained"\n[steps.donor_fetch]\nparams.source = "fixture:trained"\n'


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=str(REPO / "build" / "budget-bench"))
    args = ap.parse_args()

    from buildkit.store.store import Store

    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    (root / "manifests").mkdir(parents=True)
    for f in (REPO / "manifests").glob("*.toml"):
        shutil.copy(f, root / "manifests")
    cli = [sys.executable, "-m", "buildkit.cli", "--store", "cache", "--manifests", "manifests"]

    def write(name: str, text: str) -> None:
        (root / "manifests" / f"{name}.toml").write_text(text)

    def node(variant: str, name: str):
        store = Store(root / "cache")
        return store.get_artifact(store.get_ref(variant)["nodes"][name]["outputs"]["out"])

    write("uniform", f'extends = "oq4e-mtp-xl"\n{TRAINED}')
    timed([*cli, "build", "uniform", "--target", "eval"], root)
    quant = node("uniform", "quantize")
    target = quant.meta["bits_per_weight"]
    weights = sum(r["params"] for r in quant.meta["role_table"].values())
    rows = [("uniform 4-bit", node("uniform", "eval").meta["report"], None, None)]
    for gran in ("layer", "tensor"):
        name = f"budget-{gran}"
        write(
            name,
            f'extends = "oq-budget"\n{TRAINED}[recipe]\ntarget_bpw = {target}\n'
            f'[steps.sensitivity]\nparams.granularity = "{gran}"\n',
        )
        cost = timed([*cli, "build", name, "--target", "sensitivity"], root)
        timed([*cli, "build", name, "--target", "eval"], root)
        plan = node(name, "quantize").meta["budget"]
        rows.append((f"budget, per {gran}", node(name, "eval").meta["report"], plan, cost))

    limit = target * weights / 8
    print(f"target_bpw {target} (uniform's), budget {limit:,.0f} bytes\n")
    print(
        "| variant | KLD mean | KLD p99 | top-1 | bytes | vs budget | sensitivity: wall, CPU, RSS |"
    )
    print("|---|---|---|---|---|---|---|")
    for label, r, _, cost in rows:
        c = f"{cost[0]:.1f} s, {cost[1]:.1f} s, {cost[2]:.0f} MB" if cost else ""
        print(
            f"| {label} | {r['kld_mean']:.5f} | {r['kld_p99']:.4f} | {r['top1_agreement']:.4f} | "
            f"{r['size_bytes']:,} | {r['size_bytes'] / limit - 1:+.2%} | {c} |"
        )
    for label, _, plan, _ in rows[1:]:
        bits = " ".join(str(b) for _, b in sorted(plan["bits"].items()))
        print(f"\n{label}: bits {bits}; summed sensitivity {plan['total_sensitivity']}")


if __name__ == "__main__":
    main()
