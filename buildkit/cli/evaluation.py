"""eval, compare, status: a model's figures, and every variant's last build."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from buildkit.cli.common import (
    open_remote,
    open_store,
    remote_flag,
)
from buildkit.core.errors import BuildkitError, UsageError


def last_root(store, variant: str) -> dict | None:
    last = None
    for root in store.roots():  # oldest first
        if root["request"].get("variant") == variant:
            last = root
    return last


def _outputs(store, key: str) -> dict:
    rec = store.get_action(key) or {}
    return {k: store.get_artifact(d) for k, d in rec.get("outputs", {}).items()}


def last_results(store, variant: str) -> list[dict]:
    """Rows for a variant's last build: the model's figures (its eval nodes merged, size and
    bits per weight as published), then one row per labelled eval (a baseline). Empty if the
    variant was never built or its last build had no eval."""
    from buildkit.present.tables import merge_evals

    root = last_root(store, variant)
    if root is None:
        return []
    reports, published = [], {}
    for _name, node in sorted(root["nodes"].items()):
        kind = (node.get("ingredients") or {}).get("kind")
        if kind not in ("eval", "publish"):
            continue
        outs = _outputs(store, node["key"])
        if "out" not in outs:
            continue
        if kind == "eval":
            reports.append(outs["out"].meta.get("report", {}))
        else:
            meta = outs["out"].meta
            published = {
                "bits_per_weight": meta.get("bits_per_weight"),
                "size_bytes": sum(
                    s for n, s in meta.get("sizes", {}).items() if n.endswith(".safetensors")
                ),
            }
    reports.sort(key=lambda r: (bool(r.get("label")), r.get("scope") == "head"))
    merged = merge_evals(reports)  # trunk, head, labelled
    if not merged:
        return []
    others = merged.pop("others", {})
    rows = [{"variant": variant, **merged, **{k: v for k, v in published.items() if v}}]
    for label, figs in sorted(others.items()):
        row = {"variant": f"{variant} [{label}]", **figs}
        if published.get("size_bytes") and figs.get("size_bytes") == merged.get("size_bytes"):
            row.update(published)  # the same bits in other bytes: the published model's size
        rows.append(row)
    return rows


def cmd_status(args) -> int:
    store = open_store(args)
    remote = open_remote(args)
    last: dict[str, dict] = {}
    for root in store.roots():  # oldest first: the last one wins
        last[root["request"].get("variant")] = root
    rows = [
        status_row(p, last.get(p.stem), args.manifests, store, remote, last)
        for p in sorted(Path(args.manifests).glob("*.toml"))
    ]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print_status(rows)
    return 0


def built_by_others(m, store, remote, last: dict[str, dict]) -> dict:
    """A variant with no build of its own, planned as it would build: fresh or stale when other
    builds made some of its nodes (and which builds share them), else nothing to add."""
    from buildkit.engine.plan import Planner
    from buildkit.engine.step import BuildOptions

    states = Planner(m, store, BuildOptions(project_root=Path.cwd(), remote=remote)).plan()
    fresh = [s for s in states if s.fresh]
    if not fresh:
        return {}
    made = {s.key for s in fresh}
    by = sorted(
        v
        for v, root in last.items()
        if made & {n.get("key") for n in (root.get("nodes") or {}).values()}
    )
    note = f"{len(fresh)} of {len(states)} steps in the store" + (
        f", shared with {', '.join(by)}" if by else ""
    )
    stale = [s for s in states if not s.fresh]
    if stale:
        return {"state": "stale", "reason": f"{stale[0].name}: {stale[0].reasons[0]} ({note})"}
    return {"state": "fresh", "reason": note, "built_by": by}


def status_row(
    path: Path, root: dict | None, manifests: str, store, remote, last: dict[str, dict]
) -> dict:
    """One variant's line of ``status``: its last build (``root``), planned against the store;
    with none, what other builds (``last``: each variant's last root) made of it."""
    from buildkit.engine import manifest
    from buildkit.engine.plan import Planner
    from buildkit.engine.step import BuildOptions

    row = {"variant": path.stem, "built": False}
    try:
        if root is None:
            m = manifest.load(str(path), manifests)
            row.update(state="never built", reason="never built")
            if last:  # other builds may have made its nodes (xl's, by xl-mtp's build)
                row.update(built_by_others(m, store, remote, last))
            return row
        req = root["request"]
        m = manifest.load(str(path), manifests, source=req.get("source"))
        out = Path(req["out"]) if req.get("out") else None
        planner = Planner(
            m, store, BuildOptions(project_root=Path.cwd(), out_dir=out, remote=remote)
        )
        stale = [s for s in planner.plan() if not s.fresh]
        row.update(
            built=True,
            source=req.get("source"),
            out=req.get("out"),
            when=time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(root.get("built_ns", 0) / 1e9)),
            state="stale" if stale else "fresh",
            reason=f"{stale[0].name}: {stale[0].reasons[0]}" if stale else "",
        )
        figures = last_results(store, path.stem)
        if figures:
            row["eval"] = {k: v for k, v in figures[0].items() if k in STATUS_KEYS}
    except BuildkitError as e:
        row.update(state="invalid", reason=str(e).splitlines()[0])
    return row


