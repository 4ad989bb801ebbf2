"""Eval figures as tables and lines, each with its 95% interval: the card's evaluation table,
``buildkit compare``'s table and ``status``'s lines; the merge of a build's eval reports."""

from __future__ import annotations

import math

from buildkit.grade import stats


def pct(v: float) -> str:
    return f"{v:.2%}"


COLUMNS = (  # (key, heading, format); a figure with an interval prints "value ± half-width"
    ("size_bytes", "size MB", lambda v: f"{v / 1e6:.2f}"),
    ("bits_per_weight", "bpw", lambda v: f"{v:.3f}"),
    ("kld_mean", "KLD mean", lambda v: f"{v:.5f}"),
    ("kld_p99", "KLD p99", lambda v: f"{v:.5f}"),
    ("top1_agreement", "top-1", pct),
    ("ppl_model", "ppl", lambda v: f"{v:.3f}"),
    ("ppl_source", "ppl bf16", lambda v: f"{v:.3f}"),
    ("acceptance", "accept", pct),
    ("acceptance_source", "accept bf16", pct),
    # a labelled row (a baseline): the variant's KLD mean over this row's, paired by window
    ("kld_ratio", "KLD variant/this", lambda v: f"{v:.3f}"),
)
LISTS = (  # per draft depth: (key, heading)
    ("drafts_by_depth", "drafts d1/d2/.."),
    ("tokens_per_cycle", "tok/cycle"),
)


def pm(v, ci, fmt, bracket: bool = False) -> str:
    """``v ± half-width`` of its 95% interval (``bracket``: ``v [lo, hi]``, for the skewed
    intervals of tail percentiles), or ``v`` alone without one."""
    h = stats.half_width(ci)
    if h is None:
        return fmt(v)
    if bracket:
        return f"{fmt(v)} [{fmt(ci[0])}, {fmt(ci[1])}]"
    return f"{fmt(v)} ± {fmt(h).lstrip('+')}"


SKEWED = {"kld_p90", "kld_p95", "kld_p99", "kld_p999"}  # shown as [lo, hi]


def _shown(v) -> bool:
    return v is not None and (not isinstance(v, float) or math.isfinite(v))


def depth_cells(r: dict) -> dict[str, str]:
    """The per-depth columns of a row: drafts a/n (or "few(n)" under ``stats.MIN_DRAFTS``
    tries) and tokens per cycle with its half-width ("-" beyond the last measured depth)."""
    dm, tpc = r.get("drafts_by_depth"), r.get("tokens_per_cycle")
    cis = (r.get("ci95") or {}).get("tokens_per_cycle") or []
    out = {}
    if dm:
        out["drafts_by_depth"] = " ".join(
            f"{a}/{n}" if n >= stats.MIN_DRAFTS else f"few({n})" for a, n in dm
        )
    if tpc:
        out["tokens_per_cycle"] = "/".join(
            "-" if t is None else pm(t, cis[k] if k < len(cis) else None, lambda x: f"{x:.2f}")
            for k, t in enumerate(tpc)
        )
    if v := r.get("speculative"):
        out["speculative"] = (
            "not run: memory"  # too large for this machine (eval.json says why)
            if "skipped" in v
            else "/".join("-" if x is None else f"{x:.2f}" for x in v["tokens_per_round"])
            + ("" if v["lossless"] else " NOT LOSSLESS")
        )
    return out


def cells(r: dict) -> dict[str, str]:
    """Heading -> cell of one row (figures it lacks are left out)."""
    ci = r.get("ci95") or {}
    out = {h: pm(r[k], ci.get(k), f) for k, h, f in COLUMNS if _shown(r.get(k))}
    depth = depth_cells(r)
    out |= {h: depth[k] for k, h in LISTS if k in depth}
    if "speculative" in depth:
        out["mlx_vlm tok/round"] = depth["speculative"]
    return out


def with_domains(rows: list[dict]) -> list[dict]:
    """Each row followed by one row per domain text it was graded on (named "  name")."""
    out = []
    for r in rows:
        out.append(r)
        out += [{"variant": f"  {n}", **d} for n, d in sorted((r.get("domains") or {}).items())]
    return out


def line(r: dict) -> str:
    """A row's figures in one line (``buildkit status``)."""
    return ", ".join(f"{h} {c}" for h, c in cells(r).items())


def table(rows: list[dict]) -> str:
    """``buildkit compare``'s table: one row per variant (and labelled comparison, and domain)."""
    heads = [
        "variant",
        *(h for _, h, _ in COLUMNS),
        *(h for _, h in LISTS),
        "mlx_vlm tok/round",
    ]
    body = [[r["variant"], *(cells(r).get(h, "-") for h in heads[1:])] for r in with_domains(rows)]
    width = [max(len(x) for x in col) for col in zip(heads, *body, strict=True)]

    def fmt(xs):
        return "  ".join(
            x.ljust(w) if i == 0 else x.rjust(w)
            for i, (x, w) in enumerate(zip(xs, width, strict=True))
        )

    return "\n".join([fmt(heads), *(fmt(c) for c in body)])


