"""The eval figures of variants' last builds, side by side: ``buildkit compare`` and ``status``."""

from __future__ import annotations

import math
from pathlib import Path

from buildkit.store.store import Store

COLUMNS = (  # (key, heading, format)
    ("size_bytes", "size MB", lambda v: f"{v / 1e6:.2f}"),
    ("bits_per_weight", "bpw", lambda v: f"{v:.3f}"),
    ("kld_mean", "KLD mean", lambda v: f"{v:.5f}"),
    ("kld_p99", "KLD p99", lambda v: f"{v:.5f}"),
    ("top1_agreement", "top-1", lambda v: f"{v:.2%}"),
    ("ppl_model", "ppl", lambda v: f"{v:.3f}"),
    ("ppl_source", "ppl bf16", lambda v: f"{v:.3f}"),
    ("acceptance", "accept", lambda v: f"{v:.2%}"),
    ("acceptance_source", "accept bf16", lambda v: f"{v:.2%}"),
    ("drafts_by_depth", "drafts d1/d2/..", lambda v: " ".join(f"{a}/{n}" for a, n in v)),
    ("tokens_per_cycle", "tok/cycle", lambda v: "/".join(f"{x:.2f}" for x in v)),
    (
        "speculative",
        "mlx_vlm tok/round",
        lambda v: (
            "not run: memory"  # too large for this machine (eval.json says why)
            if "skipped" in v
            else "/".join("-" if x is None else f"{x:.2f}" for x in v["tokens_per_round"])
            + ("" if v["lossless"] else " NOT LOSSLESS")
        ),
    ),
)


def _shown(v) -> bool:
    return v is not None and (not isinstance(v, float) or math.isfinite(v))


def last_root(store: Store, variant: str) -> dict | None:
    last = None
    for root in store.roots():  # oldest first
        if root["request"].get("variant") == variant:
            last = root
    return last


def _outputs(store: Store, key: str) -> dict:
    rec = store.get_action(key) or {}
    return {k: store.get_artifact(d) for k, d in rec.get("outputs", {}).items()}


def last_results(store: Store, variant: str) -> list[dict]:
    """Rows for a variant's last build: the model's figures (its eval nodes merged, size and
    bits per weight as published), then one row per labelled eval (a baseline). Empty if the
    variant was never built or its last build had no eval."""

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
    reports.sort(
        key=lambda r: (bool(r.get("label")), r.get("scope") == "head")
    )  # trunk, head, labelled
    merged = merge_evals(reports)
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


def with_domains(rows: list[dict]) -> list[dict]:
    """Each row followed by one row per domain text it was graded on (named "  name")."""
    out = []
    for r in rows:
        out.append(r)
        out += [{"variant": f"  {n}", **d} for n, d in sorted((r.get("domains") or {}).items())]
    return out


def domain_line(name: str, d: dict) -> str:
    """One domain's figures in a line (``buildkit status``)."""
    return f"{name}: " + ", ".join(
        f"{h} {f(d[k])}" for k, h, f in COLUMNS if isinstance(d.get(k), (int, float))
    )


def table(rows: list[dict]) -> str:
    heads = ["variant", *(h for _, h, _ in COLUMNS)]
    cells = [
        [
            r["variant"],
            *(f(r[k]) if _shown(r.get(k)) else "-" for k, _, f in COLUMNS),
        ]
        for r in with_domains(rows)
    ]
    width = [max(len(x) for x in col) for col in zip(heads, *cells)]

    def fmt(xs):
        return "  ".join(
            x.ljust(w) if i == 0 else x.rjust(w) for i, (x, w) in enumerate(zip(xs, width))
        )

    return "\n".join([fmt(heads), *(fmt(c) for c in cells)])