STATUS_KEYS = {
    "size_bytes",
    "bits_per_weight",
    "kld_mean",
    "kld_p99",
    "top1_agreement",
    "ppl_model",
    "ppl_source",
    "acceptance",
    "acceptance_source",
    "drafts_by_depth",
    "tokens_per_cycle",
    "speculative",
    "domains",
    "ci95",
    "tokens",
    "text_tokens",
}


def print_status(rows: list[dict]) -> None:
    from buildkit.present import tables

    for r in rows:
        where = (
            f"  source {r['source']}, out {r.get('out') or 'default'}, built {r['when']}"
            if r["built"]
            else ""
        )
        print(
            f"{r['variant']:16} {r['state']:11}{where}"
            + (f"\n{'':16} {r['reason']}" if r["reason"] and r["state"] != "never built" else "")
        )
        if r.get("eval"):
            e = r["eval"]
            print(f"{'':16} {tables.line(e)}")
            for name, d in sorted((e.get("domains") or {}).items()):
                print(f"{'':18}{name}: {tables.line(d)}")


def cmd_eval(args) -> int:
    from buildkit.grade import evaluate as ev
    from buildkit.grade.weights import DirWeights

    model, source = DirWeights(Path(args.model)), DirWeights(Path(args.source))
    if source.quantization:
        raise UsageError(
            f"--source {args.source} is quantized; point it at the bf16 source directory"
        )
    from buildkit.steps.eval import EvalParams
    from buildkit.steps.reference import ReferenceParams

    p, r = EvalParams(), ReferenceParams()
    tokens, graded = eval_tokens(args, source, r)
    # the heads are graded below, acceptance and depths from one drafting chain (eval_head's way)
    figures, (ts, tm) = ev.evaluate(source, model, tokens, r.seq_len, head=False)
    figures |= graded
    figures["size_bytes"] = model.bytes()
    if model.has_head() and source.has_head():
        from buildkit.grade import drafting, stats

        depth = args.depth or p.depth
        stats.merge(figures, drafting.figures(source, model, ts, tm, tokens, depth, p.verify_cost))
    if args.speculative:
        figures["speculative"] = speculative(args, source, tokens, "acceptance" in figures)
    rc = 1 if figures.get("speculative", {}).get("lossless") is False else 0
    if args.json:
        print(json.dumps(figures, indent=2, sort_keys=True))
    else:
        print_eval(figures)
    return rc


def eval_tokens(args, source, p) -> tuple[list[int], dict]:
    """The tokens ``buildkit eval`` grades and what they are: a user's ``--text`` whole (unless
    ``--max-tokens`` caps it), else the builtin text's held-out lines as the reference step
    takes them (``p``: its params)."""
    from buildkit.grade import texts

    if args.text:  # the user's own text: graded whole
        text = texts.read(texts.text_path(args.text, Path.cwd()))
        tok = source.tokenizer_json()
        tokens, in_text = texts.whole_tokens(text, tok, args.max_tokens or 1 << 62)
        return tokens, {"text": args.text, "text_tokens": in_text, "lines": "all"}
    text = texts.read(texts.text_path(p.text, Path.cwd()))
    every = texts.heldout_tokens(text, p.heldout_every, source.tokenizer_json(), 1 << 62)
    tokens = every[: args.max_tokens or p.max_tokens]
    held = f"held-out (every {p.heldout_every}th)"
    return tokens, {"text": p.text, "text_tokens": len(every), "lines": held}


def speculative(args, source, tokens: list[int], has_head: bool) -> dict:
    from buildkit.clients import speculative as spec
    from buildkit.steps.eval import EvalParams

    if not has_head:
        raise UsageError(f"--speculative: {args.model} has no MTP head to draft with")
    sp = spec.SpeculativeParams()
    prompts = spec.decode_prompts(
        source.tokenizer_json(), spec.prompt_ids(tokens, sp.prompts, sp.prompt_tokens)
    )
    return spec.run(Path(args.model), prompts, args.depth or EvalParams().depth, sp)


SKIP = {"ci95", "per_window", "per_window_acceptance", "kld_tail_positions", "domains"}


def print_eval(figures: dict) -> None:
    """``buildkit eval``'s figures, one a line, each ``value ± half-width``: first how many of
    the text's tokens were graded."""
    from buildkit.present import tables

    n, m = figures["tokens"], figures.get("text_tokens", figures["tokens"])
    cut = "" if n >= m else " (capped by --max-tokens)"
    print(f"{'graded':20} {n} of {m} tokens of {figures['text']}{cut}")
    ci = figures.get("ci95") or {}
    for k, v in figures.items():
        if k in SKIP or k in ("tokens", "text_tokens", "text"):
            continue
        if isinstance(v, float):
            print(f"{k:20} {tables.pm(v, ci.get(k), '{:.6g}'.format)}")
        else:
            print(f"{k:20} {v}")
    cells = tables.depth_cells(figures)
    if "tokens_per_cycle" in cells:
        print(f"{'tok/cycle ± 95%':20} {cells['tokens_per_cycle']}")


def cmd_compare(args) -> int:
    from buildkit.present import plots, tables

    store = open_store(args)
    rows, missing = [], []
    for v in args.variants:
        got = last_results(store, Path(v).stem)
        rows += got
        if not got:
            missing.append(v)
    if args.json:
        print(json.dumps(rows, indent=2, sort_keys=True))
    elif rows:
        print(tables.table(rows))
    for v in missing:
        print(
            f"{v}: no eval results (never built, or its last build has no eval step)",
            file=sys.stderr,
        )
    if args.plot and rows:
        plots.plot(rows, Path(args.plot))
        print(f"wrote {args.plot}", file=sys.stderr)
    return 1 if missing else 0


def add(sub) -> None:
    """Register eval, compare and status."""
    ev = sub.add_parser(
        "eval",
        help="Grade any MLX model directory against a bf16 source directory "
        "(KLD, top-1, perplexity, MTP acceptance).",
        description="The eval step's measurement for any MLX directory "
        "(buildkit's or mlx_lm.convert's) against a bf16 source in Hugging Face layout, "
        "each read one decoder layer at a time from its safetensors files.",
    )
    ev.add_argument("model", help="MLX model directory")
    ev.add_argument("--source", required=True, help="bf16 source directory (Hugging Face layout)")
    ev.add_argument(
        "--text",
        help="a UTF-8 text file, graded whole (default: the held-out lines, every 5th, of the "
        "builtin calibration text)",
    )
    ev.add_argument(
        "--max-tokens",
        type=int,
        help="at most this many tokens (default: all of --text; the eval step's max_tokens "
        "of the builtin text)",
    )
    ev.add_argument(
        "--depth", type=int, help="MTP drafts per cycle measured, teacher-forced (default 3)"
    )
    ev.add_argument(
        "--speculative",
        action="store_true",
        help="also run mlx_vlm's speculative generation with MODEL/mtp (greedy, float32) "
        "for 1..depth drafts; exit 1 if any output differs from plain greedy decoding",
    )
    ev.add_argument("--json", action="store_true", help="machine-readable output")
    ev.set_defaults(fn=cmd_eval)

    cp = sub.add_parser(
        "compare",
        help="Variants' eval figures side by side, from their last builds.",
        description="Size, bits per weight, KL divergence (mean, p99), top-1 agreement, "
        "perplexity and MTP acceptance of each variant's last build, "
        "with labelled comparisons (a baseline) as rows.",
    )
    cp.add_argument("variants", nargs="+", metavar="VARIANT", help="variant names")
    cp.add_argument(
        "--plot", metavar="FILE.png", help="also draw size against KL divergence (needs matplotlib)"
    )
    cp.add_argument("--json", action="store_true", help="machine-readable output")
    cp.set_defaults(fn=cmd_compare)

    ss = sub.add_parser(
        "status",
        help="Every variant: its last build, fresh or stale, and why.",
        description="Every variant in --manifests with its last build (source, out, when), "
        "planned against the store: fresh, or stale with the first reason.",
    )
    ss.add_argument("--json", action="store_true", help="machine-readable output")
    remote_flag(ss)
    ss.set_defaults(fn=cmd_status)
