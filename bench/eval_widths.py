"""How wide eval's 95% intervals are at a few token counts, on the default fixture.

Builds xl-mtp from ``fixture:trained`` (the default manifests' source) in a throwaway project,
writes the fixture's source directory, then runs ``buildkit eval`` of the published directory
on the builtin text's held-out lines at each ``--tokens`` count and prints a Markdown table of
KLD mean and depth-1 acceptance with their half-widths (docs/evaluation.md records the
choice of the eval step's default ``max_tokens`` from it). A few seconds a count.

Usage::

    python bench/eval_widths.py                       # 256 512 1024 1536 and all held-out tokens
    python bench/eval_widths.py --tokens 512 1024 --dir /tmp/widths
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shutil
import tempfile
from pathlib import Path

from buildkit.cli.main import main as cli
from buildkit.fixtures.trained import write_trained
from buildkit.grade import stats

REPO = Path(__file__).resolve().parents[1]


def run(root: Path, *argv: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = cli(["--store", str(root / "cache"), "--manifests", str(root / "manifests"), *argv])
    if rc != 0:
        raise SystemExit(f"buildkit {' '.join(argv)} exited {rc}")
    return out.getvalue()


def widths(root: Path, model: Path, source: Path, n: int) -> dict:
    e = json.loads(
        run(root, "eval", str(model), "--source", str(source), "--json", "--max-tokens", str(n))
    )
    ci = e["ci95"]
    return {
        "tokens": e["tokens"],
        "windows": e["windows"],
        "kld_mean": e["kld_mean"],
        "kld_rel": stats.rel_half_width(e["kld_mean"], ci["kld_mean"]),
        "acceptance": e.get("acceptance"),
        "acc_half": stats.half_width(ci.get("acceptance")),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[256, 512, 1024, 1536, 1 << 30])
    ap.add_argument("--dir", help="work here (kept) instead of a temporary directory")
    args = ap.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="eval-widths-"))
    try:
        shutil.copytree(
            REPO / "manifests",
            root / "manifests",
            dirs_exist_ok=True,
            ignore=shutil.ignore_patterns("*.lock"),
        )
        source = root / "source"
        if not (source / "config.json").exists():
            write_trained(source)
        model = root / "out" / "xl-mtp"
        run(root, "build", "xl-mtp", "--out", str(model), "-q")
        print("| tokens | windows | KLD mean | ± (share of it) | acceptance d1 | ± (points) |")
        print("|---|---|---|---|---|---|")
        for n in args.tokens:
            w = widths(root, model, source, n)
            acc = "-" if w["acceptance"] is None else f"{w['acceptance']:.3f}"
            ah = "-" if w["acc_half"] is None else f"{100 * w['acc_half']:.1f}"
            kr = "-" if w["kld_rel"] is None else f"{w['kld_rel']:.1%}"
            print(f"| {w['tokens']} | {w['windows']} | {w['kld_mean']:.5f} | {kr} | {acc} | {ah} |")
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