def plot(rows: list[dict], path: Path) -> None:
    """Size against mean KL divergence, one labelled point per row (matplotlib, Agg)."""
    try:
        import matplotlib
    except ImportError:
        from buildkit.core.errors import UsageError

        raise UsageError(
            "--plot needs matplotlib: pip install 'buildkit[plot]' (or matplotlib)"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [r for r in rows if r.get("size_bytes") and r.get("kld_mean") is not None]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for r in pts:
        ax.scatter(r["size_bytes"] / 1e9, r["kld_mean"])
        ax.annotate(
            r["variant"],
            (r["size_bytes"] / 1e9, r["kld_mean"]),
            fontsize=8,
            textcoords="offset points",
            xytext=(4, 4),
        )
    ax.set_xlabel("size (GB)")
    ax.set_ylabel("KL divergence from bf16, mean (nats)")
    ax.set_title("size against KL divergence")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def merge_evals(reports: list[dict]) -> dict:
    """One eval.json from several eval nodes: the model's figures (a head-scoped node's
    acceptance joins the trunk's), and each labelled node's (a baseline) under its label."""
    out: dict = {}
    for rep in reports:
        figures = {k: v for k, v in rep.items() if k not in ("scope", "label")}
        if rep.get("label"):
            out.setdefault("others", {})[rep["label"]] = figures
        else:
            if rep.get("scope") == "head":
                figures = {k: v for k, v in figures.items() if k != "tokens"}
            for name, d in figures.pop("domains", {}).items():  # a head's acceptance joins
                out.setdefault("domains", {}).setdefault(name, {}).update(d)
            out.update(figures)
    return out


EVAL_ROWS = (  # (key, what it is, format)
    ("kld_mean", "KL divergence KL(p_bf16 ‖ p_model), mean", "{:.5f}"),
    ("kld_median", "KL divergence, median", "{:.5f}"),
    ("kld_p99", "KL divergence, 99th percentile", "{:.5f}"),
    ("top1_agreement", "top-1 agreement with bf16", "{:.2%}"),
    ("ppl_model", "perplexity, this model", "{:.3f}"),
    ("ppl_source", "perplexity, bf16 source", "{:.3f}"),
    ("acceptance", "MTP draft acceptance, depth 1 (this head on this trunk)", "{:.2%}"),
    ("acceptance_source", "MTP draft acceptance, depth 1 (bf16 head on bf16 trunk)", "{:.2%}"),
)


def eval_table(evals: dict) -> list[str]:
    """The card's evaluation table: this model, then each labelled comparison, as columns."""
    cols = [("this model", evals), *sorted(evals.get("others", {}).items())]
    text = f" of {evals['text']}" if evals.get("text") else ""
    lines = [
        f"On {evals.get('positions', '?')} positions of the held-out lines{text} "
        f"({evals.get('tokens', '?')} tokens), next-token distributions against the bf16 source, "
        "both run with mlx_lm's classes in float32.",
        "",
        "| figure | " + " | ".join(c for c, _ in cols) + " |",
        "|---|" + "---|" * len(cols),
    ]
    for key, what, fmt in EVAL_ROWS:
        if any(key in f for _, f in cols):
            lines.append(
                f"| {what} | "
                + " | ".join(fmt.format(f[key]) if f.get(key) is not None else "" for _, f in cols)
                + " |"
            )
    return lines + domain_table(evals)


DOMAIN_COLUMNS = (  # (key, heading, format)
    ("tokens", "tokens", "{}"),
    ("kld_mean", "KLD mean", "{:.5f}"),
    ("top1_agreement", "top-1", "{:.2%}"),
    ("acceptance", "MTP acceptance", "{:.2%}"),
)


def domain_table(evals: dict) -> list[str]:
    """Per domain text (graded whole): this model's figures and, for each labelled comparison
    that graded the same domains (a data-agnostic baseline), this model's KLD as a ratio of
    its."""
    domains = evals.get("domains") or {}
    if not domains:
        return []
    cols = [c for c in DOMAIN_COLUMNS if any(c[0] in d for d in domains.values())]
    others = [(lab, o["domains"]) for lab, o in sorted(evals.get("others", {}).items())]
    others = [(lab, d) for lab, d in others if d]
    lines = [
        "",
        "Per domain, each text graded whole (calibration skew: a data-aware model's error "
        "where its calibration text says little):",
        "",
        "| domain | "
        + " | ".join(h for _, h, _ in cols)
        + "".join(f" | KLD / {lab}" for lab, _ in others)
        + " |",
        "|---|" + "---|" * (len(cols) + len(others)),
    ]
    for name, d in sorted(domains.items()):
        cells = [fmt.format(d[k]) if d.get(k) is not None else "" for k, _, fmt in cols]
        for _, od in others:
            base = (od.get(name) or {}).get("kld_mean")
            ok = base and d.get("kld_mean") is not None
            cells.append(f"{d['kld_mean'] / base:.3f}" if ok else "")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines
