"""95% intervals of eval's figures: a block bootstrap over windows, seeded and deterministic.

Positions inside one window (one sequence the model ran) are correlated, so a resample draws
whole windows with replacement (``RESAMPLES`` times, ``SEED``), never single positions; each
figure is recomputed on every resample and its interval is the resamples' 2.5th and 97.5th
percentiles (the percentile method). Every figure of one report is recomputed on the same
resamples, and ratios to a baseline graded on the same windows reuse them too (a paired
interval: both models see the same draw). A figure needs ``MIN_WINDOWS`` windows for an
interval; a draft depth needs ``MIN_DRAFTS`` tries for a rate. eval.json is a cached artifact:
the same per-window values always give the same intervals.
"""

from __future__ import annotations

from buildkit.core.lazy import lazy

np = lazy("numpy", __name__)

RESAMPLES = 1000
SEED = 0
MIN_DRAFTS = 30  # a depth tried fewer times reports "too few drafts (n)", not a rate
MIN_WINDOWS = 5  # fewer windows: too little spread to resample (no interval)
QUANTILES = {"kld_median": 50, "kld_p90": 90, "kld_p95": 95, "kld_p99": 99, "kld_p999": 99.9}


def draws(n_windows: int, resamples: int = RESAMPLES, seed: int = SEED) -> np.ndarray:
    """[resamples, n_windows] how many times each window is drawn in each resample."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n_windows, (resamples, n_windows))
    return np.stack([np.bincount(r, minlength=n_windows) for r in idx]).astype(np.float64)


def interval(samples: np.ndarray) -> list[float] | None:
    """The 95% percentile interval of bootstrap samples (NaN resamples dropped)."""
    s = np.asarray(samples, np.float64)
    s = s[np.isfinite(s)]
    if len(s) < RESAMPLES // 2:
        return None
    return [float(np.percentile(s, 2.5)), float(np.percentile(s, 97.5))]


def window_sums(window: np.ndarray, values: np.ndarray, n_windows: int) -> np.ndarray:
    """Per window, the sum of ``values`` over its positions (``window``: each position's)."""
    return np.bincount(window, weights=np.asarray(values, np.float64), minlength=n_windows)


class Bootstrap:
    """Figures over positions grouped in windows, each with its bootstrap interval.
    ``window`` gives each position's window (any ids; renumbered 0..n-1 in order)."""

    def __init__(self, window: np.ndarray, resamples: int = RESAMPLES):
        ids, self.window = np.unique(np.asarray(window), return_inverse=True)
        self.n = len(ids)
        self.counts = np.bincount(self.window, minlength=self.n).astype(np.float64)
        self.w = draws(self.n, resamples) if self.n >= MIN_WINDOWS else None

    def sums(self, values: np.ndarray) -> np.ndarray:
        return window_sums(self.window, values, self.n)

    def mean(self, values: np.ndarray) -> tuple[float, list[float] | None]:
        """The mean over positions and its interval."""
        return ratio_of_sums(self.sums(values), self.counts, self.w)

    def quantile(self, values: np.ndarray, q: float) -> tuple[float, list[float] | None]:
        """The ``q``-th percentile (inverted CDF) and its interval: each resample's percentile
        with every position weighted by how often its window was drawn."""
        v = np.asarray(values, np.float64)
        order = np.argsort(v, kind="stable")
        est = float(np.percentile(v, q, method="inverted_cdf"))
        if self.w is None:
            return est, None
        cw = np.cumsum(self.w[:, self.window[order]], axis=1)
        at = (cw < (q / 100.0) * cw[:, -1:]).sum(axis=1)  # first cumulative weight >= q share
        return est, interval(v[order][np.minimum(at, len(v) - 1)])


def ratio_of_sums(num: np.ndarray, den: np.ndarray, w: np.ndarray | None):
    """sum(num) / sum(den) over windows, and its interval over resamples ``w``."""
    est = float(num.sum() / den.sum()) if den.sum() else float("nan")
    if w is None:
        return est, None
    with np.errstate(invalid="ignore", divide="ignore"):
        return est, interval((w @ num) / (w @ den))


def half_width(ci: list[float] | None) -> float | None:
    return None if ci is None else (ci[1] - ci[0]) / 2


def rel_half_width(est: float, ci: list[float] | None) -> float | None:
    """The interval's half-width as a share of the figure (None without an interval or at 0)."""
    h = half_width(ci)
    return None if h is None or not est else h / abs(est)


def trunk_figures(pf: dict[str, np.ndarray]) -> dict:
    """llama.cpp's KLD report over per-position figures (``evaluate.position_figures``: kl,
    agree, delta_p, nll_source, nll_model, window), each with its interval under ``ci95``, and
    the per-window sums a paired ratio needs later (``windows``)."""
    b = Bootstrap(pf["window"])
    kl = pf["kl"].astype(np.float64)
    out, ci = {"positions": int(len(kl)), "windows": b.n}, {}
    out["kld_mean"], ci["kld_mean"] = b.mean(kl)
    for key, q in QUANTILES.items():
        out[key], ci[key] = b.quantile(kl, q)
    # how many positions the tail figures rest on (above each percentile)
    out["kld_tail_positions"] = {k: int((kl > out[k]).sum()) for k in ("kld_p99", "kld_p999")}
    dp = pf["delta_p"].astype(np.float64)
    out["delta_p_mean"], ci["delta_p_mean"] = b.mean(dp)
    ms, msci = b.mean(dp**2)
    out["delta_p_rms"], ci["delta_p_rms"] = _sqrt(ms, msci)
    out["top1_agreement"], ci["top1_agreement"] = b.mean(pf["agree"])
    nll = {k: b.sums(pf[f"nll_{k}"]) for k in ("source", "model")}
    for k, s in nll.items():
        mean, mci = ratio_of_sums(s, b.counts, b.w)
        out[f"ppl_{k}"], ci[f"ppl_{k}"] = float(np.exp(mean)), _exp(mci)
    diff, dci = ratio_of_sums(nll["model"] - nll["source"], b.counts, b.w)
    out["ppl_ratio"], ci["ppl_ratio"] = float(np.exp(diff)), _exp(dci)  # paired by position
    out["ci95"] = ci
    out["per_window"] = {
        "positions": b.counts.astype(int).tolist(),
        "kld_sum": _r(b.sums(kl)),
        "top1_sum": _r(b.sums(pf["agree"])),
    }
    return out


def _r(xs: np.ndarray) -> list[float]:
    return [float(x) for x in xs]


def _exp(ci):
    return None if ci is None else [float(np.exp(ci[0])), float(np.exp(ci[1]))]


def _sqrt(est, ci):
    return float(np.sqrt(est)), None if ci is None else [float(np.sqrt(c)) for c in ci]


def acceptance(hits: list[int], totals: list[int]) -> tuple[float, list[float] | None]:
    """Depth-1 acceptance (hits over graded positions, each list per window) and its interval."""
    h, t = np.asarray(hits, np.float64), np.asarray(totals, np.float64)
    keep = t > 0
    w = draws(int(keep.sum())) if keep.sum() >= MIN_WINDOWS else None
    return ratio_of_sums(h[keep], t[keep], w)


def paired_ratio(a: dict, b: dict, key: str = "kld_sum") -> tuple[float, list[float]] | None:
    """``a``'s mean over ``b``'s (two reports' ``per_window``), resampling both on the same
    windows; None unless both graded the same windows (same positions in each)."""
    if not a or not b or a.get("positions") != b.get("positions") or key not in a or key not in b:
        return None
    n = np.asarray(a["positions"], np.float64)
    num, den = np.asarray(a[key], np.float64), np.asarray(b[key], np.float64)
    est = float(num.sum() / den.sum()) if den.sum() else float("nan")
    if len(n) < MIN_WINDOWS:
        return est, None
    w = draws(len(n))
    with np.errstate(invalid="ignore", divide="ignore"):
        return est, interval((w @ num) / (w @ den))


# ---- drafts by depth ---------------------------------------------------------------------


def depth_rates(counts: np.ndarray) -> list[float | None]:
    """Per depth, accepted / tried ([depth, 2] summed counts); None below ``MIN_DRAFTS`` tries."""
    return [float(a / n) if n >= MIN_DRAFTS else None for a, n in counts]


def tokens_per_cycle(rates: list[float | None]) -> list[float | None]:
    """1 + the cumulative products of the rates, for 1..k drafts; None from the first depth
    without a rate on (never extrapolated beyond the last measured depth)."""
    out, total, prod = [], 1.0, 1.0
    for r in rates:
        if r is None:
            return out + [None] * (len(rates) - len(out))
        prod *= r
        total += prod
        out.append(total)
    return out


def _tpc_samples(per_window: np.ndarray, w: np.ndarray) -> np.ndarray:
    """[resamples, depth] tokens per cycle on each resample (NaN where a depth has no try)."""
    acc = np.einsum("rw,wd->rd", w, per_window[:, :, 0])
    tried = np.einsum("rw,wd->rd", w, per_window[:, :, 1])
    with np.errstate(invalid="ignore", divide="ignore"):
        return 1.0 + np.cumsum(np.cumprod(acc / tried, axis=1), axis=1)


def depth_figures(per_window: list, costs: list[float], tokens: int) -> dict:
    """Drafts by depth ([window][depth] = [accepted, tried]) on ``tokens`` tokens: the summed
    counts, rates (None
    under ``MIN_DRAFTS``), tokens per cycle and modelled speedup with intervals, and the best
    draft length, named only when its speedup clears the runner-up's: the paired interval of
    their difference lies above zero (else ``best_drafts`` is None and ``undecided`` says why)."""
    pw = np.asarray(per_window, np.float64).reshape(len(per_window), -1, 2)
    counts = pw.sum(axis=0).astype(int)
    rates = depth_rates(counts)
    tpc = tokens_per_cycle(rates)
    measured = [k for k, t in enumerate(tpc) if t is not None]
    out = {
        "drafts_by_depth": counts.tolist(),
        "acceptance_by_depth": rates,
        "tokens_per_cycle": tpc,
        "verify_cost": costs,
        "modelled_speedup": [None if t is None else t / c for t, c in zip(tpc, costs, strict=True)],
        "ci95": {"tokens_per_cycle": [None] * len(tpc), "modelled_speedup": [None] * len(tpc)},
    }
    w = draws(len(pw)) if len(pw) >= MIN_WINDOWS else None
    samples = _tpc_samples(pw, w) if w is not None else None
    for k in measured:
        if samples is not None:
            out["ci95"]["tokens_per_cycle"][k] = interval(samples[:, k])
            out["ci95"]["modelled_speedup"][k] = interval(samples[:, k] / costs[k])
    out |= best_drafts(out["modelled_speedup"], samples, costs, measured, tokens)
    return out


def best_drafts(speed, samples, costs, measured: list[int], tokens: int) -> dict:
    """The draft length of the best modelled speedup, if it clears the runner-up (see
    ``depth_figures``); a single measured depth is best only against nothing to beat."""
    if not measured:
        return {"best_drafts": None, "undecided": "too few drafts at every depth"}
    order = sorted(measured, key=lambda k: -speed[k])
    best = order[0]
    if len(order) == 1:
        return {"best_drafts": best + 1, "undecided": None}
    second = order[1]
    if samples is None:
        return {
            "best_drafts": None,
            "undecided": f"not decided at {tokens} tokens (too few windows)",
        }
    diff = samples[:, best] / costs[best] - samples[:, second] / costs[second]
    ci = interval(diff)
    if ci is not None and ci[0] > 0:
        return {"best_drafts": best + 1, "undecided": None}
    return {
        "best_drafts": None,
        "undecided": f"not decided at {tokens} tokens ({best + 1} and {second + 1} drafts "
        "within each other's interval)",
    }


def merge(fig: dict, more: dict) -> None:
    """Add ``more``'s figures to ``fig``'s, domains and intervals merged, not replaced."""
    for k, v in more.items():
        if k == "domains":
            for g, d in v.items():
                merge(fig.setdefault("domains", {}).setdefault(g, {}), d)
        elif k == "ci95":
            fig.setdefault("ci95", {}).update(v)
        else:
            fig[k] = v