def merge_evals(reports: list[dict]) -> dict:
    """One eval.json from several eval nodes: the model's figures (a head-scoped node's
    acceptance and intervals join the trunk's), each labelled node's (a baseline) under its
    label with the model's KLD as a paired ratio of its (``kld_ratio``, ``ci95``)."""
    out: dict = {}
    for rep in reports:
        figures = {k: v for k, v in rep.items() if k not in ("scope", "label")}
        if rep.get("label"):
            out.setdefault("others", {})[rep["label"]] = figures
            continue
        if rep.get("scope") == "head":
            figures = {k: v for k, v in figures.items() if k != "tokens"}
        stats.merge(out, figures)
    for other in (out.get("others") or {}).values():
        _ratios(out, other)
    return out


def _ratios(model: dict, other: dict) -> None:
    """The model's KLD mean over ``other``'s, paired by window, on the main text and domains."""
    pairs = [(model, other)] + [
        (d, (other.get("domains") or {}).get(name) or {})
        for name, d in (model.get("domains") or {}).items()
    ]
    for m, o in pairs:
        got = stats.paired_ratio(m.get("per_window"), o.get("per_window"))
        if got is not None:
            o["kld_ratio"] = got[0]
            o.setdefault("ci95", {})["kld_ratio"] = got[1]


EVAL_ROWS = (  # (key, what it is, format)
    ("kld_mean", "KL divergence KL(p_bf16 ‖ p_model), mean", "{:.5f}"),
    ("kld_median", "KL divergence, median", "{:.5f}"),
    ("kld_p90", "KL divergence, 90th percentile", "{:.5f}"),
    ("kld_p95", "KL divergence, 95th percentile", "{:.5f}"),
    ("kld_p99", "KL divergence, 99th percentile", "{:.5f}"),
    ("kld_p999", "KL divergence, 99.9th percentile", "{:.5f}"),
    ("delta_p_mean", "Δp of the bf16 top token, mean", "{:+.4f}"),
    ("delta_p_rms", "Δp of the bf16 top token, RMS", "{:.4f}"),
    ("top1_agreement", "top-1 agreement with bf16", "{:.2%}"),
    ("ppl_model", "perplexity, this model", "{:.3f}"),
    ("ppl_source", "perplexity, bf16 source", "{:.3f}"),
    ("ppl_ratio", "perplexity ratio, this model / bf16", "{:.4f}"),
    ("kld_ratio", "KLD mean of this model / this column's (paired)", "{:.3f}"),
    ("acceptance", "MTP draft acceptance, depth 1 (this head on this trunk)", "{:.2%}"),
    ("acceptance_source", "MTP draft acceptance, depth 1 (bf16 head on bf16 trunk)", "{:.2%}"),
)


def graded_line(evals: dict) -> str:
    """What the figures rest on: N of M tokens, why grading stopped, windows, the interval."""
    text = f" of the held-out lines of {evals['text']}" if evals.get("text") else ""
    of = f" of {evals['text_tokens']}" if evals.get("text_tokens") else ""
    why = f", stopped by {evals['stopped_by']}" if evals.get("stopped_by") else ""
    return (
        f"On {evals.get('tokens', '?')}{of} tokens{text} ({evals.get('positions', '?')} "
        f"positions in {evals.get('windows', '?')} windows{why}), next-token distributions "
        "against the bf16 source, both run with mlx_lm's classes in float32. Each figure is "
        "given ± the half-width of its 95% interval, tail percentiles with the interval "
        "[lo, hi] (a block bootstrap over windows, docs/evaluation.md in buildkit)."
    )


def eval_table(evals: dict) -> list[str]:
    """The card's evaluation table: this model, then each labelled comparison, as columns."""
    cols = [("this model", evals), *sorted(evals.get("others", {}).items())]
    lines = [
        graded_line(evals),
        "",
        "| figure | " + " | ".join(c for c, _ in cols) + " |",
        "|---|" + "---|" * len(cols),
    ]
    for key, what, fmt in EVAL_ROWS:
        if any(f.get(key) is not None for _, f in cols):
            lines.append(
                f"| {what} | "
                + " | ".join(
                    pm(f[key], (f.get("ci95") or {}).get(key), fmt.format, key in SKEWED)
                    if f.get(key) is not None
                    else ""
                    for _, f in cols
                )
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
    that graded the same domains (a data-agnostic baseline), this model's KLD as a paired ratio
    of its."""
    domains = evals.get("domains") or {}
    if not domains:
        return []
    cols = [c for c in DOMAIN_COLUMNS if any(c[0] in d for d in domains.values())]
    others = [(lab, o.get("domains")) for lab, o in sorted(evals.get("others", {}).items())]
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
        ci = d.get("ci95") or {}
        row = [
            pm(d[k], ci.get(k), fmt.format) if d.get(k) is not None else "" for k, _, fmt in cols
        ]
        for _, od in others:
            o = od.get(name) or {}
            ok = o.get("kld_ratio") is not None
            row.append(
                pm(o["kld_ratio"], o["ci95"].get("kld_ratio"), "{:.3f}".format) if ok else ""
            )
        lines.append(f"| {name} | " + " | ".join(row) + " |")
    return lines
