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
    from buildkit.grade import grades

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
        figures = grades.last_results(store, path.stem)
        if figures:
            row["eval"] = {k: figures[0].get(k) for k, _, _ in grades.COLUMNS if k in figures[0]}
            if figures[0].get("domains"):
                row["eval"]["domains"] = figures[0]["domains"]
    except BuildkitError as e:
        row.update(state="invalid", reason=str(e).splitlines()[0])
    return row


def print_status(rows: list[dict]) -> None:
    from buildkit.grade import grades

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
            print(
                f"{'':16} "
                + ", ".join(f"{h} {f(e[k])}" for k, h, f in grades.COLUMNS if e.get(k) is not None)
            )
            for name, d in sorted((e.get("domains") or {}).items()):
                print(f"{'':18}{grades.domain_line(name, d)}")


def cmd_eval(args) -> int:
    from buildkit.grade import calibration as cal
    from buildkit.grade import evaluate as ev
    from buildkit.steps.eval import EvalParams, heldout_tokens, read_text, whole_tokens

    p = EvalParams()
    model, source = ev.DirWeights(Path(args.model)), ev.DirWeights(Path(args.source))
    if source.quantization:
        raise UsageError(
            f"--source {args.source} is quantized; point it at the bf16 source directory"
        )
    limit = args.max_tokens or p.max_tokens
    if args.text:  # the user's own text: graded whole
        text = read_text(cal.text_path(args.text, Path.cwd()))
        tokens, in_text = whole_tokens(text, source.tokenizer_json(), limit)
        graded = {"text": args.text, "text_tokens": in_text, "lines": "all"}
    else:  # the builtin calibration text: its held-out lines, as the eval step grades it
        text = read_text(cal.text_path(p.text, Path.cwd()))
        tokens = heldout_tokens(text, p.heldout_every, source.tokenizer_json(), limit)
        graded = {"text": p.text, "lines": f"held-out (every {p.heldout_every}th)"}
    figures, (ts, tm) = ev.evaluate(source, model, tokens, p.seq_len)
    figures |= graded
    figures["size_bytes"] = model.bytes()
    if "acceptance" in figures:
        from buildkit.grade import drafting

        depth = args.depth or p.depth
        figures |= drafting.figures(source, model, ts, tm, tokens, depth, p.verify_cost)
    if args.speculative:
        from buildkit.clients import speculative as spec

        if "acceptance" not in figures:
            raise UsageError(f"--speculative: {args.model} has no MTP head to draft with")
        sp = spec.SpeculativeParams()
        prompts = spec.decode_prompts(
            source.tokenizer_json(), spec.prompt_ids(tokens, sp.prompts, sp.prompt_tokens)
        )
        figures["speculative"] = spec.run(Path(args.model), prompts, depth, sp)
    rc = 1 if figures.get("speculative", {}).get("lossless") is False else 0
    if args.json:
        print(json.dumps(figures, indent=2, sort_keys=True))
        return rc
    for k, v in figures.items():
        print(f"{k:20} {v:.6g}" if isinstance(v, float) else f"{k:20} {v}")
    return rc


def cmd_compare(args) -> int:
    from buildkit.grade import grades

    store = open_store(args)
    rows, missing = [], []
    for v in args.variants:
        got = grades.last_results(store, Path(v).stem)
        rows += got
        if not got:
            missing.append(v)
    if args.json:
        print(json.dumps(rows, indent=2, sort_keys=True))
    elif rows:
        print(grades.table(rows))
    for v in missing:
        print(
            f"{v}: no eval results (never built, or its last build has no eval step)",
            file=sys.stderr,
        )
    if args.plot and rows:
        grades.plot(rows, Path(args.plot))
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
    ev.add_argument("--max-tokens", type=int, help="at most this many tokens (default 128)")
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
